r"""A Hugging Face transformers Flax model, unmodified: liftmods vs flax.linen.

Both libraries cannot be ``flax.linen`` in one process, so each side runs in
its own subprocess, started by this binary, timed by the same code: one with
the real ``flax.linen``, one with :mod:`liftmods.compat` installed before
transformers is imported. They run alternately, ``--rounds`` times each, and
the binary prints per-side medians and the liftmods / flax ratios.

The model is ``FlaxGPT2LMHeadModel`` (``--model=gpt2``) or
``FlaxBertForMaskedLM`` (``--model=bert``) built from a small config (no
weights are downloaded). The figure is for one training step
(forward, backward, optax AdamW update) on a fixed batch:

  trace    ``jax.jit(step).trace(...)`` of a fresh wrapper: the Python cost of
           running transformers' model code on the module system.
  step     one call of the compiled step (median of ``--steps``).

  python -m benchmarks.hf --model=gpt2 --rounds=3
"""
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_enum('model', 'gpt2', ['gpt2', 'bert'], 'Model.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Subprocess runs per side.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed compiled steps per run.')
_LAYERS = flags.DEFINE_integer('layers', 4, 'Transformer layers.')
_WIDTH = flags.DEFINE_integer('width', 256, 'Hidden size.')
_SIDE = flags.DEFINE_enum('side', None, ['flax', 'liftmods'],
                          'Internal: run one side in this process.')


def _build(name, layers, width):
  if name == 'gpt2':
    from transformers import FlaxGPT2LMHeadModel, GPT2Config
    config = GPT2Config(vocab_size=1024, n_positions=128, n_embd=width,
                        n_layer=layers, n_head=8)
    return FlaxGPT2LMHeadModel(config, seed=0)
  from transformers import BertConfig, FlaxBertForMaskedLM
  config = BertConfig(vocab_size=1024, hidden_size=width,
                      num_hidden_layers=layers, num_attention_heads=8,
                      intermediate_size=4 * width,
                      max_position_embeddings=128)
  return FlaxBertForMaskedLM(config, seed=0)


def _one_side(side):
  if side == 'liftmods':
    from liftmods import compat
    compat.install()
  from tests.compat.hf_side import shim_jnp_clip
  shim_jnp_clip()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  model = _build(_MODEL.value, _LAYERS.value, _WIDTH.value)
  ids = np.random.RandomState(0).randint(0, 1024, (8, 128)).astype(np.int32)
  opt = optax.adamw(1e-3)
  state = (model.params, opt.init(model.params))

  def step(state, ids, key):
    params, opt_state = state

    def loss_fn(p):
      logits = model(ids, params=p, dropout_rng=key, train=True).logits
      labels = jax.nn.one_hot(ids, logits.shape[-1])
      return optax.softmax_cross_entropy(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  key = jax.random.key(1)
  start = time.perf_counter()
  jax.jit(step).trace(state, ids, key)
  trace_s = time.perf_counter() - start
  compiled = jax.jit(step).lower(state, ids, key).compile()
  state, loss = compiled(state, ids, key)
  loss.block_until_ready()
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    state, loss = compiled(state, ids, key)
    loss.block_until_ready()
    times.append(time.perf_counter() - start)
  print(json.dumps({'trace_s': trace_s, 'step_s': statistics.median(times),
                    'loss': float(loss)}))


def main(argv):
  del argv
  if _SIDE.value:
    _one_side(_SIDE.value)
    return
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  results = {'flax': [], 'liftmods': []}
  for _ in range(_ROUNDS.value):
    for side in results:
      out = subprocess.run(
          [sys.executable, '-m', 'benchmarks.hf', f'--side={side}',
           f'--model={_MODEL.value}', f'--steps={_STEPS.value}',
           f'--layers={_LAYERS.value}', f'--width={_WIDTH.value}'],
          cwd=root, capture_output=True, text=True, check=True)
      results[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
  losses = {s: r[0]['loss'] for s, r in results.items()}
  print(f'model={_MODEL.value} layers={_LAYERS.value} width={_WIDTH.value} '
        f'rounds={_ROUNDS.value} final loss flax={losses["flax"]:.6f} '
        f'liftmods={losses["liftmods"]:.6f}')
  print(f'{"":10s}{"flax.linen":>12s}{"liftmods":>12s}{"ratio":>8s}')
  for key in ('trace_s', 'step_s'):
    f = statistics.median(r[key] for r in results['flax'])
    l = statistics.median(r[key] for r in results['liftmods'])
    print(f'{key[:-2]:10s}{f * 1e3:10.1f}ms{l * 1e3:10.1f}ms{l / f:8.2f}')


if __name__ == '__main__':
  app.run(main)
