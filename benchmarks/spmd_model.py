"""A small MaxText/T5X-style decoder written once against either library
(``lib`` is ``liftmods`` or ``flax.linen``), used by ``benchmarks.spmd`` and
by the multi-device tests.

Every parameter carries axis names: logical names ('vocab', 'embed',
'heads', 'kv', 'mlp', with the scanned 'layers') mapped through rules, or,
with ``logical=False``, mesh axis names directly (``MESH_NAMES``).
``t5x_decoder`` is the same shape of model written with the older
``partitioning.param_with_axes`` / ``scan_with_axes`` API.
"""
import dataclasses

import jax
import jax.numpy as jnp

# Logical-to-mesh rules for a (data, fsdp, tensor) mesh.
RULES = (('batch', ('data', 'fsdp')), ('vocab', 'tensor'), ('embed', 'fsdp'),
         ('heads', 'tensor'), ('mlp', 'tensor'), ('kv', None),
         ('layers', None), ('length', None))
# What the rules above give, for a model annotated with mesh names.
MESH_NAMES = {'vocab': 'tensor', 'embed': 'fsdp', 'heads': 'tensor',
              'mlp': 'tensor', 'kv': None, 'layers': None}


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 32
  embed: int = 16
  heads: int = 2
  head_dim: int = 8
  mlp: int = 32
  layers: int = 4


def decoder(lib, cfg: Config = Config(), logical: bool = True):
  """The decoder as a ``lib`` Module instance: tokens [b, s] -> logits."""

  def part(init, names):
    if logical:
      return lib.with_logical_partitioning(init, names)
    return lib.with_partitioning(init, tuple(MESH_NAMES[n] for n in names))

  lecun = lib.initializers.lecun_normal()
  ones, zeros = lib.initializers.ones_init(), lib.initializers.zeros_init()

  class Attention(lib.Module):

    @lib.compact
    def __call__(self, x):
      def proj(name):
        return lib.DenseGeneral(
            (cfg.heads, cfg.head_dim), use_bias=False, name=name,
            kernel_init=part(lecun, ('embed', 'heads', 'kv')))(x)

      q, k, v = proj('query'), proj('key'), proj('value')
      out = lib.dot_product_attention(q, k, v)
      return lib.DenseGeneral(cfg.embed, axis=(-2, -1), use_bias=False,
                              name='out',
                              kernel_init=part(lecun, ('heads', 'kv',
                                                       'embed')))(out)

  class Mlp(lib.Module):

    @lib.compact
    def __call__(self, x):
      h = lib.Dense(cfg.mlp, kernel_init=part(lecun, ('embed', 'mlp')),
                    bias_init=part(zeros, ('mlp',)), name='wi')(x)
      h = lib.with_logical_constraint(lib.gelu(h), ('batch', 'length', 'mlp'))
      return lib.Dense(cfg.embed, use_bias=False, name='wo',
                       kernel_init=part(lecun, ('mlp', 'embed')))(h)

  class Layer(lib.Module):

    @lib.compact
    def __call__(self, x, _):
      h = lib.RMSNorm(scale_init=part(ones, ('embed',)), name='pre_attn')(x)
      x = x + Attention(name='attn')(h)
      h = lib.LayerNorm(scale_init=part(ones, ('embed',)),
                        bias_init=part(zeros, ('embed',)), name='pre_mlp')(x)
      x = x + Mlp(name='mlp')(h)
      return lib.with_logical_constraint(x, ('batch', 'length', 'embed')), None

  class Decoder(lib.Module):

    @lib.compact
    def __call__(self, tokens):
      embed = lib.Embed(cfg.vocab, cfg.embed, name='embed',
                        embedding_init=part(lib.initializers.normal(1.0),
                                            ('vocab', 'embed')))
      x = embed(tokens)
      stack = lib.scan(
          Layer, variable_axes={'params': 0}, split_rngs={'params': True},
          length=cfg.layers, metadata_params={
              lib.PARTITION_NAME: 'layers' if logical else None})
      x, _ = stack(name='layers')(x, None)
      x = lib.RMSNorm(scale_init=part(ones, ('embed',)), name='final_norm')(x)
      return embed.attend(x)

  return Decoder()


def t5x_decoder(lib, part, cfg: Config = Config()):
  """The decoder in the older API (``part`` is ``lib.partitioning``): plain
  parameters, their names in ``params_axes``."""
  lecun = lib.initializers.lecun_normal()

  class DenseT5(lib.Module):
    features: tuple
    axes: tuple
    contract: tuple = (-1,)

    @lib.compact
    def __call__(self, x):
      shape = tuple(x.shape[a] for a in self.contract) + self.features
      w = part.param_with_axes('kernel', lecun, shape, axes=self.axes)
      dims = ((tuple(a % x.ndim for a in self.contract),
               tuple(range(len(self.contract)))), ((), ()))
      return jax.lax.dot_general(x, w, dims)

  class Norm(lib.Module):

    @lib.compact
    def __call__(self, x):
      scale = part.param_with_axes('scale', lib.initializers.ones,
                                   (x.shape[-1],), axes=('embed',))
      return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

  class Layer(lib.Module):

    @lib.compact
    def __call__(self, x, _):
      h = Norm(name='pre_attn')(x)
      q = DenseT5((cfg.heads, cfg.head_dim), ('embed', 'heads', 'kv'),
                  name='query')(h)
      o = DenseT5((cfg.embed,), ('heads', 'kv', 'embed'), (-2, -1),
                  name='out')(q)
      x = x + o
      h = Norm(name='pre_mlp')(x)
      h = DenseT5((cfg.mlp,), ('embed', 'mlp'), name='wi')(h)
      h = part.with_sharding_constraint(h, ('batch', 'length', 'mlp'))
      return x + DenseT5((cfg.embed,), ('mlp', 'embed'), name='wo')(h), None

  class Decoder(lib.Module):

    @lib.compact
    def __call__(self, tokens):
      table = part.param_with_axes('embedding', lib.initializers.normal(1.0),
                                   (cfg.vocab, cfg.embed),
                                   axes=('vocab', 'embed'))
      x = table[tokens]
      stack = part.scan_with_axes(Layer, variable_axes={'params': 0},
                                  split_rngs={'params': True},
                                  length=cfg.layers)
      x, _ = stack(name='layers')(x, None)
      return Norm(name='final_norm')(x) @ table.T

  return Decoder()
