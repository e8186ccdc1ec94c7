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
