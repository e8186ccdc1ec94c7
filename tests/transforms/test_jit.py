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
from liftmods import call_context

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


def _scope_runs(monkeypatch):
  """Counts how many times ``Module.apply`` builds a root scope."""
  from liftmods.core import scope as scope_lib
  runs = []
  real = scope_lib.run

  def counting(*args, **kwargs):
    runs.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(scope_lib, 'run', counting)
  return runs


def test_jit_plain_apply_skips_the_scope_round_trip(monkeypatch):
  """A repeated plain apply of an nn.jit class is one jax.jit call: no root
  scope, no trace, and the same values as jax.jit of the unlifted apply."""
  counter = []
  model = lnn.jit(_counting(lnn, counter))()
  v = model.init(jax.random.key(0), X4)
  want = jax.jit(_counting(lnn, [])().apply)(v, X4)
  runs = _scope_runs(monkeypatch)
  counter.clear()
  first = model.apply(v, X4)
  assert (len(counter), len(runs)) == (1, 1)  # the trace runs apply once
  again = model.apply(v, X4 + 0.0)
  assert (len(counter), len(runs)) == (1, 1)
  np.testing.assert_array_equal(first, want)
  np.testing.assert_array_equal(again, want)
  model.apply(v, jnp.ones((5, 3)))  # a new shape traces again
  assert len(counter) == 2


def test_jit_apply_paths_that_need_scopes_still_take_them(monkeypatch):
  """rngs, mutable collections, capture and method= run the general path
  and give what nn.fold_rngs (nn.jit's rng handling, uncompiled) gives."""
  class Net(lnn.Module):
    @lnn.compact
    def __call__(self, x, train=False):
      x = lnn.Dense(3)(x)
      self.sow('intermediates', 'h', x)
      return lnn.Dropout(0.5, deterministic=not train)(x)

  jitted = lnn.jit(Net, static_argnums=(2,))()
  v = jitted.init(jax.random.key(0), X4)
  runs = _scope_runs(monkeypatch)
  key = {'dropout': jax.random.key(1)}
  for kwargs in (dict(rngs=key), dict(mutable=['intermediates']),
                 dict(capture_intermediates=True), dict(method='__call__')):
    train = 'rngs' in kwargs
    got = jitted.apply(v, X4, train, **kwargs)
    want = lnn.fold_rngs(Net)().apply(v, X4, train, **kwargs)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
  assert len(runs) == 8


def test_jit_plain_apply_of_a_subclass_runs_its_own_call():
  class Doubled(lnn.jit(lnn.Dense)):
    def __call__(self, x):
      return 2 * super().__call__(x)

  v = lnn.Dense(2).init(jax.random.key(0), X4)
  np.testing.assert_array_equal(Doubled(2).apply(v, X4),
                                2 * lnn.Dense(2).apply(v, X4))


def test_jit_plain_apply_keys_on_configuration():
  """Two configurations never share a trace; a module-valued field takes
  the general path and still gives the unlifted values."""
  v3 = lnn.Dense(3).init(jax.random.key(0), X4)
  jitted = lnn.jit(lnn.Dense)
  np.testing.assert_array_equal(jitted(3).apply(v3, X4),
                                lnn.Dense(3).apply(v3, X4))
  np.testing.assert_array_equal(
      jitted(3, use_bias=False).apply({'params': {'kernel': v3['params'][
          'kernel']}}, X4),
      lnn.Dense(3, use_bias=False).apply(
          {'params': {'kernel': v3['params']['kernel']}}, X4))

  class Wrap(lnn.Module):
    inner: lnn.Module

    @lnn.compact
    def __call__(self, x):
      return self.inner(x) + 1.0

  v = Wrap(lnn.Dense(3)).init(jax.random.key(0), X4)
  np.testing.assert_array_equal(lnn.jit(Wrap)(lnn.Dense(3)).apply(v, X4),
                                Wrap(lnn.Dense(3)).apply(v, X4))


def test_jit_plain_apply_declines_where_scopes_matter(monkeypatch):
  """A module-valued field, a call inside a recording and a call inside
  another module's method take the general path (each builds its scope)
  even once the fast path has a compiled entry."""
  model = lnn.jit(lnn.Dense)(3)
  v = model.init(jax.random.key(0), X4)
  want = lnn.Dense(3).apply(v, X4)
  model.apply(v, X4)  # the fast path compiles its entry

  class Wrap(lnn.Module):
    inner: lnn.Module

    @lnn.compact
    def __call__(self, x):
      return self.inner(x)

  class Outer(lnn.Module):
    @lnn.compact
    def __call__(self, x):
      return model.apply(v, x)

  wrapped = lnn.jit(Wrap)(lnn.Dense(3))
  wv = {'params': {'inner': v['params']}}
  runs = _scope_runs(monkeypatch)
  np.testing.assert_array_equal(wrapped.apply(wv, X4), want)
  assert len(runs) == 1
  with call_context.record_calls():
    np.testing.assert_array_equal(model.apply(v, X4), want)
  assert len(runs) == 2
  np.testing.assert_array_equal(Outer().apply({}, X4), want)
  assert len(runs) == 4  # Outer's own apply and the inner one
  np.testing.assert_array_equal(model.apply(v, X4), want)
  assert len(runs) == 4  # back on the fast path


def test_jit_plain_apply_rekeys_when_interceptors_change(monkeypatch):
  """The fast path fingerprints a module once and keeps the key on it; an
  interceptor entered after a hit gets a program traced under it (a new
  key), and leaving it returns to the first program."""
  from liftmods import jit_transform
  fingerprints = []
  real = jit_transform._leaf_fingerprint
  monkeypatch.setattr(jit_transform, '_leaf_fingerprint',
                      lambda m: fingerprints.append(1) or real(m))
  model = lnn.jit(lnn.Dense)(3)
  v = model.init(jax.random.key(0), X4)
  want = lnn.Dense(3).apply(v, X4)
  np.testing.assert_array_equal(model.apply(v, X4), want)  # compiles
  first = len(fingerprints)
  for _ in range(3):
    np.testing.assert_array_equal(model.apply(v, X4), want)
  assert len(fingerprints) == first  # hits: the key is kept on the module

  def double(next_fun, args, kwargs, context):
    return 2 * next_fun(*args, **kwargs)

  with lnn.intercept_methods(double):
    np.testing.assert_array_equal(model.apply(v, X4), 2 * want)
  np.testing.assert_array_equal(model.apply(v, X4), want)


def test_jit_plain_apply_static_and_keyword_arguments():
  class Net(lnn.Module):
    @lnn.compact
    def __call__(self, x, n, scale=1.0):
      for _ in range(n):
        x = lnn.Dense(3)(x)
      return x * scale

  jitted = lnn.jit(Net, static_argnums=(2,))()
  v = jitted.init(jax.random.key(0), X4, 2)
  np.testing.assert_array_equal(jitted.apply(v, X4, 2, scale=3.0),
                                Net().apply(v, X4, 2, scale=3.0))
  with pytest.raises(lnn.errors.ScopeParamNotFoundError):
    jitted.apply(v, X4, 3)  # a third layer has no parameters
