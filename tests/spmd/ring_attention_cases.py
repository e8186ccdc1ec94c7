"""examples/ring_attention.py on 8 simulated CPU devices: the ring (the
sequence split over a mesh axis, key/value blocks passed on with
``lax.ppermute`` under ``nn.shard_map``) against full attention on the
whole sequence with the same parameters. Not collected by the main run:
``test_ring_attention.py`` runs this file in a fresh process (the device
count is fixed when JAX starts). By hand: ``python -m pytest
tests/spmd/ring_attention_cases.py``.

Tolerance: the two paths sum the softmax in different orders, so they agree
to float32 rounding, not bit for bit. Every comparison asserts
``max |ring - full| <= TOL * max |full|`` over a whole tree, TOL = 1e-6
(about 8 float32 ulps of the largest entry). Measured with these shapes on
jax 0.10.2 and 0.12.0.1 (the same on Auto and Explicit meshes): outputs
1.2e-7 to 1.7e-7 of the largest entry, parameter gradients 2.2e-7 to
3.2e-7, input gradients 2.0e-7 to 3.5e-7.
"""
import multidevice

multidevice.simulate(8)

import functools  # pylint: disable=g-import-not-at-top

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import liftmods as nn
from examples.ring_attention import RingAttention, sequence_parallel
from program_compare import assert_match, optimized_hlo

multidevice.require(8)

TOL = 1e-6
KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (2, 32, 16))  # 4 positions a device
WEIGHTS = jax.random.normal(jax.random.key(2), X.shape)
DIMS = dict(num_heads=2, head_dim=8)
AXIS_TYPES = {'auto': AxisType.Auto, 'explicit': AxisType.Explicit}


def ring_mesh(kind='auto'):
  return jax.make_mesh((8,), ('seq',), axis_types=(AXIS_TYPES[kind],))


def relative_error(a, b) -> float:
  """``max |a - b| / max |b|`` over the leaves of two trees."""
  a, b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(a) == len(b)
  diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))
  return diff / max(float(jnp.max(jnp.abs(y))) for y in b)


def loss(model, variables, x):
  return (model.apply(variables, x) * WEIGHTS).sum()


def value_and_grads(model, variables, x):
  """Output, and the gradients with respect to the variables and ``x``."""
  y = jax.jit(model.apply)(variables, x)
  grads = jax.jit(jax.grad(functools.partial(loss, model),
                           argnums=(0, 1)))(variables, x)
  return y, grads


@pytest.mark.parametrize('kind', sorted(AXIS_TYPES))
@pytest.mark.parametrize('causal', [False, True])
def test_ring_equals_full_attention(causal, kind):
  ring = sequence_parallel(causal=causal, **DIMS)
  full = RingAttention(causal=causal, **DIMS)
  with jax.set_mesh(ring_mesh(kind)):
    ring_init = jax.jit(ring.init)
    variables = ring_init(KEY, X)
    ring_hlo = optimized_hlo(ring_init, KEY, X)
    y, (g_vars, g_x) = value_and_grads(ring, variables, X)
  # Replicated parameters, made with one key on every shard: the tree and
  # the values of the unsharded init (bitwise where the two inits compile to
  # the same per-device program, else the initializer's float32 rounding).
  full_init = jax.jit(full.init)
  reference = full_init(KEY, X)
  assert all(a.sharding.is_fully_replicated
             for a in jax.tree_util.tree_leaves(variables))
  assert_match(variables, reference,
               [(ring_hlo, optimized_hlo(full_init, KEY, X))], rtol=1e-6,
               atol=1e-7)
  y_full, (g_vars_full, g_x_full) = value_and_grads(full, reference, X)
  assert relative_error(y, y_full) <= TOL
  assert relative_error(g_vars, g_vars_full) <= TOL
  assert relative_error(g_x, g_x_full) <= TOL
  # Each device holds its block of the output.
  assert y.sharding.is_equivalent_to(
      NamedSharding(ring_mesh(kind), P(None, 'seq')), y.ndim)


def test_causal_mask_reaches_across_blocks():
  """Changing the last device's block leaves every earlier position's
  output as it was under the causal ring, and changes them without it."""
  later = X.at[:, 28:].add(1.0)
  for causal in (True, False):
    ring = sequence_parallel(causal=causal, **DIMS)
    with jax.set_mesh(ring_mesh()):
      variables = jax.jit(ring.init)(KEY, X)
      before = jax.jit(ring.apply)(variables, X)
      after = jax.jit(ring.apply)(variables, later)
    assert np.array_equal(before[:, :28], after[:, :28]) == causal


def test_the_blocks_travel_by_collective_permute():
  ring = sequence_parallel(**DIMS)
  with jax.set_mesh(ring_mesh()):
    variables = jax.jit(ring.init)(KEY, X)
    hlo = jax.jit(ring.apply).lower(variables, X).compile().as_text()
  assert 'collective-permute' in hlo
  assert 'all-gather' not in hlo  # no device assembles the sequence


def test_batch_and_sequence_both_split():
  ring = sequence_parallel(causal=True, batch_axis='data', **DIMS)
  full = RingAttention(causal=True, **DIMS)
  mesh = jax.make_mesh((2, 4), ('data', 'seq'),
                       axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    variables = jax.jit(ring.init)(KEY, X)
    y, grads = value_and_grads(ring, variables, X)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P('data', 'seq')),
                                     y.ndim)
  y_full, grads_full = value_and_grads(full, variables, X)
  assert relative_error(y, y_full) <= TOL
  assert relative_error(grads, grads_full) <= TOL


class Encoder(nn.Module):
  """Two pre-norm attention layers under ``nn.scan`` of ``nn.remat``; the
  attention is the ring when ``ring`` is set."""
  ring: bool

  @nn.compact
  def __call__(self, x):
    def layer(module, x, _):
      h = nn.LayerNorm(name='norm')(x)
      attend = (sequence_parallel(causal=True, name='attn', **DIMS)
                if module.ring else
                RingAttention(causal=True, name='attn', **DIMS))
      return x + attend(h), None

    stack = nn.scan(nn.remat(layer), variable_axes={'params': 0},
                    split_rngs={'params': True}, length=2)
    return stack(self, x, None)[0]


def test_inside_scan_and_remat():
  with jax.set_mesh(ring_mesh()):
    variables = jax.jit(Encoder(ring=True).init)(KEY, X)
    y, grads = value_and_grads(Encoder(ring=True), variables, X)
  reference = jax.jit(Encoder(ring=False).init)(KEY, X)
  assert (jax.tree_util.tree_structure(variables) ==
          jax.tree_util.tree_structure(reference))
  assert relative_error(variables, reference) == 0.0
  assert variables['params']['attn']['query']['kernel'].shape == (2, 16, 2, 8)
  y_full, grads_full = value_and_grads(Encoder(ring=False), reference, X)
  assert relative_error(y, y_full) <= TOL
  assert relative_error(grads, grads_full) <= TOL
