"""nn.jit's compile cache, counted against flax.linen.

Each model is written once against a Linen-style namespace and built fresh
per backend (so no trace is shared through a class defined earlier). A
Python-side counter in the jitted body counts traces; liftmods must never
trace more often than Linen, and must give the same variables and outputs.
"""
import functools
from typing import Any

import flax.linen as fnn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
import treecheck

KEY = jax.random.key(0)
X = jnp.ones((2, 4))
BACKENDS = (fnn, lnn)


# Container types must match too.
assert_identical = functools.partial(treecheck.assert_identical,
                                     same_containers=True)


def _identical_blocks(nn, count, in_scan):
  """Four jitted Dense blocks of one configuration, at four paths, either
  in a compact model or in the body of a scan."""

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x):
      count.append(1)
      return nn.tanh(nn.Dense(4)(x))

  JBlock = nn.jit(Block)

  class Stack(nn.Module):

    @nn.compact
    def __call__(self, c, x):
      for _ in range(4):
        c = JBlock()(c)
      return c, x

  if not in_scan:
    return nn.Sequential([JBlock() for _ in range(4)])

  class Model(nn.Module):

    @nn.compact
    def __call__(self, c):
      scanned = nn.scan(Stack, variable_axes={'params': 0},
                        split_rngs={'params': True}, length=3)
      return scanned()(c, None)[0]

  return Model()


@pytest.mark.parametrize('in_scan', [False, True])
def test_identical_blocks_traced_once(in_scan):
  counts, results = {}, {}
  for nn in BACKENDS:
    count = []
    model = _identical_blocks(nn, count, in_scan)
    variables = model.init(KEY, X)
    n_init = len(count)
    y = model.apply(variables, X)
    n_apply = len(count) - n_init
    model.apply(variables, X)
    counts[nn] = (n_init, n_apply, len(count) - n_init - n_apply)
    results[nn] = (variables, y)
  assert all(a <= b for a, b in zip(counts[lnn], counts[fnn])), counts
  # One trace per trace of the enclosing code (scan traces its body twice
  # at init), however many blocks; nothing on a repeated apply.
  assert counts[lnn][0] == (2 if in_scan else 1), counts
  assert counts[lnn][2] == 0
  assert_identical(results[lnn], results[fnn])


def test_blocks_that_differ_are_not_shared():
  results, counts = {}, {}
  for nn in BACKENDS:
    count = []

    class Scale(nn.Module):
      factor: float

      @nn.compact
      def __call__(self, x):
        count.append(self.factor)
        return nn.Dense(4)(x) * self.factor

    JScale = nn.jit(Scale)

    class Model(nn.Module):

      @nn.compact
      def __call__(self, x):
        return JScale(2.0)(x), JScale(2.0)(x), JScale(-1.0)(x)

    variables = Model().init(KEY, X)
    results[nn] = (variables, Model().apply(variables, X))
    counts[nn] = count
  assert len(counts[lnn]) <= len(counts[fnn]), counts
  assert set(counts[lnn]) == {2.0, -1.0}
  assert_identical(results[lnn], results[fnn])
  a, _, c = results[lnn][1]
  assert not np.allclose(a, c)


def test_stateful_submodules_do_not_retrace():
  """A jitted module whose submodules keep batch statistics: after the
  first training step, further steps hit the cache."""
  counts, results = {}, {}
  for nn in BACKENDS:
    count = []

    class Block(nn.Module):

      @nn.compact
      def __call__(self, x):
        count.append(1)
        h = nn.Dense(4)(x)
        return nn.BatchNorm(use_running_average=False)(h)

    JBlock = nn.jit(Block)

    class Model(nn.Module):

      def setup(self):
        self.blocks = [JBlock() for _ in range(3)]

      def __call__(self, x):
        for block in self.blocks:
          x = block(x)
        return x

    model = Model()
    variables = model.init(KEY, X)
    steps = []
    for i in range(3):
      y, updates = model.apply(variables, X * (i + 1),
                               mutable=['batch_stats'])
      variables = {**variables, **updates}
      steps.append(len(count))
    counts[nn] = steps
    results[nn] = (variables, y)
  assert all(a <= b for a, b in zip(counts[lnn], counts[fnn])), counts
  assert counts[lnn][0] == counts[lnn][1] == counts[lnn][2], counts
  assert_identical(results[lnn], results[fnn])


def _helper_model(nn, jit):

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      a = self.helper(x)
      b = nn.Dense(4)(x)
      return a + b + self.helper(x)

    @jit
    def helper(self, x):
      return nn.Dense(4)(x)

  return Model()


def test_naming_state_is_part_of_the_key():
  """A jitted non-compact helper creating a submodule names it after the
  ones created before it; the second call of the helper (same module, same
  configuration, other names taken) must not reuse the first call's trace.
  (Linen's nn.jit names both helpers' Dense "Dense_0", sharing one kernel;
  liftmods keeps the names the model has without jit.)"""
  plain = _helper_model(lnn, lambda f: f)
  variables = plain.init(KEY, X)
  assert set(variables['params']) == {'Dense_0', 'Dense_1', 'Dense_2'}
  flax_plain = _helper_model(fnn, lambda f: f).init(KEY, X)
  assert_identical(variables, flax_plain)
  jitted = _helper_model(lnn, lnn.jit)
  np.testing.assert_allclose(jitted.apply(variables, X),
                             plain.apply(variables, X), rtol=1e-6)
  shapes = jax.tree_util.tree_map(jnp.shape, jitted.init(KEY, X))
  assert shapes == jax.tree_util.tree_map(jnp.shape, variables)


class Node:
  """A field value that must not be hashed or compared: Linen passes it as
  its serialization state."""

  def __init__(self, a: int):
    self.a = a

  def __hash__(self):
    raise AssertionError('Node must not be hashed')

  def __eq__(self, other):
    raise AssertionError('Node must not be compared')


flax.serialization.register_serialization_state(
    Node, lambda n: {'a': n.a}, lambda n, d: Node(d['a']))


def test_unhashable_serializable_field_is_not_hashed():
  counts, results = {}, {}
  node = Node(3)
  for nn in BACKENDS:
    count = []

    class Model(nn.Module):
      node: Any

      @nn.jit
      @nn.compact
      def __call__(self, x):
        count.append(1)
        return nn.Dense(4)(x) * self.node.a

    variables = Model(node).init(KEY, X)
    ys = [Model(node).apply(variables, X) for _ in range(3)]
    counts[nn] = len(count)
    results[nn] = (variables, ys)
  assert counts[lnn] <= counts[fnn], counts
  assert_identical(results[lnn], results[fnn])


def test_jit_on_init_with_output_override():
  results = {}
  for nn in BACKENDS:
    count = []

    class Model(nn.Module):

      @nn.compact
      def __call__(self, x):
        count.append(1)
        return nn.Dense(3)(x)

      @nn.jit
      def init_with_output(self, rngs, *args, **kwargs):
        return super().init_with_output(rngs, *args, **kwargs)

    y, variables = Model().init_with_output(KEY, X)
    Model().init_with_output(KEY, X)
    assert len(count) == 1, nn  # the second init hits the cache
    results[nn] = (y, variables)
  assert_identical(results[lnn], results[fnn])


# -- what a cached call must still tell apart ----------------------------------


def _traced_model(count):
  """A jitted top-level model with scalar, function and bool fields (the
  fields ``nn.jit`` keys in one pass) that counts its traces."""

  class Net(lnn.Module):
    width: int = 3
    scale: float = 1.0
    act: Any = jnp.tanh
    use_bias: bool = True

    @lnn.compact
    def __call__(self, x, *, static=None):
      count.append(1)
      y = self.act(lnn.Dense(self.width, use_bias=self.use_bias)(x))
      y = y * self.scale
      if self.is_mutable_collection('stats'):
        total = self.variable('stats', 'total', jnp.zeros, ())
        total.value += y.sum()
      return y if static is None else y + static

  return lnn.jit(Net, static_argnames=('static',))


def test_cached_call_retraces_on_config_variables_mutability_and_statics():
  count = []
  net_cls = _traced_model(count)
  variables = net_cls().init(KEY, X)

  def traces(module, v, x, **kwargs):
    before = len(count)
    out = module.apply(v, x, **kwargs)
    return len(count) - before, out

  assert traces(net_cls(), variables, X)[0] == 1
  assert traces(net_cls(), variables, X)[0] == 0  # hit
  # Configuration: numbers, floats, functions, bools.
  assert traces(net_cls(scale=2.0), variables, X)[0] == 1
  assert traces(net_cls(act=jnp.sin), variables, X)[0] == 1
  assert traces(net_cls(act=jnp.sin), variables, X)[0] == 0
  # Variable structure, shapes and dtypes.
  no_bias = net_cls(use_bias=False).init(KEY, X)
  assert traces(net_cls(use_bias=False), no_bias, X)[0] == 1
  wider = net_cls(width=5).init(KEY, X)
  assert traces(net_cls(width=5), wider, X)[0] == 1
  as_f16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16),
                                  variables)
  n, y = traces(net_cls(), as_f16, X)
  assert n == 1 and y.dtype == jnp.float32  # promoted by the f32 input
  assert traces(net_cls(), variables, X[:1])[0] == 1  # input shape
  # The mutable set: a new entry, and the collection really is written.
  params = {'params': variables['params']}
  n, (_, state) = traces(net_cls(), params, X, mutable=['stats'])
  assert n == 1 and float(state['stats']['total']) != 0.0
  n, (_, again) = traces(net_cls(), {**params, **state}, X,
                         mutable=['stats'])
  assert n == 1  # the stats now exist: another variable structure
  assert float(again['stats']['total']) == 2 * float(state['stats']['total'])
  # Static arguments.
  assert traces(net_cls(), variables, X, static=1.0)[0] == 1
  assert traces(net_cls(), variables, X, static=1.0)[0] == 0
  assert traces(net_cls(), variables, X, static=2.0)[0] == 1
  # And back to the first configuration: still cached.
  assert traces(net_cls(), variables, X)[0] == 0


def test_cached_call_sees_submodule_fields_and_module_arguments():
  """Fields that hold modules (and modules passed as arguments) are not
  scalars: the key still follows their configuration."""
  count = []

  class Inner(lnn.Module):
    features: int

    @lnn.compact
    def __call__(self, x):
      return lnn.Dense(self.features)(x)

  class Outer(lnn.Module):
    inner: lnn.Module

    @lnn.compact
    def __call__(self, x):
      count.append(1)
      return self.inner(x)

  jouter = lnn.jit(Outer)
  v2 = jouter(Inner(2)).init(KEY, X)
  v3 = jouter(Inner(3)).init(KEY, X)
  count.clear()
  assert jouter(Inner(2)).apply(v2, X).shape == (2, 2)
  assert jouter(Inner(3)).apply(v3, X).shape == (2, 3)
  assert len(count) == 2
  jouter(Inner(2)).apply(v2, X)
  assert len(count) == 2


def test_bounded_cache_keeps_used_entries():
  from liftmods.core.caching import BoundedCache  # pylint: disable=import-outside-toplevel
  cache = BoundedCache(3)
  for i in range(3):
    cache[i] = str(i)
  assert cache.get(0) == '0'
  cache[3] = '3'  # 1 is the oldest entry not used since: evicted
  assert sorted(cache) == [0, 2, 3]
  for i in range(4, 40):
    cache.get(0)
    cache[i] = str(i)
  assert 0 in cache and len(cache) == 3
  assert cache.get('missing', 'default') == 'default'
  with pytest.raises(KeyError):
    cache['missing']  # pylint: disable=pointless-statement


def test_one_pass_key_equals_the_general_fingerprint():
  """nn.jit's one-pass path (fields that are numbers, strings, bools, None
  or functions; no module among the arguments) builds the same cache key
  as the general fingerprint, so both paths share compiled entries."""
  from liftmods import jit_transform  # pylint: disable=g-import-not-at-top

  class Leafy(lnn.Module):
    features: int = 3
    scale: float = 0.5
    tag: str = 'a'
    act: Any = jax.nn.relu
    flag: bool = True
    extra: Any = None
    dtype: Any = jnp.float32
    kind: Any = lnn.Dense

    @lnn.compact
    def __call__(self, x):
      return self.act(lnn.Dense(self.features)(x)) * self.scale

  x = jnp.ones((1, 2))
  variables = Leafy().init(jax.random.key(0), x)
  bound = Leafy(name='named').bind(variables)
  scopes, args, _, key = jit_transform._scopes_and_key(bound, (x,), {})
  assert scopes == [bound.scope] and args == (x,)
  assert key.key == jit_transform.ModuleKey(bound).key
  assert key.key != jit_transform.ModuleKey(
      Leafy(scale=0.25).bind(variables)).key
