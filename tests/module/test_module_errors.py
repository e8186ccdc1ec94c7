"""Errors raised by liftmods.Module, checked against flax.linen.

Each test asserts the liftmods.errors class, that the message names where the
mistake is (module path or class) and what is wrong (the offending name), and,
where flax.linen raises an error of the same name for the same code, that it
does (so ``except errors.X`` ports from flax).
"""
from typing import Callable

import flax.errors
import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest

import liftmods as lnn
from liftmods import errors

X = jnp.ones((2, 3))
KEY = jax.random.key(0)


def _dense(nn):
  class Dense(nn.Module):
    features: int = 3
    kernel_init: Callable = jax.nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):
      return x @ self.param('kernel', self.kernel_init,
                            (x.shape[-1], self.features))

  return Dense


def _outer(nn, inner_cls, **kw):
  """A parent that calls ``inner_cls`` under the name 'layer', so errors
  raised inside it must name the path /layer."""

  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x, *args):
      return inner_cls(name='layer', **kw)(x, *args)

  return Outer


def check(run, lm_error, *needles, flax_error='same'):
  """``run(nn)`` raises ``lm_error`` under liftmods with every needle in the
  message, and ``flax_error`` (default: flax.errors' class of the same name)
  under flax.linen."""
  with pytest.raises(lm_error) as info:
    run(lnn)
  assert type(info.value) is lm_error or lm_error is ValueError
  msg = str(info.value)
  for needle in needles:
    assert needle in msg, f'{needle!r} not in message: {msg}'
  if flax_error == 'same':
    flax_error = getattr(flax.errors, lm_error.__name__)
  if flax_error is not None:
    with pytest.raises(flax_error):
      run(fnn)
  return msg


# -- scope variable errors -----------------------------------------------------------


def test_wrong_param_shape_on_apply():

  def run(nn):
    model = _outer(nn, _dense(nn))()
    v = model.init(KEY, X)
    model.apply(v, jnp.ones((2, 5)))

  msg = check(run, errors.ScopeParamShapeError, '"kernel"', '/layer')
  assert '(3, 3)' in msg and '(5, 3)' in msg


def test_wrong_param_shape_in_setup_defined_param():

  def run(nn):
    class S(nn.Module):
      n: int = 4

      def setup(self):
        self.w = self.param('w', jax.nn.initializers.ones, (self.n,))

      def __call__(self, x):
        return x.sum() * self.w

    v = S().init(KEY, X)
    S(5).apply(v, X)

  check(run, errors.ScopeParamShapeError, '"w"', '(4,)', '(5,)')


def test_missing_param():

  def run(nn):
    model = _outer(nn, _dense(nn))()
    model.apply({'params': {'layer': {'other': jnp.ones(3)}}}, X)

  check(run, errors.ScopeParamNotFoundError, '"kernel"', '/layer')


@pytest.mark.parametrize('variables', [{}, {'batch_stats': {}}])
def test_missing_params_collection(variables):

  def run(nn):
    _outer(nn, _dense(nn))().apply(variables, X)

  check(run, errors.ScopeCollectionNotFound, '"params"', '"kernel"', '/layer')


def test_missing_variable_collection():

  def run(nn):
    class Stats(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + self.variable('batch_stats', 'mean', jnp.zeros, (3,)).value

    _outer(nn, Stats)().apply({'params': {}}, X)

  check(run, errors.ScopeCollectionNotFound, '"batch_stats"', '"mean"',
        '/layer')


def _stats(nn):
  class Stats(nn.Module):
    how: str = 'value'

    @nn.compact
    def __call__(self, x):
      v = self.variable('batch_stats', 'mean', jnp.zeros, (3,))
      if self.how == 'value':
        v.value = v.value + x.mean(0)
      else:
        self.put_variable('batch_stats', 'mean', x.mean(0))
      return x - v.value

  return Stats


@pytest.mark.parametrize('how', ['value', 'put_variable'])
def test_write_to_immutable_collection(how):

  def run(nn):
    model = _outer(nn, _stats(nn), how=how)()
    v = model.init(KEY, X)
    model.apply(v, X)  # batch_stats not mutable

  check(run, errors.ModifyScopeVariableError, '"batch_stats"', '"mean"',
        '/layer')
  # ... and the same write succeeds once the collection is mutable
  model = _outer(lnn, _stats(lnn), how=how)()
  v = model.init(KEY, X)
  _, upd = model.apply(v, X, mutable=['batch_stats'])
  assert 'batch_stats' in upd


def test_write_to_immutable_params_with_put_variable():

  def run(nn):
    class P(nn.Module):
      @nn.compact
      def __call__(self, x):
        self.put_variable('params', 'w', x)
        return x

    _outer(nn, P)().apply({'params': {}}, X)

  check(run, errors.ModifyScopeVariableError, '"params"', '"w"', '/layer')


# -- name collisions ---------------------------------------------------------------------


def test_submodule_name_collision_in_compact():

  def run(nn):
    Dense = _dense(nn)

    class M(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Dense(name='a')(x) + Dense(name='a')(x)

    _outer(nn, M)().init(KEY, X)

  check(run, errors.NameInUseError, '"a"', 'M', '/layer')


def test_explicit_name_colliding_with_later_auto_name():

  def run(nn):
    Dense = _dense(nn)

    class M(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Dense(name='Dense_1')(x) + Dense()(x) + Dense()(x)

    M().init(KEY, X)

  check(run, errors.NameInUseError, '"Dense_1"', 'M')


def test_setup_attribute_assigned_twice():

  def run(nn):
    Dense = _dense(nn)

    class M(nn.Module):
      def setup(self):
        self.a = Dense()
        self.a = Dense(4)

      def __call__(self, x):
        return self.a(x)

    M().init(KEY, X)

  check(run, errors.NameInUseError, '"a"', 'M')


def _collision_model(nn, kind):
  Dense = _dense(nn)
  ones = jax.nn.initializers.ones

  class C(nn.Module):
    @nn.compact
    def __call__(self, x):
      if kind == 'param-param':
        return self.param('w', ones, (1,)) + self.param('w', ones, (1,))
      if kind == 'submodule-param':
        return Dense(name='w')(x) + self.param('w', ones, (1,))
      if kind == 'param-submodule':
        return self.param('w', ones, (1,)) + Dense(name='w')(x)
      if kind == 'param-variable':  # a 'params' variable named like a param
        return (self.param('w', ones, (1,)) +
                self.variable('params', 'w', jnp.ones, (1,)).value)
      if kind == 'variable-variable':
        return (self.variable('stats', 'w', jnp.ones, (1,)).value +
                self.variable('stats', 'w', jnp.ones, (1,)).value)
      if kind == 'variable-submodule':
        return (self.variable('stats', 'w', jnp.ones, (1,)).value +
                Dense(name='w')(x))
      raise AssertionError(kind)

  return _outer(nn, C)()


@pytest.mark.parametrize('kind', ['param-param', 'submodule-param',
                                  'param-submodule', 'param-variable',
                                  'variable-variable', 'variable-submodule'])
def test_param_and_variable_name_collisions(kind):
  check(lambda nn: _collision_model(nn, kind).init(KEY, X),
        errors.NameInUseError, '"w"', '/layer')


def test_same_name_in_different_collections_is_allowed():
  out = []
  for nn in (fnn, lnn):
    class C(nn.Module):
      @nn.compact
      def __call__(self, x):
        return (self.param('w', jax.nn.initializers.ones, (1,)) +
                self.variable('stats', 'w', jnp.zeros, (1,)).value)

    out.append(jax.tree_util.tree_map(jnp.shape, C().init(KEY, X)))
  assert out[0] == out[1] == {'params': {'w': (1,)}, 'stats': {'w': (1,)}}


# -- frozen modules ----------------------------------------------------------------------


def test_assign_attribute_in_compact_method():

  def run(nn):
    class M(nn.Module):
      @nn.compact
      def __call__(self, x):
        self.cache = x
        return x

    _outer(nn, M)().init(KEY, X)

  check(run, errors.SetAttributeFrozenModuleError, "Can't set cache=", 'M')


def test_assign_attribute_on_bound_module():

  def run(nn):
    Dense = _dense(nn)
    bound = Dense().bind(Dense().init(KEY, X))
    bound.features = 7

  check(run, errors.SetAttributeFrozenModuleError, "Can't set features=7",
        'Dense')


def test_reassign_dataclass_field_in_setup():

  def run(nn):
    class M(nn.Module):
      width: int = 3

      def setup(self):
        self.width = 4

      def __call__(self, x):
        return x * self.width

    M().init(KEY, X)

  check(run, errors.SetAttributeInModuleSetupError, '"width"', 'M')


# -- class definition errors ---------------------------------------------------------------


# Several @compact methods on one class are allowed, as in Linen: see
# tests/differential/test_linen_behaviours.py.


def test_reserved_field_names():

  def run(nn):
    class M(nn.Module):
      parent: int = 1

  check(run, errors.ReservedModuleAttributeError, 'parent')


def test_post_init_override_without_super():

  def run(nn):
    class M(nn.Module):
      def __post_init__(self):
        pass

      def __call__(self, x):
        return x

    M().init(KEY, X)

  check(run, errors.IncorrectPostInitOverrideError, '__post_init__')


# -- rngs ------------------------------------------------------------------------------------


def _dropout_model(nn):
  class Drop(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x * jax.random.bernoulli(self.make_rng('dropout'), 0.5, x.shape)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Drop(name='drop')(x)

  return Net()


@pytest.mark.parametrize('rngs', [None, {'noise': jax.random.key(1)}])
def test_missing_dropout_rng_without_params_rng(rngs):

  def run(nn):
    _dropout_model(nn).apply({}, X, rngs=rngs)

  check(run, errors.InvalidRngError, '"dropout"', 'drop')


def test_missing_dropout_rng_at_init_without_params_rng():
  check(lambda nn: _dropout_model(nn).init({'noise': KEY}, X),
        errors.InvalidRngError, '"dropout"', 'drop')


# -- unbound / misplaced modules -------------------------------------------------------------


def test_submodule_created_in_non_compact_method():

  def run(nn):
    Dense = _dense(nn)

    class M(nn.Module):
      def helper(self, x):
        return Dense()(x)

      def __call__(self, x):
        return self.helper(x)

    M().init(KEY, X)

  check(run, errors.AssignSubModuleError, 'Dense')


def test_submodule_created_outside_setup_in_setup_module():

  def run(nn):
    Dense = _dense(nn)

    class M(nn.Module):
      def setup(self):
        self.a = Dense()

      def __call__(self, x):
        return Dense(name='late')(self.a(x))

    M().init(KEY, X)

  check(run, errors.AssignSubModuleError, 'Dense')


def test_call_compact_method_on_unbound_module():
  check(lambda nn: _dense(nn)()(X), errors.CallCompactUnboundModuleError,
        'Dense')


def test_call_setup_on_unbound_module():

  def run(nn):
    class M(nn.Module):
      def setup(self):
        self.w = 1

    M().setup()

  check(run, errors.CallSetupUnboundModuleError, 'setup')


def test_setup_attribute_of_unbound_module_is_attribute_error():
  for nn in (fnn, lnn):
    class M(nn.Module):
      def setup(self):
        self.dense = _dense(nn)()

    with pytest.raises(AttributeError, match='dense'):
      M().dense


def test_unbind_on_unbound_module():
  check(lambda nn: _dense(nn)().unbind(),
        errors.CallUnbindOnUnboundModuleError, 'unbind')


# -- entry point arguments -----------------------------------------------------------------


@pytest.mark.parametrize('entry', ['apply', 'init'])
@pytest.mark.parametrize('method', [42, lambda: 1], ids=['int', 'no-args'])
def test_invalid_method(entry, method):

  def run(nn):
    Dense = _dense(nn)
    if entry == 'apply':
      Dense().apply(Dense().init(KEY, X), X, method=method)
    else:
      Dense().init(KEY, X, method=method)

  check(run, errors.ApplyModuleInvalidMethodError, repr(method)[:20])


def test_method_name_of_non_callable_attribute():
  for nn in (fnn, lnn):
    Dense = _dense(nn)
    with pytest.raises(TypeError, match='features'):
      Dense().apply(Dense().init(KEY, X), X, method='features')


def test_method_name_that_does_not_exist():
  for nn in (fnn, lnn):
    Dense = _dense(nn)
    with pytest.raises(AttributeError, match='nonexistent'):
      Dense().apply(Dense().init(KEY, X), X, method='nonexistent')


def test_variables_without_collection_level():

  def run(nn):
    Dense = _dense(nn)
    v = Dense().init(KEY, X)
    Dense().apply(v['params'], X)

  # As flax: a type error, naming the keys found and the likely mistake.
  check(run, errors.ApplyScopeInvalidVariablesTypeError, "'kernel'",
        'Did you pass params instead of {"params": params}?')


def test_variables_with_extra_params_level():

  def run(nn):
    Dense = _dense(nn)
    v = Dense().init(KEY, X)
    Dense().apply({'params': v}, X)

  check(run, errors.ApplyScopeInvalidVariablesStructureError, 'params')


def test_variables_not_a_mapping():
  with pytest.raises(errors.ApplyScopeInvalidVariablesTypeError,
                     match='list'):
    _dense(lnn)().apply([1, 2], X)


@pytest.mark.parametrize('what', ['param', 'variable'])
def test_variable_created_in_non_compact_method(what):

  def run(nn):
    class M(nn.Module):
      def __call__(self, x):
        if what == 'param':
          return self.param('w', jax.nn.initializers.ones, (1,))
        return self.variable('stats', 'w', jnp.ones, (1,)).value

    M().init(KEY, X)

  check(run, ValueError, 'M', 'w', 'compact', flax_error=ValueError)


# -- known divergences from flax (strict xfails: they fail today) --------------------------


@pytest.mark.parametrize('entry', ['init', 'init_with_output', 'apply'])
def test_init_or_apply_called_on_the_class(entry):

  def run(nn):
    Dense = _dense(nn)
    first = {} if entry == 'apply' else KEY
    getattr(Dense, entry)(first, X)

  check(run, errors.InvalidInstanceModuleError, 'instance')


@pytest.mark.parametrize('call', [
    lambda m: m.has_variable('params', 'w'),
    lambda m: m.put_variable('state', 'w', 1),
    lambda m: m.make_rng('dropout'),
    lambda m: m.variables,
    lambda m: m.path,
    lambda m: m.is_initializing(),
    lambda m: m.sow('intermediates', 'h', 1),
], ids=['has_variable', 'put_variable', 'make_rng', 'variables', 'path',
        'is_initializing', 'sow'])
def test_unbound_module_variable_access_is_value_error(call):
  for nn in (fnn, lnn):
    with pytest.raises(ValueError):
      call(_dense(nn)())


def test_non_key_rng_is_invalid_rng_error():
  with pytest.raises(errors.InvalidRngError,
                     match=r'RNGs should be of shape \(2,\) or PRNGKey'):
    _dense(lnn)().init(3, X)
  with pytest.raises(flax.errors.InvalidRngError):
    _dense(fnn)().init(3, X)


def test_assign_submodule_error_names_the_parent():

  def run(nn):
    Dense = _dense(nn)

    class Parent(nn.Module):
      def helper(self, x):
        return Dense()(x)

      def __call__(self, x):
        return self.helper(x)

    Parent().init(KEY, X)

  check(run, errors.AssignSubModuleError, 'Dense', 'Parent')


def test_unbind_error_names_the_module():
  check(lambda nn: _dense(nn)().unbind(),
        errors.CallUnbindOnUnboundModuleError, 'Dense')
