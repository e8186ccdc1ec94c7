"""Mistakes in lifted transforms raise liftmods.errors classes whose message
names the scope path, the collection and what was expected versus found."""
import jax
import jax.numpy as jnp
import pytest

from liftmods import errors
from liftmods.core import apply, init
from liftmods.core import lift

normal = jax.nn.initializers.normal(0.5)


def dense(scope, x, features=3):
  kernel = scope.param('kernel', normal, (x.shape[-1], features))
  return x @ kernel


def test_error_classes_are_lift_errors():
  for cls in (errors.ScanCarryError, errors.BroadcastVariableError,
              errors.CondBranchVariablesError, errors.VariableAxisError,
              errors.WhileLoopInitError):
    assert issubclass(cls, errors.LiftError)
    assert issubclass(cls, errors.LiftmodsError)


# -- scan carry ---------------------------------------------------------------------


def test_scan_carry_changing_shape():
  def body(scope, c, x):
    return jnp.concatenate([c, x]), x

  def f(scope, xs):
    return lift.scan(body)(scope.push('loop'), jnp.zeros(2), xs)

  with pytest.raises(errors.ScanCarryError) as info:
    init(f)(jax.random.key(0), jnp.ones((3, 2)))
  msg = str(info.value)
  assert '/loop' in msg
  assert 'went in as float32[2] and came out as float32[4]' in msg


def test_scan_carry_changing_structure():
  def body(scope, c, x):
    return (c, c), x

  def f(scope, xs):
    return lift.scan(body)(scope, jnp.zeros(2), xs)

  with pytest.raises(errors.ScanCarryError, match='structure'):
    init(f)(jax.random.key(0), jnp.ones((3, 2)))


def test_scan_carry_collection_created_in_body():
  def body(scope, c, x):
    count = scope.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))
    count.value += 1
    return c, x

  def f(scope, xs):
    return lift.scan(body, variable_carry='counter')(
        scope.push('loop'), (), xs)

  # The first iteration runs outside the loop and creates the counter
  # (flax#2052); the loop then counts the other two.
  _, variables = init(f)(jax.random.key(0), jnp.ones((3, 2)))
  assert int(variables['counter']['loop']['n']) == 3


def test_scan_carry_variable_changing_dtype():
  def body(scope, c, x):
    count = scope.variable('counter', 'n')
    count.value = count.value + 0.5
    return c, x

  def f(scope, xs):
    scope.push('loop').variable('counter', 'n',
                                lambda: jnp.zeros((), jnp.int32))
    return lift.scan(body, variable_carry='counter')(
        scope.push('loop', reuse=True), (), xs)

  with pytest.raises(errors.ScanCarryError) as info:
    init(f)(jax.random.key(0), jnp.ones((3, 2)))
  msg = str(info.value)
  assert '"counter"' in msg and 'in as int32[] and came out as float32[]' in msg


# -- axis sizes ------------------------------------------------------------------------


def _vmapped(scope, x):
  return lift.vmap(dense, variable_axes={'params': 0},
                   split_rngs={'params': True})(scope.push('stack'), x)


def test_vmap_variable_with_wrong_axis_size():
  _, variables = init(_vmapped)(jax.random.key(0), jnp.ones((4, 3)))
  with pytest.raises(errors.VariableAxisError) as info:
    apply(_vmapped)(variables, jnp.ones((5, 3)))
  msg = str(info.value)
  assert '/stack' in msg and '"params"' in msg and '"kernel"' in msg
  assert 'size 5' in msg and '(4, 3, 3)' in msg


def test_vmap_variable_missing_axis():
  def unmapped(scope, x):
    return dense(scope.push('stack'), x[0])

  _, variables = init(unmapped)(jax.random.key(0), jnp.ones((4, 3)))
  bad = {'params': {'stack': {'kernel': variables['params']['stack'][
      'kernel'][0]}}}  # shape (3,): axis 0 has size 3, not 4
  with pytest.raises(errors.VariableAxisError, match=r'size 4'):
    apply(_vmapped)(bad, jnp.ones((4, 3)))
  scalar = {'params': {'stack': {'kernel': jnp.float32(1)}}}
  with pytest.raises(errors.VariableAxisError, match='has no axis 0'):
    apply(_vmapped)(scalar, jnp.ones((4, 3)))


def test_scan_variable_with_wrong_length():
  def body(scope, c, x):
    return c, dense(scope, x)

  def f(scope, xs):
    return lift.scan(body, variable_axes={'params': 0},
                     split_rngs={'params': True})(scope.push('layers'), (), xs)

  _, variables = init(f)(jax.random.key(0), jnp.ones((4, 3)))
  with pytest.raises(errors.VariableAxisError) as info:
    apply(f)(variables, jnp.ones((6, 3)))
  msg = str(info.value)
  assert '/layers' in msg and '"params"' in msg and 'size 6' in msg
  assert 'size 4' in msg


# -- while_loop ---------------------------------------------------------------------------


def test_while_loop_creates_params_before_the_loop():
  def body(scope, c):
    return dense(scope, c)

  def f(scope, x):
    return lift.while_loop(lambda s, c: False, body, scope.push('w'), x)

  # A run of the body before the loop creates the parameters, as the
  # first call of a Python loop's body would.
  y, variables = init(f)(jax.random.key(0), jnp.ones((2, 3)))
  _, want = init(lambda scope, x: dense(scope.push('w'), x))(
      jax.random.key(0), jnp.ones((2, 3)))
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(
      lambda a, b: bool((a == b).all()), variables, want))
  assert (y == 1).all()  # the condition is False: the carry goes through


def test_while_loop_creates_carry_variables_before_the_loop():
  def body(scope, c):
    scope.variable('state', 'n', lambda: jnp.zeros(()))
    return c

  def f(scope, x):
    return lift.while_loop(lambda s, c: False, body, scope.push('w'), x,
                           carry_variables='state')

  _, variables = init(f)(jax.random.key(0), jnp.ones(2))
  assert variables == {'state': {'w': {'n': 0.0}}}


def test_while_loop_missing_param_on_apply_is_not_an_init_error():
  def f(scope, x):
    return lift.while_loop(lambda s, c: False, dense, scope, x)

  with pytest.raises(errors.ScopeCollectionNotFound):
    apply(f)({}, jnp.ones((2, 3)))


# -- cond / switch ------------------------------------------------------------------------


def test_cond_branches_creating_different_variables():
  def true_fn(scope, x):
    return dense(scope.push('a'), x)

  def false_fn(scope, x):
    return dense(scope.push('b'), x)

  def f(scope, x, pred):
    return lift.cond(pred, true_fn, false_fn, scope.push('c'), x)

  with pytest.raises(errors.CondBranchVariablesError) as info:
    init(f)(jax.random.key(0), jnp.ones((2, 3)), True)
  msg = str(info.value)
  assert '/c' in msg and '"params"' in msg and 'kernel' in msg
  assert 'does not create it' in msg


def test_switch_branches_creating_different_shapes():
  def branch(features):
    return lambda scope, x: dense(scope, x, features)[:, :1]

  def f(scope, x, index):
    return lift.switch(index, [branch(2), branch(2), branch(4)], scope, x)

  with pytest.raises(errors.CondBranchVariablesError) as info:
    init(f)(jax.random.key(0), jnp.ones((2, 3)), 0)
  msg = str(info.value)
  assert 'branch 2 creates it as float32[3, 4]' in msg and '"kernel"' in msg


def test_cond_output_mismatch_stays_a_jax_error():
  def f(scope, x, pred):
    return lift.cond(pred, lambda s, x: x, lambda s, x: x[:1], scope, x)

  with pytest.raises(TypeError):
    init(f)(jax.random.key(0), jnp.ones(2), True)


# -- broadcast ----------------------------------------------------------------------------


def test_broadcast_collection_written_from_loop_values():
  def body(scope, c, x):
    total = scope.variable('stats', 'total', jnp.zeros, ())
    total.value = total.value + x.sum()
    return c, x

  def f(scope, xs):
    return lift.scan(body, variable_broadcast='stats')(
        scope.push('loop'), (), xs)

  with pytest.raises(errors.BroadcastVariableError) as info:
    init(f)(jax.random.key(0), jnp.ones((3, 2)))
  msg = str(info.value)
  assert '/loop' in msg and '"stats"' in msg and '"total"' in msg


def test_broadcast_params_with_split_rng():
  def body(scope, c, x):
    return c, dense(scope, x)

  def f(scope, xs):
    return lift.scan(body, variable_broadcast='params',
                     split_rngs={'params': True})(scope.push('loop'), (), xs)

  with pytest.raises(errors.BroadcastVariableError,
                     match='"kernel" of collection "params"'):
    init(f)(jax.random.key(0), jnp.ones((3, 2)))


def test_broadcast_output_depending_on_loop():
  def body(scope, c, x):
    return c, x

  def f(scope, xs):
    return lift.scan(body, out_axes=lift.broadcast)(scope, (), xs)

  with pytest.raises(errors.BroadcastVariableError, match='out_axes'):
    init(f)(jax.random.key(0), jnp.ones((3, 2)))
