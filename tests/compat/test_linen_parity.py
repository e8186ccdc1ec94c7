"""Linen behaviours Flax's own tests check, on liftmods and Linen alike."""
import contextlib
import functools
import gc
from unittest import mock

import flax
import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods
from liftmods import config as lconfig
from liftmods import errors


def test_no_tracer_leak_through_module_reference_cycles():
  """A module used inside jax.vmap + jit leaves no tracer alive, even with
  the garbage collector's collect() disabled (bound modules and their
  scopes form reference cycles; apply releases the scopes' contents)."""
  model = liftmods.Sequential([liftmods.Dense(8)])

  @jax.jit
  @functools.partial(jax.vmap, in_axes=(0, None))
  def sample(rng, x):
    params = model.init(rng, np.zeros((3, 8)))
    return model.apply(params, x)

  with mock.patch.object(gc, 'collect', return_value=0):
    with jax.checking_leaks():
      for _ in range(2):
        out = sample(jax.random.split(jax.random.key(23), 4), np.ones((2, 8)))
        out.block_until_ready()
        del out


def test_scope_release_drops_variables_and_rngs_of_the_whole_tree():
  root = liftmods.core.scope.bind({'params': {'a': {'w': 1}}},
                                  rngs={'params': jax.random.key(0)})
  child = root.push('a')
  assert child.get_variable('params', 'w') == 1
  root.release()
  assert root.rngs == {} and child.rngs == {}
  assert not root._variables and not child._variables  # pylint: disable=protected-access


class _Foo:
  """Module classes built for either library."""

  @staticmethod
  def make(nn):

    class Foo(nn.Module):

      @nn.compact
      def __call__(self, x):
        return x + self.param('p', nn.initializers.zeros, x.shape)

    class Bar(nn.Module):
      sub: nn.Module

      def __call__(self, x):
        return self.sub(x)

    class KeepNames(nn.Module):
      sub: nn.Module
      preserve_adopted_names = True

      def __call__(self, x):
        return self.sub(x)

    class Two(nn.Module):
      sub1: nn.Module
      sub2: nn.Module

      def __call__(self, x):
        return self.sub1(x) + self.sub2(x)

    return Foo, Bar, KeepNames, Two


@contextlib.contextmanager
def _flax_flag(name, value):
  old = getattr(flax.config, name)
  flax.config.update(name, value)
  try:
    yield
  finally:
    flax.config.update(name, old)


def _param_tree(nn, flag, build):
  name = 'flax_preserve_adopted_names'
  with (lconfig.set_config(**{name: flag}) if nn is liftmods
        else _flax_flag(name, flag)):
    return _run_build(nn, build)


def _run_build(nn, build):
  variables = build(*_Foo.make(nn)).init(jax.random.key(0), jnp.zeros((1,)))
  return jax.tree_util.tree_structure(variables)


@pytest.mark.parametrize('flag', [True, False])
@pytest.mark.parametrize('case', ['named', 'unnamed', 'class_attr', 'nested'])
def test_relaxed_naming_adoption_matches_linen(flag, case):
  builds = {
      'named': lambda Foo, Bar, Keep, Two: Bar(sub=Foo(name='foo')),
      'unnamed': lambda Foo, Bar, Keep, Two: Bar(sub=Foo()),
      'class_attr': lambda Foo, Bar, Keep, Two: Keep(sub=Foo(name='foo')),
      'nested': lambda Foo, Bar, Keep, Two: Keep(
          sub=Keep(sub=Foo(name='foo'), name='bar')),
  }
  ours = _param_tree(liftmods, flag, builds[case])
  theirs = _param_tree(flax.linen, flag, builds[case])
  assert ours == theirs


def test_relaxed_adoption_still_checks_name_conflicts():
  Foo, _, _, Two = _Foo.make(liftmods)
  with lconfig.set_config(flax_preserve_adopted_names=True):
    with pytest.raises(errors.NameInUseError, match='"foo"'):
      Two(sub1=Foo(name='foo'), sub2=Foo(name='foo')).init(
          jax.random.key(0), jnp.zeros((1,)))


def test_return_frozendict_flag():
  x = jnp.zeros((2, 3))
  with lconfig.set_config(flax_return_frozendict=True):
    frozen = liftmods.Dense(5).init(jax.random.key(0), x)
  plain = liftmods.Dense(5).init(jax.random.key(0), x)
  assert isinstance(frozen, liftmods.FrozenDict)
  assert type(plain) is dict  # pylint: disable=unidiomatic-typecheck
  np.testing.assert_array_equal(frozen['params']['kernel'],
                                plain['params']['kernel'])
