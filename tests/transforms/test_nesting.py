"""Transforms nested in each other, in setup, with Module arguments and as
decorators.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import functools

import jax
import pytest

from lifted_check import C0, X4, XS, block, mlp, check, shapes
import liftmods as lnn

pytestmark = pytest.mark.usefixtures('fast_compiles')


def test_scan_of_remat():
  def build(nn):
    return nn.scan(nn.remat(block(nn)), variable_axes={'params': 0},
                   split_rngs={'params': True})()

  check(build, (C0, XS))


def test_vmap_of_scan():
  def build(nn):
    Scanned = nn.scan(block(nn), variable_axes={'params': 0},
                      split_rngs={'params': True})
    return nn.vmap(Scanned, variable_axes={'params': None},
                   split_rngs={'params': False}, in_axes=(0, 1),
                   out_axes=(0, 1))()

  c0 = jax.random.normal(jax.random.key(1), (2, 3))  # vmapped over 2
  xs = jax.random.normal(jax.random.key(2), (4, 2, 2))  # time 4, batch 2
  r = check(build, (c0, xs))
  assert shapes(r['vars'][lnn])['params']['Dense_0']['kernel'] == (4, 5, 3)


def test_vmap_of_scan_stacked_both():
  def build(nn):
    Scanned = nn.scan(block(nn), variable_axes={'params': 0},
                      split_rngs={'params': True})
    return nn.vmap(Scanned, variable_axes={'params': 1},
                   split_rngs={'params': True}, in_axes=(0, 1),
                   out_axes=(0, 1))()

  c0 = jax.random.normal(jax.random.key(1), (2, 3))
  xs = jax.random.normal(jax.random.key(2), (4, 2, 2))
  r = check(build, (c0, xs))
  assert shapes(r['vars'][lnn])['params']['Dense_0']['kernel'] == (4, 2, 5,
                                                                     3)


def test_remat_of_vmap():
  def build(nn):
    return nn.remat(nn.vmap(mlp(nn), variable_axes={'params': 0},
                            split_rngs={'params': True}))(2)

  check(build, (X4,))


def test_jit_around_scan():
  def build(nn):
    Scanned = nn.scan(block(nn), variable_axes={'params': 0},
                      split_rngs={'params': True})
    return nn.jit(Scanned)()

  check(build, (C0, XS))


def test_jit_of_parent_containing_scan():
  def build(nn):
    class Parent(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        c, ys = nn.scan(block(nn), variable_axes={'params': 0},
                        split_rngs={'params': True})(name='scan')(c, xs)
        return nn.Dense(2)(ys), c
    return nn.jit(Parent)()

  check(build, (C0, XS))


def test_transformed_submodules_in_setup():
  def build(nn):
    class Model(nn.Module):
      def setup(self):
        self.vdense = nn.vmap(nn.Dense, variable_axes={'params': 0},
                              split_rngs={'params': True})(3)
        self.rdense = nn.remat(nn.Dense)(2)

      def __call__(self, x):
        return self.rdense(nn.relu(self.vdense(x)))
    return Model()

  r = check(build, (X4,))
  p = shapes(r['vars'][lnn]['params'])
  assert p['vdense']['kernel'] == (4, 3, 3) and p['rdense']['kernel'] == (3,
                                                                            2)


def test_scan_in_setup_layers():
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return x + nn.tanh(nn.Dense(4)(x)), None

    class Model(nn.Module):
      def setup(self):
        self.layers = nn.scan(Layer, variable_axes={'params': 0},
                              split_rngs={'params': True}, length=3)()
        self.head = nn.Dense(2)

      def __call__(self, x):
        x, _ = self.layers(x, None)
        return self.head(x)
    return Model()

  x = jax.random.normal(jax.random.key(6), (2, 4))
  r = check(build, (x,))
  assert shapes(r['vars'][lnn])['params']['layers']['Dense_0'][
      'kernel'] == (3, 4, 4)


@pytest.mark.parametrize('in_axes', [0, (None, 0)])
def test_vmap_function_with_module_arguments(in_axes):
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        other = nn.Dense(3, name='other')

        def fn(mdl, other, x):
          h = nn.Dense(3, name='own')(x)
          return other(h) + h
        vfn = nn.vmap(fn, variable_axes={'params': 0},
                      split_rngs={'params': True}, in_axes=in_axes)
        return vfn(self, other, x)
    return Model()

  r = check(build, (X4,))
  p = shapes(r['vars'][lnn]['params'])
  assert p['own']['kernel'] == (4, 3, 3) and p['other']['kernel'] == (4, 3, 3)


@pytest.mark.parametrize('in_axes', [0, (None, 0)])
def test_vmap_function_with_module_argument_shared(in_axes):
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        other = nn.Dense(3, name='other')
        other(x[0])  # initialise outside the transform: shared

        def fn(mdl, other, x):
          return other(x) * 2
        vfn = nn.vmap(fn, variable_axes={'params': None},
                      split_rngs={'params': False}, in_axes=in_axes)
        return vfn(self, other, x)
    return Model()

  r = check(build, (X4,))
  assert shapes(r['vars'][lnn])['params']['other']['kernel'] == (3, 3)


@pytest.mark.parametrize('which', ['jit', 'remat', 'checkpoint'])
def test_function_with_module_argument(which):
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        other = nn.Dense(3, name='other')

        def fn(mdl, other, x):
          return nn.tanh(other(x)) + nn.Dense(3, name='own')(x)
        return getattr(nn, which)(fn)(self, other, x)
    return Model()

  r = check(build, (X4,))
  assert set(r['vars'][lnn]['params']) == {'other', 'own'}


def test_module_as_dataclass_field_of_transformed():
  def build(nn):
    class Wrapper(nn.Module):
      inner: nn.Module

      @nn.compact
      def __call__(self, x):
        return self.inner(x) + nn.Dense(2)(x)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        inner = nn.Dense(2, name='inner')
        VW = nn.vmap(Wrapper, variable_axes={'params': 0},
                     split_rngs={'params': True})
        return VW(inner)(x)
    return Model()

  r = check(build, (X4,))
  p = shapes(r['vars'][lnn]['params'])
  assert p['inner']['kernel'] == (4, 3, 2)


def test_module_field_of_scan_shared():
  def build(nn):
    class Wrapper(nn.Module):
      inner: nn.Module

      @nn.compact
      def __call__(self, c, x):
        c = nn.tanh(self.inner(c) + nn.Dense(3)(x))
        return c, c

    class Model(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        inner = nn.Dense(3, name='inner')
        SW = nn.scan(Wrapper, variable_axes={'params': 0},
                     variable_broadcast=False, split_rngs={'params': True})
        return SW(inner, name='scan')(c, xs)
    return Model()

  r = check(build, (C0, XS))
  p = shapes(r['vars'][lnn]['params'])
  assert p['inner']['kernel'] == (4, 3, 3)


def test_decorator_jit_and_remat():
  def build(nn):
    class JitBlock(nn.Module):
      @nn.jit
      @nn.compact
      def __call__(self, x):
        return nn.relu(nn.Dense(3)(x))

    class RematBlock(nn.Module):
      @nn.remat
      @nn.compact
      def __call__(self, x):
        return nn.tanh(nn.Dense(2)(x))

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return RematBlock()(JitBlock()(x))
    return Model()

  r = check(build, (X4,))
  assert set(r['vars'][lnn]['params']) == {'JitBlock_0', 'RematBlock_0'}


def test_decorator_vmap_on_method():
  def build(nn):
    class Model(nn.Module):
      @functools.partial(nn.vmap, variable_axes={'params': 0},
                         split_rngs={'params': True})
      @nn.compact
      def __call__(self, x):
        return nn.Dense(2)(x)
    return Model()

  r = check(build, (X4,))
  assert shapes(r['vars'][lnn])['params']['Dense_0']['kernel'] == (4, 3, 2)
