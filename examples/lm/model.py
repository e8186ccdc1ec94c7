"""A decoder-only Transformer language model, written as ordinary Linen code.

Nothing here is specific to liftmods except the import: change the line
``import liftmods as nn`` to ``import flax.linen as nn`` and the model runs
under Flax with the same variable tree and the same initial parameters
(``benchmarks/models.py`` does exactly that to compare the two).

The blocks are stacked in one place, :func:`stack`: with liftmods an
``nn.Stack`` (one parameter layout with a leading layer axis, the block traced
once, activations recomputed in the backward pass); under flax.linen, which
has no layer stack, the same program written by hand as ``nn.scan`` over
``nn.remat``.

Every kernel and embedding carries logical axis names
(``nn.with_logical_partitioning``), so ``nn.init_sharded`` can create the
parameters directly in their shards and a step can run on a device mesh;
:data:`LOGICAL_RULES` maps the names onto a ``('data', 'model')`` mesh.
"""
import dataclasses
from typing import Any, Callable

from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

import liftmods as nn

# Logical axis -> mesh axis for the parameters: attention heads, the MLP's
# hidden units and the vocabulary over 'model'; the rest replicate. (The
# batch is split over 'data' by the training loop's input sharding.)
LOGICAL_RULES = (('heads', 'model'), ('mlp', 'model'), ('vocab', 'model'),
                 ('embed', None), ('kv', None), ('length', None),
                 ('layers', None))


def _named(init, *names):
  return nn.with_logical_partitioning(init, names)


_KERNEL = nn.linear.default_kernel_init  # the layers' own defaults
_EMBED = nn.linear.default_embed_init


@dataclasses.dataclass(frozen=True)
class Config:
  """Model hyperparameters."""
  vocab_size: int = 256
  max_len: int = 128
  num_layers: int = 4
  num_heads: int = 4
  d_model: int = 128
  mlp_ratio: int = 4
  dropout_rate: float = 0.1
  # An nn.Pipeline runs the blocks as stages over a mesh axis (liftmods
  # only; decoding runs the stack unpipelined on the same parameters, which
  # needs repeats=1 or Pipeline.to_stack_layout first).
  pipeline: Any = None
  # An attention_fn that applies the causal mask itself (liftmods:
  # functools.partial(nn.fused_dot_product_attention, is_causal=True)).
  # Full-sequence calls then use it with no mask; decoding, whose single
  # query is masked by the cache, keeps the layer's default attention. None
  # (the default) is Linen's attention with nn.make_causal_mask.
  causal_attention_fn: Any = None


class Mlp(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x, train: bool):
    cfg = self.config
    h = nn.Dense(cfg.d_model * cfg.mlp_ratio, name='fc',
                 kernel_init=_named(_KERNEL, 'embed', 'mlp'))(x)
    # The name lets a remat policy keep (or offload) this activation.
    h = checkpoint_name(nn.gelu(h), 'mlp_up')
    h = nn.Dense(cfg.d_model, name='proj',
                 kernel_init=_named(_KERNEL, 'mlp', 'embed'))(h)
    return nn.Dropout(cfg.dropout_rate, deterministic=not train)(h)


class Block(nn.Module):
  """A pre-norm Transformer block, ``x -> x``.

  With ``decode=True`` the attention keeps a key/value cache in the
  ``'cache'`` collection and takes one position per call (no mask needed:
  the cache masks positions not yet written).
  """
  config: Config
  decode: bool = False

  @nn.compact
  def __call__(self, x, train: bool):
    cfg = self.config
    # causal_attention_fn masks the future itself; decoding's cache does.
    fused = cfg.causal_attention_fn is not None and not self.decode
    fn = {'attention_fn': cfg.causal_attention_fn} if fused else {}
    mask = None if self.decode or fused else nn.make_causal_mask(x[..., 0])
    h = nn.SelfAttention(
        num_heads=cfg.num_heads, dropout_rate=cfg.dropout_rate,
        deterministic=not train, decode=self.decode, name='attn',
        kernel_init=_named(_KERNEL, 'embed', 'heads', 'kv'),
        out_kernel_init=_named(_KERNEL, 'heads', 'kv', 'embed'), **fn)(
            nn.LayerNorm(name='ln_attn')(x), mask)
    x = x + nn.Dropout(cfg.dropout_rate, deterministic=not train)(h)
    return x + Mlp(cfg, name='mlp')(nn.LayerNorm(name='ln_mlp')(x), train)


class _ScanBody(Block):
  """``Block`` as an ``nn.scan`` body, ``x -> (x, None)`` (flax.linen only)."""

  def __call__(self, x, train: bool):
    return super().__call__(x, train), None


def stack(config: Config, decode: bool, name: str):
  """The layer stack: ``num_layers`` blocks as one module, its parameters
  and cache stacked on a leading layer axis named ``'layers'``, each block
  rematerialized in the backward pass (only the carries between blocks are
  kept).

  This is the one place to change to stack the blocks another way, e.g.
  ``policy='nested'`` for O(sqrt(L)) memory or ``mode='unrolled'``;
  ``config.pipeline`` pipelines the stack over a mesh axis.
  """
  if hasattr(nn, 'Stack'):  # liftmods
    pipeline = None if decode else config.pipeline
    return nn.Stack(Block, config.num_layers, policy='full',
                    pipeline=pipeline)(config, decode, name=name)
  body = nn.remat(_ScanBody, static_argnums=(2,))
  scanned = nn.scan(body, variable_axes={'params': 0, 'cache': 0},
                    split_rngs={'params': True, 'dropout': True},
                    in_axes=(nn.broadcast,), length=config.num_layers,
                    metadata_params={nn.PARTITION_NAME: 'layers'})(
                        config, decode, name=name)
  return lambda x, train: scanned(x, train)[0]


class TransformerLM(nn.Module):
  """Maps ``[batch, length]`` byte tokens to ``[batch, length, vocab]`` logits.

  The output projection is the token embedding itself (``Embed.attend``).
  With ``decode=True`` it takes one token per call (``[batch, 1]``) and
  keeps its position and the attention caches in ``'cache'``. ``stack_fn``
  (default :func:`stack`) builds the layer stack, with the signature of
  :func:`stack`; ``benchmarks/scaling.py`` passes other remat policies.
  """
  config: Config
  decode: bool = False
  stack_fn: Callable[..., Any] | None = None

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, name='embed',
                     embedding_init=_named(_EMBED, 'vocab', 'embed'))
    x = embed(tokens) + self.positions(tokens)
    x = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x)
    x = (self.stack_fn or stack)(cfg, self.decode, name='blocks')(x, train)
    return embed.attend(nn.LayerNorm(name='ln_out')(x))

  def positions(self, tokens):
    """Learned position embeddings for the positions of ``tokens``."""
    cfg = self.config
    table = self.param('pos_embed',
                       _named(nn.initializers.normal(0.02), 'length', 'embed'),
                       (cfg.max_len, cfg.d_model))
    length = tokens.shape[-1]
    if not self.decode:
      return table[:length]
    initialized = self.has_variable('cache', 'index')
    index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
    if not initialized:  # the call that creates the cache sizes it only
      return table[:length]
    i = index.value
    index.value = i + 1
    return table[i][None]
