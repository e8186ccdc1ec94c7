"""nn.jit: compile cache, trace counts against Linen, rng counters, static
arguments.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lifted_check import BACKENDS, X4, mlp, check
import liftmods as lnn

pytestmark = pytest.mark.usefixtures('fast_compiles')


def _counting(nn, counter):
  class Counted(nn.Module):
    @nn.compact
    def __call__(self, x):
      counter.append(x.shape)
      return nn.Dense(2)(x)
  return Counted


@pytest.mark.parametrize('nn', BACKENDS, ids=['flax', 'liftmods'])
def test_jit_compile_cache(nn):
  counter = []
  m = nn.jit(_counting(nn, counter))()
  v = m.init(jax.random.key(0), X4)
  counter.clear()
  ys = [m.apply(v, X4) for _ in range(3)]
  assert len(counter) == 1, counter
  for y in ys[1:]:
    np.testing.assert_array_equal(y, ys[0])
  m.apply(v, X4 + 1.0)  # same shape: cache hit
  assert len(counter) == 1
  m.apply(v, jnp.ones((5, 3)))  # new shape: new trace
  assert len(counter) == 2
  m.apply(v, jnp.ones((5, 3)))
  assert len(counter) == 2


def test_jit_trace_counts_match_flax():
  counts = {}
  for nn in BACKENDS:
    counter = []
    m = nn.jit(_counting(nn, counter))()
    v = m.init(jax.random.key(0), X4)
    n_init = len(counter)
    for _ in range(3):
      m.apply(v, X4)
    m.apply(v, jnp.ones((6, 3)))
    counts[nn] = (n_init, len(counter))
  assert counts[lnn] == counts[fnn]


@pytest.mark.parametrize('pass_rngs', [False, True])
def test_jit_shared_submodule_trace_counts(pass_rngs):
  """A jitted submodule called twice per apply: after the first apply,
  further applies hit the compile cache, and liftmods never traces more
  often than Flax (it may trace less: calls whose rng states differ only in
  untouched child counters share one compiled function)."""
  counts = {}
  for nn in BACKENDS:
    counter = []

    class Lin(nn.Module):
      @nn.jit
      @nn.compact
      def __call__(self, x):
        counter.append(x.shape)
        return nn.Dense(3)(x)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        d = Lin()
        return d(x) + d(x)

    m = Model()
    v = m.init(jax.random.key(0), X4)
    seq = [len(counter)]
    for i in range(3):
      m.apply(v, X4, rngs={'dropout': jax.random.key(i)} if pass_rngs
              else None)
      seq.append(len(counter))
    counts[nn] = seq
  assert all(a <= b for a, b in zip(counts[lnn], counts[fnn])), counts
  assert counts[lnn][-1] == counts[lnn][-2] == counts[lnn][-3]


def test_jit_dropout_called_twice_rng_counters():
  def build(nn):
    class Drop(nn.Module):
      @nn.jit
      @nn.compact
      def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(x)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        d = Drop()
        a = d(x)
        b = d(x)
        c = Drop()(x)
        return a, b, c, jax.random.key_data(self.make_rng('dropout'))
    return Model()

  x = jnp.ones((4, 6))
  r = check(build, (x,), rng_names=('dropout',), grads=False)
  a, b, c, key = r['out'][lnn]
  assert not np.array_equal(a, b)
  fa, fb, fc, fkey = r['out'][fnn]
  np.testing.assert_array_equal(a, fa)
  np.testing.assert_array_equal(b, fb)
  np.testing.assert_array_equal(c, fc)
  np.testing.assert_array_equal(key, fkey)


def test_jit_class_dropout_called_twice():
  def build(nn):
    JDrop = nn.jit(nn.Dropout)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        d = JDrop(0.5, deterministic=False)
        return d(x), d(x), nn.Dropout(0.5, deterministic=False)(x)
    return Model()

  x = jnp.ones((4, 6))
  r = check(build, (x,), rng_names=('dropout',), grads=False)
  for a, b in zip(r['out'][lnn], r['out'][fnn]):
    np.testing.assert_array_equal(a, b)


def test_jit_static_argnums():
  def build(nn):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, mode: str):
        h = nn.Dense(3)(x)
        return nn.relu(h) if mode == 'relu' else jnp.sin(h)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        B = nn.jit(Block, static_argnums=(2,))
        b = B()
        return b(x, 'relu') + b(x, 'sin')
    return Model()

  check(build, (X4,))


def test_jit_then_vmap():
  def build(nn):
    return nn.vmap(nn.jit(mlp(nn)), variable_axes={'params': 0},
                   split_rngs={'params': True})(2)

  check(build, (X4,))
