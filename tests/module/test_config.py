"""Differential tests: liftmods.config flags against flax.config, each
flag flipped in both libraries and the behaviour compared."""

import flax
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
from liftmods import config
import treecheck


def flipped(name, value):
  """Context flipping ``flax_{name}`` in flax and in liftmods."""
  import contextlib

  @contextlib.contextmanager
  def both():
    with flax.config.temp_flip_flag(name, value), \
         config.temp_flip_flag(name, value):
      yield

  return both()


def leaves_equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                  strict=True):
    np.testing.assert_array_equal(x, y)


# liftmods has the flags of every flax it supports, so that code written
# for the newest sets them; a flag an older flax lacks is listed here with
# the release that added it.
ADDED_IN = {'nnx_sow_capture_noop': (0, 12, 11)}


def test_same_flags_and_defaults_as_flax():
  ours = config.values()
  for name, value in ours.items():
    if not hasattr(flax.config, name):
      assert treecheck.FLAX_VERSION < ADDED_IN[name], name
      continue
    assert getattr(flax.config, name) == value, name
  for name in flax.config._values:  # pylint: disable=protected-access
    assert name in ours, name


def test_update_set_config_and_errors():
  assert config.flax_return_frozendict is False
  with config.set_config(flax_return_frozendict=True):
    assert config.flax_return_frozendict is True
  assert config.flax_return_frozendict is False
  config.update('flax_return_frozendict', True)
  try:
    assert config.flax_return_frozendict is True
  finally:
    config.update('flax_return_frozendict', False)
  with pytest.raises(LookupError, match='Unrecognized config option'):
    config.update('flax_nope', 1)
  with pytest.raises(LookupError, match='Unrecognized config option'):
    with config.set_config(flax_return_frozendict=True, flax_nope=1):
      pass
  assert config.flax_return_frozendict is False
  with pytest.raises(AttributeError):
    config.flax_nope  # pylint: disable=pointless-statement


@pytest.mark.parametrize('value', [False, True])
def test_return_frozendict(value):
  x = jnp.ones((1, 3))

  def run(nn):
    class Counter(nn.Module):
      @nn.compact
      def __call__(self, x):
        c = self.variable('counts', 'n', jnp.zeros, ())
        c.value += 1
        return nn.Dense(2)(x), self.variables

    model = Counter()
    variables = model.init(jax.random.key(0), x)
    (_, seen), mutated = model.apply(variables, x, mutable=['counts'])
    return variables, mutated, seen

  with flipped('return_frozendict', value):
    theirs, ours = run(fnn), run(lnn)
  for a, b in zip(theirs, ours):
    assert isinstance(a, flax.core.FrozenDict) == value
    assert isinstance(b, lnn.FrozenDict) == value
    leaves_equal(a, b)


@pytest.mark.parametrize('value', [False, True])
def test_fix_rng_separator(value):
  x = jnp.ones((1, 3))
  with flipped('fix_rng_separator', value):
    theirs = fnn.Dense(4, name='ab').init(jax.random.key(0), x)
    ours = lnn.Dense(4, name='ab').init(jax.random.key(0), x)
    seq = lambda nn: nn.Sequential([nn.Dense(2), nn.Dense(3)])
    deep = [seq(nn).init({'params': jax.random.key(1)}, x)
            for nn in (fnn, lnn)]
  leaves_equal(theirs, ours)
  leaves_equal(*deep)
  plain = lnn.Dense(4, name='ab').init(jax.random.key(0), x)
  differs = not np.array_equal(plain['params']['kernel'],
                               ours['params']['kernel'])
  assert differs == value


@pytest.mark.parametrize('flag,class_attr', [
    (False, None), (True, None), (False, True), (True, False)])
def test_preserve_adopted_names(flag, class_attr):
  x = jnp.ones((1, 3))

  def build(nn):
    attrs = {}
    if class_attr is not None:
      attrs['preserve_adopted_names'] = class_attr

    def call(self, x):
      return self.layer(x)

    Wrapper = type('Wrapper', (nn.Module,), {
        '__annotations__': {'layer': nn.Module}, '__call__': call, **attrs})
    return Wrapper(nn.Dense(2, name='custom'))

  with flipped('preserve_adopted_names', flag):
    trees = [jax.tree_util.tree_map(jnp.shape, build(nn).init(
        jax.random.key(0), x)) for nn in (fnn, lnn)]
  assert trees[0] == trees[1]
  expected = flag if class_attr is None else class_attr
  assert list(trees[1]['params']) == (['custom'] if expected else ['layer'])


def test_profile_flag_names_the_default_for_named_call():
  assert lnn.module.named_call_enabled() == config.flax_profile


