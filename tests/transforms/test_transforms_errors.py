"""Misuse of the module-level lifted transforms: liftmods raises a specific
``liftmods.errors`` class whose message says where (module path), what
(collection, variable) and what was expected. Each model is written once as
``build(nn)``; where Flax Linen rejects the same code too, that is asserted
as well (Flax raises its own, often generic, error), so these are mistakes
and not liftmods-only restrictions.
"""
import flax.errors
import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest

import liftmods as lnn
from liftmods import errors

pytestmark = pytest.mark.usefixtures('fast_compiles')

# Flax's own reaction to the same mistake: a JAX TypeError/ValueError or a
# flax.errors.FlaxError.
FLAX_REJECTS = (TypeError, ValueError, flax.errors.FlaxError)


def _flax_rejects(fn):
  with pytest.raises(FLAX_REJECTS):
    fn(fnn)


def test_error_hierarchy():
  for cls in (errors.ScanCarryError, errors.VariableAxisError,
              errors.BroadcastVariableError, errors.WhileLoopInitError,
              errors.CondBranchVariablesError):
    assert issubclass(cls, errors.LiftError)
    assert issubclass(cls, errors.LiftmodsError)
  assert issubclass(errors.TransformTargetError, errors.LiftmodsError)
  assert issubclass(errors.TransformedMethodReturnValueError,
                    errors.LiftmodsError)


# -- ScanCarryError ------------------------------------------------------------


def _scan_model(nn, step_body, **scan_kwargs):
  class Step(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      return step_body(nn, self, c, x)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, c, xs):
      kw = dict(variable_broadcast='params', split_rngs={'params': False})
      kw.update(scan_kwargs)
      return nn.scan(Step, **kw)(name='grow')(c, xs)
  return Model()


def test_scan_carry_changes_shape():
  def body(nn, mdl, c, x):
    return jnp.concatenate([c, x], -1), x

  def run(nn):
    return _scan_model(nn, body).init(jax.random.key(0), jnp.ones((2, 3)),
                                      jnp.ones((4, 2, 1)))

  _flax_rejects(run)
  with pytest.raises(errors.ScanCarryError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/grow' in msg
  # expected vs got
  assert '2, 3' in msg and '2, 4' in msg
  assert msg.index('2, 3') < msg.index('2, 4')


def test_scan_carry_changes_shape_in_dense_body():
  """A Dense whose output width differs from the carry's."""
  def body(nn, mdl, c, x):
    return nn.Dense(5)(c + x), None

  def run(nn):
    return _scan_model(nn, body).init(jax.random.key(0), jnp.ones((2, 3)),
                                      jnp.ones((4, 2, 3)))

  _flax_rejects(run)
  with pytest.raises(errors.ScanCarryError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/grow' in msg and '3' in msg and '5' in msg


def test_scan_carry_changes_dtype():
  def body(nn, mdl, c, x):
    return c.astype(jnp.int32), x

  def run(nn):
    return _scan_model(nn, body).init(jax.random.key(0), jnp.ones((2,)),
                                      jnp.ones((3, 2)))

  _flax_rejects(run)
  with pytest.raises(errors.ScanCarryError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/grow' in msg and 'float32' in msg and 'int32' in msg


def test_scan_carry_changes_structure():
  def body(nn, mdl, c, x):
    return (c, c), x

  def run(nn):
    return _scan_model(nn, body).init(jax.random.key(0), jnp.ones((2,)),
                                      jnp.ones((3, 2)))

  _flax_rejects(run)
  with pytest.raises(errors.ScanCarryError) as info:
    run(lnn)
  assert '/grow' in str(info.value)


def test_scan_carried_variable_changes_shape():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        self.variable('memory', 'buf', lambda: jnp.zeros((2,)))

        def body(mdl, c, x):
          buf = mdl.variable('memory', 'buf')
          buf.value = jnp.concatenate([buf.value, x])
          return c, None
        return nn.scan(body, variable_carry='memory')(self, c, xs)

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        return Model(name='mem')(c, xs)
    return Outer()

  def run(nn):
    return build(nn).init(jax.random.key(0), jnp.ones((2,)),
                          jnp.ones((3, 1)))

  _flax_rejects(run)
  with pytest.raises(errors.ScanCarryError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/mem' in msg and 'memory' in msg and 'buf' in msg


# -- VariableAxisError ---------------------------------------------------------


def _scanned_stack(nn):
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      return c + nn.Dense(3)(x), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, c, xs):
      return nn.scan(Layer, variable_axes={'params': 0},
                     split_rngs={'params': True})(name='stack')(c, xs)
  return Model()


def test_scan_variable_axes_wrong_length_on_apply():
  c = jnp.ones((2, 3))

  def run(nn):
    m = _scanned_stack(nn)
    v = m.init(jax.random.key(0), c, jnp.ones((4, 2, 2)))
    return m.apply(v, c, jnp.ones((5, 2, 2)))

  _flax_rejects(run)
  with pytest.raises(errors.VariableAxisError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/stack' in msg
  assert 'params' in msg
  assert 'Dense_0' in msg
  # got (4, ...) vs expected size 5 on axis 0
  assert 'axis 0' in msg and '(4, ' in msg and 'size 5' in msg


def test_scan_variable_axes_params_from_other_model():
  """Params of one layer (the stacking axis sliced off) fed to the scanned
  model: the bias (3,) has no stacking axis of the scan length."""
  c = jnp.ones((2, 3))
  xs = jnp.ones((4, 2, 2))
  m = _scanned_stack(lnn)
  v = m.init(jax.random.key(0), c, xs)
  bad = jax.tree_util.tree_map(lambda a: a[0], v)
  with pytest.raises(errors.VariableAxisError) as info:
    m.apply(bad, c, jnp.ones((2, 2, 2)))
  msg = str(info.value)
  assert '/stack' in msg and 'params' in msg and 'Dense_0/bias' in msg
  assert '(3,)' in msg and 'axis 0 of size 2' in msg


def test_vmap_variable_axes_wrong_size_on_apply():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.vmap(nn.Dense, variable_axes={'params': 0},
                       split_rngs={'params': True})(3, name='vd')(x)
    return Model()

  def run(nn):
    m = build(nn)
    v = m.init(jax.random.key(0), jnp.ones((4, 2)))
    return m.apply(v, jnp.ones((5, 2)))

  _flax_rejects(run)
  with pytest.raises(errors.VariableAxisError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/vd' in msg and 'params' in msg and 'axis 0' in msg
  assert '(4, 3)' in msg and 'size 5' in msg


def test_vmap_variable_axes_wrong_size_other_collection():
  def build(nn):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.BatchNorm(use_running_average=True)(x)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.vmap(Net, variable_axes={'params': None,
                                           'batch_stats': 1},
                       split_rngs={'params': False})(name='bn')(x)
    return Model()

  x = jnp.ones((3, 2, 4))  # vmapped over 3 examples of (2, 4)

  def run(nn):
    m = build(nn)
    v = m.init(jax.random.key(0), x)
    v = dict(v)
    v['batch_stats'] = jax.tree_util.tree_map(lambda a: a[:, :2],
                                              v['batch_stats'])
    return m.apply(v, x)

  _flax_rejects(run)
  with pytest.raises(errors.VariableAxisError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/bn' in msg and 'batch_stats' in msg and 'axis 1' in msg
  assert 'mean' in msg or 'var' in msg
  assert 'size 3' in msg


# -- BroadcastVariableError ----------------------------------------------------


def test_scan_broadcast_collection_mutated():
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c, x):
        s = self.variable('stats', 'sum', lambda: jnp.zeros((3,)))
        s.value = s.value + c
        return c + x, None

    class Model(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        return nn.scan(Step, variable_broadcast=['params', 'stats'],
                       split_rngs={'params': False})(name='loop')(c, xs)
    return Model()

  def run(nn):
    return build(nn).init(jax.random.key(0), jnp.ones((3,)),
                          jnp.ones((4, 3)))

  _flax_rejects(run)
  with pytest.raises(errors.BroadcastVariableError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/loop' in msg and 'stats' in msg and 'sum' in msg


def test_scan_broadcast_params_depend_on_input():
  """A broadcast param whose initializer reads the scanned input."""
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c, x):
        w = self.param('w', lambda rng, x: x * 2.0, x)
        return c + w, None

    class Model(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        return nn.scan(Step, variable_broadcast='params',
                       split_rngs={'params': False})(name='loop')(c, xs)
    return Model()

  def run(nn):
    return build(nn).init(jax.random.key(0), jnp.ones((3,)),
                          jnp.ones((4, 3)))

  _flax_rejects(run)
  with pytest.raises(errors.BroadcastVariableError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/loop' in msg and 'params' in msg and '"w"' in msg


# -- while_loop creating variables --------------------------------------------------------


def test_while_loop_initialises_params():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def cond_fn(mdl, c):
          return c.sum() < 10.0

        def body_fn(mdl, c):
          return nn.Dense(3, name='inner')(c) + 1.0
        return nn.while_loop(cond_fn, body_fn, self, x)

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Model(name='looper')(x)
    return Outer()

  def run(nn):
    return build(nn).init(jax.random.key(0), jnp.ones((3,)))

  # Linen cannot create the loop's parameters; liftmods creates them with a
  # run of the condition and the body before the loop.
  with pytest.raises(flax.errors.ScopeCollectionNotFound):
    run(fnn)
  variables = run(lnn)
  assert jax.tree_util.tree_map(jnp.shape, variables) == {
      'params': {'looper': {'inner': {'kernel': (3, 3), 'bias': (3,)}}}}


def test_while_loop_missing_param_with_other_mutable_keeps_linen_error():
  """Reading an absent param inside the loop, while an unrelated collection
  is mutable, is not an attempt to initialise: Linen's error, not
  WhileLoopInitError (fuzz seed 100472)."""
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def body_fn(mdl, c):
          return c[0] + 1, nn.Dense(3, name='inner')(c[1])
        return nn.while_loop(lambda mdl, c: c[0] < 2, body_fn, self,
                             (jnp.array(0), x),
                             carry_variables='batch_stats')[1]
    return Model()

  def run(nn):
    return build(nn).apply({'params': {}}, jnp.ones((3,)),
                           mutable=['intermediates'])

  with pytest.raises(flax.errors.ScopeCollectionNotFound):
    run(fnn)
  with pytest.raises(errors.ScopeCollectionNotFound) as info:
    run(lnn)
  assert not isinstance(info.value, errors.WhileLoopInitError)
  assert str(info.value).startswith('Tried to access "kernel" from collection '
                                    '"params" in "/inner"')


def test_while_loop_initialises_carried_counter():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def cond_fn(mdl, c):
          return c.sum() < 10.0

        def body_fn(mdl, c):
          n = mdl.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))
          n.value += 1
          return c + 1.0
        return nn.while_loop(cond_fn, body_fn, self, x,
                             carry_variables='counter')

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Model(name='looper')(x)
    return Outer()

  def run(nn):
    return build(nn).apply({}, jnp.ones((3,)), mutable=['counter'])

  # Created at zero before the loop, then counted once per iteration.
  _flax_rejects(run)
  _, variables = run(lnn)
  assert int(variables['counter']['looper']['n']) == 3  # 3, 6, 9 < 10


# -- CondBranchVariablesError --------------------------------------------------


def _branchy(nn, kind, second_use_bias=True, second_name='a',
             second_features=3):
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, p):
      def t(mdl, x):
        return nn.Dense(3, name='a')(x)

      def f(mdl, x):
        return nn.Dense(second_features, name=second_name,
                        use_bias=second_use_bias)(x)
      if kind == 'cond':
        return nn.cond(p, t, f, self, x)
      return nn.switch(p, [t, t, f], self, x)

  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x, p):
      return Model(name='branchy')(x, p)
  return Outer()


@pytest.mark.parametrize('kind', ['cond', 'switch'])
def test_branches_create_one_variable_with_two_shapes(kind):
  """Branches creating distinct variables run (each branch first runs once
  outside the conditional: tests/differential/test_linen_issues_lifted.py);
  one variable created with two shapes cannot, and is named."""
  def run(nn):
    return _branchy(nn, kind, second_features=4).init(
        jax.random.key(0), jnp.ones((3,)), 1 if kind == 'switch' else True)

  _flax_rejects(run)
  with pytest.raises(errors.CondBranchVariablesError) as info:
    run(lnn)
  msg = str(info.value)
  assert kind in msg and '/branchy' in msg and 'params' in msg
  assert '"a/' in msg and 'float32[3' in msg and 'float32[4' in msg


@pytest.mark.parametrize('kind', ['cond', 'switch'])
def test_branches_create_different_structure_same_module(kind):
  def run(nn):
    return _branchy(nn, kind, second_use_bias=False).init(
        jax.random.key(0), jnp.ones((3,)), 1 if kind == 'switch' else True)

  _flax_rejects(run)
  with pytest.raises(errors.CondBranchVariablesError) as info:
    run(lnn)
  msg = str(info.value)
  assert '/branchy' in msg and 'params' in msg and 'a/bias' in msg
  # names the branch that differs (switch: the third, index 2)
  assert ('branch 2' if kind == 'switch' else 'branch 1') in msg


def test_branches_same_variables_are_fine():
  m = _branchy(lnn, 'cond', second_use_bias=True)
  v = m.init(jax.random.key(0), jnp.ones((3,)), True)
  assert set(v['params']['branchy']) == {'a'}


# -- TransformTargetError ------------------------------------------------------


_TRANSFORMS = {
    'vmap': dict(variable_axes={'params': 0}, split_rngs={'params': True}),
    'scan': dict(variable_axes={'params': 0}, split_rngs={'params': True}),
    'jit': {}, 'remat': {}, 'checkpoint': {},
    'map_variables': {},
}


@pytest.mark.parametrize('name', sorted(_TRANSFORMS))
@pytest.mark.parametrize('target', ['int', 'instance', 'str'])
def test_transform_target_error(name, target):
  def make(nn):
    return {'int': 3, 'instance': nn.Dense(3), 'str': 'Dense'}[target]

  with pytest.raises(flax.errors.TransformTargetError):
    getattr(fnn, name)(make(fnn), **_TRANSFORMS[name])
  with pytest.raises(errors.TransformTargetError) as info:
    getattr(lnn, name)(make(lnn), **_TRANSFORMS[name])
  msg = str(info.value)
  assert {'int': '3', 'instance': 'Dense', 'str': 'Dense'}[target] in msg


# -- TransformedMethodReturnValueError ----------------------------------------


@pytest.mark.parametrize('name', ['jit', 'remat', 'vmap'])
def test_lifted_class_method_returns_module(name):
  def build(nn):
    class Factory(nn.Module):
      @nn.compact
      def __call__(self, x):
        d = nn.Dense(3)
        d(x)
        return d

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        kw = dict(_TRANSFORMS.get(name, {}))
        return getattr(nn, name)(Factory, **kw)(name='fac')(x)
    return Model()

  def run(nn):
    return build(nn).init(jax.random.key(0), jnp.ones((2, 3)))

  with pytest.raises(flax.errors.TransformedMethodReturnValueError):
    run(fnn)
  with pytest.raises(errors.TransformedMethodReturnValueError) as info:
    run(lnn)
  assert '__call__' in str(info.value)


@pytest.mark.parametrize('name', ['jit', 'remat'])
@pytest.mark.parametrize('what', ['module', 'variable', 'nested'])
def test_lifted_function_returns_module(name, what):
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def make_things(mdl, x):
          if what == 'variable':
            return mdl.variable('state', 'v', lambda: jnp.zeros(()))
          d = nn.Dense(3, name='made')
          y = d(x)
          return d if what == 'module' else {'y': y, 'layer': [d]}
        return getattr(nn, name)(make_things)(self, x)
    return Model()

  def run(nn):
    return build(nn).init(jax.random.key(0), jnp.ones((3,)))

  with pytest.raises(flax.errors.TransformedMethodReturnValueError):
    run(fnn)
  with pytest.raises(errors.TransformedMethodReturnValueError) as info:
    run(lnn)
  assert 'make_things' in str(info.value)


# -- PartitioningUnspecifiedError --------------------------------------------


def test_partitioned_variable_stacked_without_partition_name():
  def build(nn):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        k = nn.with_partitioning(nn.initializers.lecun_normal(),
                                 ('embed', 'mlp'))
        return nn.Dense(2, kernel_init=k)(x), None

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.scan(Block, variable_axes={'params': 0},
                       split_rngs={'params': True}, length=2)(
                           name='stack')(x, None)
    return Model()

  def run(nn):
    return build(nn).init(jax.random.key(0), jnp.ones((2, 2)))

  with pytest.raises(flax.errors.PartitioningUnspecifiedError):
    run(fnn)
  with pytest.raises(errors.PartitioningUnspecifiedError) as info:
    run(lnn)
  msg = str(info.value)
  assert "('embed', 'mlp')" in msg and 'partition_name' in msg
