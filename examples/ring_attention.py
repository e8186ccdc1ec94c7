r"""Ring attention: self-attention over a sequence split across devices.

``RingAttention`` is an ordinary module written for one shard of the
sequence. Under ``nn.shard_map`` over a mesh axis (``'seq'`` here) each
device holds one block of the sequence: it projects its block to queries,
keys and values, then passes the key/value blocks around the ring of
devices with ``jax.lax.ppermute``, one hop per step. After as many steps as
there are devices every query block has met every key block, and the
softmax is accumulated block by block with the online (running maximum,
running sum) normalisation, so no device ever holds the whole sequence's
scores. With ``ring_axis=None`` the same module computes plain full
attention on the whole sequence, from the same parameters.

  python -m examples.ring_attention            # 8 simulated CPU devices
  python -m examples.ring_attention --causal --seq=256

prints the largest differences between the two paths: outputs, and
gradients with respect to the parameters and the input.
"""
import os

if __name__ == '__main__':
  # The device count is fixed when JAX starts.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8')

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import liftmods as nn


def ring_attention(query, key, value, axis: str, causal: bool = False):
  """Attention of this shard's queries against the whole ring's keys.

  Called inside ``shard_map``: each argument is this device's block of the
  sequence, the blocks laid out in the order of the devices along ``axis``.

  Args:
    query: ``[batch..., block, heads, depth]``.
    key: ``[batch..., block, heads, depth]``.
    value: ``[batch..., block, heads, v_depth]``.
    axis: the mesh axis the sequence is split over.
    causal: each position attends only to itself and earlier positions
      (of the whole sequence).

  Returns:
    ``[batch..., block, heads, v_depth]``: this block's attention outputs,
    equal (to rounding) to the same rows of full attention.
  """
  n = lax.axis_size(axis)
  me = lax.axis_index(axis)
  block = query.shape[-3]
  query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
  q_pos = me * block + jnp.arange(block)

  def scores(key, source):
    """Logits ``[batch..., heads, q, k]`` against the key block that started
    on device ``source``; masked entries get the most negative float, as in
    ``nn.dot_product_attention``."""
    s = jnp.einsum('...qhd,...khd->...hqk', query, key)
    if causal:
      k_pos = source * block + jnp.arange(block)
      s = jnp.where(k_pos[None, :] <= q_pos[:, None], s,
                    jnp.finfo(s.dtype).min)
    return s

  # Own block first: with a causal mask every row keeps its diagonal, so the
  # running maximum starts finite.
  s = scores(key, me)
  m = s.max(-1)
  p = jnp.exp(s - m[..., None])
  acc = (jnp.einsum('...hqk,...khd->...hqd', p, value), m, p.sum(-1))
  ring = [(i, (i + 1) % n) for i in range(n)]

  def step(carry, t):
    (out, m, total), key, value = carry
    key, value = lax.ppermute((key, value), axis, ring)
    s = scores(key, (me - t) % n)  # the block that started t hops back
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    rescale = jnp.exp(m - m_new)
    out = (out * rescale[..., None] +
           jnp.einsum('...hqk,...khd->...hqd', p, value))
    total = total * rescale + p.sum(-1)
    return ((out, m_new, total), key, value), None

  (acc, _, _), _ = lax.scan(step, (acc, key, value), jnp.arange(1, n))
  out, _, total = acc
  return jnp.swapaxes(out / total[..., None], -3, -2)


class RingAttention(nn.Module):
  """Multi-head self-attention whose sequence may be split over a ring.

  Attributes:
    num_heads: attention heads.
    head_dim: features per head of queries, keys and values.
    causal: each position attends only to itself and earlier positions.
    ring_axis: the mesh axis the sequence is split over; the module then
      runs inside ``nn.shard_map`` over it (see ``sequence_parallel``) and
      its input is one block of the sequence. None: full attention on the
      whole sequence.
  """
  num_heads: int
  head_dim: int
  causal: bool = False
  ring_axis: str | None = None

  @nn.compact
  def __call__(self, x):
    """``x``: ``[batch..., length, features]`` (this shard's block of the
    length under a ring); returns the same shape."""
    project = functools.partial(nn.DenseGeneral,
                                features=(self.num_heads, self.head_dim))
    q, k, v = (project(name=name)(x) for name in ('query', 'key', 'value'))
    if self.ring_axis is None:
      mask = (nn.make_causal_mask(jnp.ones(x.shape[:-1]))
              if self.causal else None)
      y = nn.dot_product_attention(q, k, v, mask=mask)
    else:
      y = ring_attention(q, k, v, self.ring_axis, self.causal)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name='out')(y)


def sequence_parallel(num_heads: int, head_dim: int, causal: bool = False,
                      *, ring_axis: str = 'seq', batch_axis: str | None = None,
                      mesh: Any = None, name: str | None = None) -> nn.Module:
  """A ``RingAttention`` whose sequence is split over ``ring_axis``.

  It takes and returns whole (global) ``[batch, length, features]`` arrays,
  and has the parameters ``RingAttention(num_heads, head_dim, causal)``
  would have, replicated on every device: each shard projects its own block
  with the whole weights.

  Args:
    num_heads: attention heads.
    head_dim: features per head.
    causal: causal masking over the whole sequence.
    ring_axis: the mesh axis that splits the length (the ring).
    batch_axis: a mesh axis that splits the batch as well, or None.
    mesh: the mesh (None: the one set with ``jax.set_mesh``).
    name: the module's name in its parent (None: automatic).

  Returns:
    The module.
  """
  spec = P(batch_axis, ring_axis)
  layer = nn.shard_map(
      RingAttention, mesh=mesh, in_specs=spec, out_specs=spec,
      # The body needs whole weights, whatever their metadata says outside;
      # the same init key on every shard makes the copies equal.
      variable_specs={'params': P()}, split_rngs={'params': False})
  return layer(num_heads, head_dim, causal, ring_axis=ring_axis, name=name)


def max_abs_diff(a, b) -> float:
  """The largest absolute difference between two trees of arrays."""
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(
      jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
      strict=True))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=2)
  parser.add_argument('--seq', type=int, default=128,
                      help='whole sequence length (a multiple of the devices)')
  parser.add_argument('--features', type=int, default=32)
  parser.add_argument('--heads', type=int, default=4)
  parser.add_argument('--head-dim', type=int, default=8)
  parser.add_argument('--causal', action='store_true')
  args = parser.parse_args()

  devices = jax.device_count()
  mesh = jax.make_mesh((devices,), ('seq',), axis_types=(AxisType.Auto,))
  x = jax.random.normal(jax.random.key(1),
                        (args.batch, args.seq, args.features))
  dims = (args.heads, args.head_dim, args.causal)
  ring, full = sequence_parallel(*dims), RingAttention(*dims)
  weights = jax.random.normal(jax.random.key(2), x.shape)

  def loss(model, variables, x):
    return (model.apply(variables, x) * weights).sum()

  with jax.set_mesh(mesh):
    variables = jax.jit(ring.init)(jax.random.key(0), x)
    assert max_abs_diff(
        variables, jax.jit(full.init)(jax.random.key(0), x)) == 0.0
    y_ring = jax.jit(ring.apply)(variables, x)
    g_ring = jax.jit(jax.grad(functools.partial(loss, ring),
                              argnums=(0, 1)))(variables, x)
  y_full = jax.jit(full.apply)(variables, x)
  g_full = jax.jit(jax.grad(functools.partial(loss, full),
                            argnums=(0, 1)))(variables, x)

  print(f'ring attention over {devices} devices, {args.seq // devices} '
        f'positions each ({"causal" if args.causal else "full"} mask), '
        'against one-device attention with the same parameters:')
  for what, a, b in (('outputs', y_ring, y_full),
                     ('d loss / d params', g_ring[0], g_full[0]),
                     ('d loss / d input', g_ring[1], g_full[1])):
    scale = max(float(jnp.max(jnp.abs(leaf)))
                for leaf in jax.tree_util.tree_leaves(b))
    print(f'  {what:17s}  max |diff| {max_abs_diff(a, b):.2e}  '
          f'(largest entry {scale:.2e})')


if __name__ == '__main__':
  main()
