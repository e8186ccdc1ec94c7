"""One side of the Hugging Face differential test, run in its own process.

``python -m tests.compat.hf_side {flax,liftmods} OUT.npz [MODEL ...]``
builds tiny transformers Flax models from configs (no weights are
downloaded), runs them and saves every array it compares: the initial
parameters, eval and train outputs (dropout key fixed), the gradients of a
scalar loss and greedy generations with the key/value cache. With
``liftmods`` the switch :mod:`liftmods.compat` is installed before
transformers is imported, so its unmodified ``import flax.linen as nn`` gets
liftmods.

transformers 4.46 calls ``jnp.clip(x, a_min=..., a_max=...)``, which current
JAX rejects; :func:`shim_jnp_clip` maps those keywords to ``min`` / ``max``.
Both sides apply it identically, before transformers is imported.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tests.compat.differential import flat, run_side


def shim_jnp_clip():
  clip = jnp.clip
  if getattr(clip, 'accepts_a_min', False):
    return

  def clip_with_old_keywords(x, min=None, max=None, *args, a_min=None,
                             a_max=None, **kwargs):
    min = a_min if min is None else min
    max = a_max if max is None else max
    return clip(x, min, max, *args, **kwargs)

  clip_with_old_keywords.accepts_a_min = True
  jnp.clip = clip_with_old_keywords


def _tokens(batch, length, vocab, seed):
  return np.asarray(np.random.RandomState(seed).randint(3, vocab,
                                                        (batch, length)),
                    np.int32)


def _common(name, model, inputs, out, loss_of, gen_inputs=None):
  """Params, eval/train outputs, gradients and (optionally) generation."""
  params = model.params
  flat(f'{name}/params', params, out)
  dropout = jax.random.key(7)
  eval_out = model(**inputs, params=params, train=False)
  flat(f'{name}/eval', loss_of(eval_out), out)
  train_out = model(**inputs, params=params, dropout_rng=dropout, train=True)
  flat(f'{name}/train', loss_of(train_out), out)

  def loss(p):
    o = model(**inputs, params=p, dropout_rng=dropout, train=True)
    return jnp.mean(jnp.square(loss_of(o).astype(jnp.float32)))

  flat(f'{name}/grads', jax.grad(loss)(params), out)
  if gen_inputs is not None:
    seq = model.generate(**gen_inputs, params=params, max_new_tokens=4,
                         do_sample=False).sequences
    out[f'{name}/generate'] = np.asarray(seq)


def bert(out, checkpointing=False):
  from transformers import BertConfig, FlaxBertForMaskedLM
  config = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=4, intermediate_size=37,
                      max_position_embeddings=64)
  model = FlaxBertForMaskedLM(config, seed=0)
  if checkpointing:
    model.enable_gradient_checkpointing()
  ids = _tokens(2, 11, 97, 1)
  inputs = dict(input_ids=ids, attention_mask=np.ones_like(ids))
  name = 'bert_remat' if checkpointing else 'bert'
  _common(name, model, inputs, out, lambda o: o.logits)


def gpt2(out):
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  config = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=1,
                      n_head=4, bos_token_id=1, eos_token_id=96,
                      pad_token_id=0)
  model = FlaxGPT2LMHeadModel(config, seed=0)
  ids = _tokens(2, 9, 97, 2)
  _common('gpt2', model, dict(input_ids=ids), out, lambda o: o.logits,
          dict(input_ids=ids))


def bart(out):
  from transformers import BartConfig, FlaxBartForConditionalGeneration
  config = BartConfig(vocab_size=97, d_model=32, encoder_layers=1,
                      decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=37,
                      decoder_ffn_dim=37, max_position_embeddings=64,
                      pad_token_id=1, bos_token_id=0, eos_token_id=96,
                      decoder_start_token_id=2, forced_eos_token_id=None,
                      init_std=0.5)
  model = FlaxBartForConditionalGeneration(config, seed=0)
  ids = _tokens(2, 10, 97, 3)
  dec = _tokens(2, 7, 97, 4)
  _common('bart', model, dict(input_ids=ids, decoder_input_ids=dec), out,
          lambda o: o.logits, dict(input_ids=ids))


def vit(out):
  from transformers import FlaxViTForImageClassification, ViTConfig
  config = ViTConfig(image_size=32, patch_size=8, num_channels=3,
                     hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=4, intermediate_size=37,
                     num_labels=5)
  model = FlaxViTForImageClassification(config, seed=0)
  pixels = np.random.RandomState(5).randn(2, 3, 32, 32).astype(np.float32)
  _common('vit', model, dict(pixel_values=pixels), out, lambda o: o.logits)


MODELS = {'bert': bert, 'bert_remat': lambda out: bert(out, True),
          'gpt2': gpt2, 'bart': bart, 'vit': vit}


if __name__ == '__main__':
  run_side(sys.argv[1:], MODELS, shim_jnp_clip)
