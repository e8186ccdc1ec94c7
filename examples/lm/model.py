"""A decoder-only Transformer language model, written as ordinary Linen code.

Nothing here is specific to liftmods except the import: change the line
``import liftmods as nn`` to ``import flax.linen as nn`` and the model runs
under Flax with the same variable tree and the same initial parameters
(``benchmarks/models.py`` does exactly that to compare the two).

The blocks are stacked in one place, :func:`stack`, as a scan over a
rematerialized block: one parameter layout with a leading layer axis, the
block traced once, activations recomputed in the backward pass.
"""
import dataclasses

import jax.numpy as jnp

import liftmods as nn


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


class Mlp(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x, train: bool):
    cfg = self.config
    h = nn.gelu(nn.Dense(cfg.d_model * cfg.mlp_ratio, name='fc')(x))
    h = nn.Dense(cfg.d_model, name='proj')(h)
    return nn.Dropout(cfg.dropout_rate, deterministic=not train)(h)


class Block(nn.Module):
  """A pre-norm Transformer block; as a scan body, ``x -> (x, None)``.

  With ``decode=True`` the attention keeps a key/value cache in the
  ``'cache'`` collection and takes one position per call (no mask needed:
  the cache masks positions not yet written).
  """
  config: Config
  decode: bool = False

  @nn.compact
  def __call__(self, x, train: bool):
    cfg = self.config
    mask = None if self.decode else nn.make_causal_mask(x[..., 0])
    h = nn.SelfAttention(num_heads=cfg.num_heads, dropout_rate=cfg.dropout_rate,
                         deterministic=not train, decode=self.decode,
                         name='attn')(nn.LayerNorm(name='ln_attn')(x), mask)
    x = x + nn.Dropout(cfg.dropout_rate, deterministic=not train)(h)
    x = x + Mlp(cfg, name='mlp')(nn.LayerNorm(name='ln_mlp')(x), train)
    return x, None


def stack(config: Config, decode: bool, name: str):
  """The layer stack: ``num_layers`` blocks as one scanned, rematerialized
  module, its parameters and cache stacked on a leading layer axis.

  This is the one place to change to stack the blocks another way.
  """
  body = nn.remat(Block, static_argnums=(2,))
  return nn.scan(body, variable_axes={'params': 0, 'cache': 0},
                 split_rngs={'params': True, 'dropout': True},
                 in_axes=(nn.broadcast,), length=config.num_layers)(
                     config, decode, name=name)


class TransformerLM(nn.Module):
  """Maps ``[batch, length]`` byte tokens to ``[batch, length, vocab]`` logits.

  The output projection is the token embedding itself (``Embed.attend``).
  With ``decode=True`` it takes one token per call (``[batch, 1]``) and
  keeps its position and the attention caches in ``'cache'``.
  """
  config: Config
  decode: bool = False

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, name='embed')
    x = embed(tokens) + self.positions(tokens)
    x = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x)
    x, _ = stack(cfg, self.decode, name='blocks')(x, train)
    return embed.attend(nn.LayerNorm(name='ln_out')(x))

  def positions(self, tokens):
    """Learned position embeddings for the positions of ``tokens``."""
    cfg = self.config
    table = self.param('pos_embed', nn.initializers.normal(0.02),
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
