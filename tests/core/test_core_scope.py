"""Unit tests of liftmods.core.scope: every Scope operation, the entry points
init/apply/bind, and every error the core raises."""
import copy as pycopy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from liftmods import errors
from liftmods.core import (DenyList, FrozenDict, Scope, Variable, apply, bind,
                           freeze, init, meta)
from liftmods.core.rngs import LazyKey, fold_static
from treecheck import assert_identical

ones_init = jax.nn.initializers.ones
zeros_init = jax.nn.initializers.zeros
normal_init = jax.nn.initializers.normal(1.0)


def _kd(key):
  """Raw uint32 data of a typed or raw key, for exact comparison."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(key))
  return np.asarray(key)


def _assert_same_key(a, b):
  np.testing.assert_array_equal(_kd(a), _kd(b))


def _assert_different_key(a, b):
  assert not np.array_equal(_kd(a), _kd(b))


def dense(scope, x, features):
  kernel = scope.param('kernel', normal_init, (x.shape[-1], features))
  bias = scope.param('bias', zeros_init, (features,))
  return x @ kernel + bias


KEY = jax.random.key(0)


# -- param -----------------------------------------------------------------


class TestParam:

  def test_param_created_in_init_and_returned(self):
    seen = {}

    def f(scope):
      seen['w'] = scope.param('w', normal_init, (3, 2))
      return seen['w']

    out, variables = init(f)(KEY)
    assert set(variables) == {'params'}
    assert set(variables['params']) == {'w'}
    assert variables['params']['w'].shape == (3, 2)
    np.testing.assert_array_equal(out, variables['params']['w'])

  def test_param_init_fn_gets_successive_make_rng_keys(self):
    # The n-th param of a scope is initialized with the key of the n-th
    # make_rng('params') call, i.e. the root key folded with counter n.
    def f(scope):
      a = scope.param('a', lambda k: jax.random.key_data(k))
      b = scope.param('b', lambda k: jax.random.key_data(k))
      return a, b

    (a, b), _ = init(f)(KEY)
    np.testing.assert_array_equal(a, _kd(fold_static(KEY, (1,))))
    np.testing.assert_array_equal(b, _kd(fold_static(KEY, (2,))))
    assert not np.array_equal(a, b)

  def test_param_init_args_and_kwargs_forwarded(self):
    calls = []

    def my_init(key, shape, *, fill):
      calls.append((shape, fill))
      return jnp.full(shape, fill)

    def f(scope):
      return scope.param('w', my_init, (2,), fill=7.0)

    out, variables = init(f)(KEY)
    assert calls == [((2,), 7.0)]
    np.testing.assert_array_equal(variables['params']['w'], [7.0, 7.0])

  def test_param_apply_returns_stored_value_without_calling_rng(self):
    stored = {'params': {'w': jnp.arange(6.0).reshape(3, 2)}}

    def f(scope):
      return scope.param('w', normal_init, (3, 2))

    out = apply(f)(stored)  # no rngs: must not need 'params' rng
    np.testing.assert_array_equal(out, stored['params']['w'])

  def test_param_existing_value_not_reinitialized_in_init_mode(self):
    # Mutable params but a value already present: keep it.
    w = jnp.full((2,), 3.0)
    out, new = apply(lambda s: s.param('w', zeros_init, (2,)),
                     mutable=True)({'params': {'w': w}}, rngs=KEY)
    np.testing.assert_array_equal(out, w)
    np.testing.assert_array_equal(new['params']['w'], w)

  def test_param_unbox(self):
    init_fn = meta.with_partitioning(ones_init, ('in', 'out'))

    def f(scope):
      unboxed = scope.param('w', init_fn, (2, 3))
      boxed = scope.param('v', init_fn, (2, 3), unbox=False)
      return unboxed, boxed

    (unboxed, boxed), variables = init(f)(KEY)
    assert not isinstance(unboxed, meta.Partitioned)
    assert unboxed.shape == (2, 3)
    assert isinstance(boxed, meta.Partitioned)
    assert boxed.names == ('in', 'out')
    # The stored value keeps the box.
    assert isinstance(variables['params']['w'], meta.Partitioned)
    assert variables['params']['w'].names == ('in', 'out')
    # In apply, the box is stripped again (and shape checks see through it).
    out = apply(lambda s: s.param('w', init_fn, (2, 3)))(variables)
    assert not isinstance(out, meta.Partitioned)
    np.testing.assert_array_equal(out, np.ones((2, 3)))
    out = apply(lambda s: s.param('w', init_fn, (2, 3), unbox=False))(variables)
    assert isinstance(out, meta.Partitioned)

  def test_param_same_name_twice_is_error(self):
    def f(scope):
      scope.param('w', zeros_init, (1,))
      scope.param('w', zeros_init, (1,))

    with pytest.raises(errors.NameInUseError) as info:
      init(f)(KEY)
    msg = str(info.value)
    assert '"w"' in msg and '"params"' in msg


# -- variable / Variable ---------------------------------------------------


class TestVariable:

  def test_variable_init_fn_called_with_args_no_rng(self):
    def f(scope):
      v = scope.variable('state', 'count', jnp.full, (2,), 5, dtype=jnp.int32)
      return v

    v, variables = init(f)(KEY)
    assert isinstance(v, Variable)
    np.testing.assert_array_equal(variables['state']['count'], [5, 5])
    assert variables['state']['count'].dtype == jnp.int32

  def test_value_get_and_set(self):
    scope = bind({'state': {'n': 1}}, mutable=['state'])
    v = scope.variable('state', 'n')
    assert v.value == 1
    v.value = 41
    v.value += 1
    assert v.value == 42
    assert scope.get_variable('state', 'n') == 42
    assert scope.variables()['state']['n'] == 42
    assert v.is_mutable()
    assert v.collection == 'state' and v.name == 'n'
    assert 'state/n' in repr(v)

  def test_value_set_immutable_raises(self):
    scope = bind({'state': {'n': 1}})
    v = scope.variable('state', 'n')
    assert not v.is_mutable()
    with pytest.raises(errors.ModifyScopeVariableError) as info:
      v.value = 2
    msg = str(info.value)
    assert '"n"' in msg and '"state"' in msg
    assert scope.get_variable('state', 'n') == 1

  def test_existing_variable_init_fn_not_called(self):
    def boom():
      raise AssertionError('init_fn must not run for an existing variable')

    scope = bind({'state': {'n': 3}}, mutable=True)
    assert scope.variable('state', 'n', boom).value == 3

  def test_unbox_on_get_and_box_kept_on_set(self):
    box = meta.Partitioned(jnp.zeros(3), ('embed',))
    scope = bind({'cache': {'k': box}}, mutable=True)
    v = scope.variable('cache', 'k')
    assert not isinstance(v.value, meta.Partitioned)
    v.value = jnp.ones(3)
    stored = scope.get_variable('cache', 'k')
    assert isinstance(stored, meta.Partitioned)
    assert stored.names == ('embed',)
    np.testing.assert_array_equal(stored.value, np.ones(3))

  def test_unbox_false_returns_and_stores_raw(self):
    box = meta.Partitioned(jnp.zeros(3), ('embed',))
    scope = bind({'cache': {'k': box}}, mutable=True)
    v = scope.variable('cache', 'k', unbox=False)
    assert isinstance(v.value, meta.Partitioned)
    v.value = jnp.ones(3)  # unbox=False: stored exactly as given
    assert not isinstance(scope.get_variable('cache', 'k'), meta.Partitioned)

  def test_set_boxed_variable_to_new_structure(self):
    scope = bind({'s': {'v': {'a': meta.Partitioned(jnp.zeros(2), ('x',))}}},
                 mutable=True)
    v = scope.variable('s', 'v')
    v.value = {'a': jnp.ones(2), 'b': jnp.ones(3)}
    stored = scope.get_variable('s', 'v')
    assert set(stored) == {'a', 'b'}
    np.testing.assert_array_equal(stored['b'], np.ones(3))

  def test_missing_variable_in_immutable_collection(self):
    scope = bind({'state': {'other': 0}})
    with pytest.raises(errors.ScopeVariableNotFoundError) as info:
      scope.variable('state', 'n', lambda: 0)
    msg = str(info.value)
    assert '"n"' in msg and '"state"' in msg

  def test_missing_variable_without_init_fn_in_mutable_collection(self):
    scope = bind({'state': {'other': 0}}, mutable=True)
    with pytest.raises(errors.ScopeVariableNotFoundError):
      scope.variable('state', 'n')

  def test_missing_collection(self):
    scope = bind({'params': {}})
    with pytest.raises(errors.ScopeCollectionNotFound) as info:
      scope.variable('batch_stats', 'mean', jnp.zeros, (2,))
    msg = str(info.value)
    assert '"batch_stats"' in msg and '"mean"' in msg

  def test_same_name_in_different_collections_allowed(self):
    def f(scope):
      scope.param('x', zeros_init, (1,))
      scope.variable('stats', 'x', jnp.ones, (2,))
      scope.variable('cache', 'x', jnp.full, (3,), 2.0)

    _, variables = init(f)(KEY)
    assert variables['params']['x'].shape == (1,)
    assert variables['stats']['x'].shape == (2,)
    np.testing.assert_array_equal(variables['cache']['x'], [2.0, 2.0, 2.0])

  def test_same_variable_twice_in_one_collection_is_error(self):
    def f(scope):
      scope.variable('stats', 'x', jnp.ones, (2,))
      scope.variable('stats', 'x', jnp.ones, (2,))

    with pytest.raises(errors.NameInUseError) as info:
      init(f)(KEY)
    assert '"x"' in str(info.value) and '"stats"' in str(info.value)


# -- get/put/has_variable -----------------------------------------------


class TestGetPutHas:

  def test_get_variable_default_and_value(self):
    scope = bind({'params': {'w': 1}})
    assert scope.get_variable('params', 'w') == 1
    assert scope.get_variable('params', 'nope') is None
    assert scope.get_variable('params', 'nope', 'dflt') == 'dflt'
    # Missing collection during apply: just the default, no error.
    assert scope.get_variable('batch_stats', 'mean', 0.5) == 0.5

  def test_has_variable(self):
    scope = bind({'params': {'w': 1, 'child': {'v': 2}}})
    assert scope.has_variable('params', 'w')
    assert not scope.has_variable('params', 'v')
    assert not scope.has_variable('batch_stats', 'w')
    child = scope.push('child')
    assert child.has_variable('params', 'v')
    assert not child.has_variable('params', 'w')

  def test_missing_collection_read_during_apply(self):
    def f(scope):
      return (scope.has_variable('batch_stats', 'mean'),
              scope.get_variable('batch_stats', 'mean', -1),
              scope.push('c').get_variable('cache', 'k'))

    assert apply(f)({'params': {}}) == (False, -1, None)

  def test_put_variable_creates_nested_dicts(self):
    scope = bind({}, mutable=True)
    scope.push('a').push('b').put_variable('cache', 'k', 3)
    assert scope.variables() == {'cache': {'a': {'b': {'k': 3}}}}

  def test_put_variable_overwrites(self):
    scope = bind({'cache': {'k': 1}}, mutable=['cache'])
    scope.put_variable('cache', 'k', 2)
    assert scope.get_variable('cache', 'k') == 2

  def test_put_variable_immutable(self):
    scope = bind({'params': {'w': 1}}, mutable=['cache'])
    with pytest.raises(errors.ModifyScopeVariableError) as info:
      scope.push('sub').put_variable('params', 'w', 2)
    msg = str(info.value)
    assert '"w"' in msg and '"params"' in msg and '/sub' in msg
    assert scope.get_variable('params', 'w') == 1

  def test_child_writes_visible_to_parent_and_sibling_reuse(self):
    scope = bind({}, mutable=True)
    scope.push('a').put_variable('s', 'x', 1)
    again = scope.push('a', reuse=True)
    assert again.get_variable('s', 'x') == 1
    assert scope.variables()['s'] == {'a': {'x': 1}}


# -- rngs --------------------------------------------------------------------


class TestRngs:

  def test_make_rng_counters(self):
    scope = bind({}, rngs={'dropout': KEY})
    k1 = scope.make_rng('dropout')
    k2 = scope.make_rng('dropout')
    _assert_same_key(k1, fold_static(KEY, (1,)))
    _assert_same_key(k2, fold_static(KEY, (2,)))
    _assert_different_key(k1, k2)
    assert scope.rng_counters['dropout'] == 2

  def test_make_rng_child_derivation(self):
    scope = bind({}, rngs={'params': KEY})
    child = scope.push('c')
    grandchild = child.push('g')
    _assert_same_key(child.make_rng('params'), fold_static(KEY, ('c', 1)))
    _assert_same_key(grandchild.make_rng(), fold_static(KEY, ('c', 'g', 1)))
    _assert_same_key(child.make_rng('params'), fold_static(KEY, ('c', 2)))
    # The parent's own counter is independent of its children's.
    _assert_same_key(scope.make_rng(), fold_static(KEY, (1,)))

  def test_child_keys_differ_from_parent_and_sibling(self):
    scope = bind({}, rngs={'params': KEY})
    a = scope.push('a').make_rng()
    b = scope.push('b').make_rng()
    root = scope.make_rng()
    _assert_different_key(a, b)
    _assert_different_key(a, root)

  def test_reuse_shares_rng_counter(self):
    scope = bind({}, rngs={'params': KEY})
    first = scope.push('a').make_rng()
    second = scope.push('a', reuse=True).make_rng()
    _assert_same_key(first, fold_static(KEY, ('a', 1)))
    _assert_same_key(second, fold_static(KEY, ('a', 2)))

  def test_make_rng_falls_back_to_params(self):
    scope = bind({}, rngs={'params': KEY})
    k = scope.make_rng('dropout')
    _assert_same_key(k, fold_static(KEY, (1,)))
    # The fallback consumed the 'params' counter.
    _assert_same_key(scope.make_rng('params'), fold_static(KEY, (2,)))
    assert 'dropout' not in scope.rng_counters

  def test_make_rng_missing_without_params(self):
    scope = bind({}, rngs={'other': KEY}).push('layer')
    with pytest.raises(errors.InvalidRngError) as info:
      scope.make_rng('dropout')
    msg = str(info.value)
    assert '"dropout"' in msg and '/layer' in msg

  def test_make_rng_without_any_rngs(self):
    with pytest.raises(errors.InvalidRngError) as info:
      bind({}).make_rng()
    assert '"params"' in str(info.value)

  def test_param_in_init_without_params_rng(self):
    def f(scope):
      return scope.push('d').param('w', zeros_init, (1,))

    with pytest.raises(errors.InvalidRngError) as info:
      init(f)({'dropout': KEY})
    assert '"params"' in str(info.value) and '/d' in str(info.value)

  def test_has_rng(self):
    scope = bind({}, rngs={'params': KEY, 'dropout': KEY})
    assert scope.has_rng('params') and scope.has_rng('dropout')
    assert not scope.has_rng('noise')
    child = scope.push('c')
    assert child.has_rng('dropout') and not child.has_rng('noise')
    assert not bind({}).has_rng('params')

  def test_raw_uint32_key(self):
    raw = jax.random.PRNGKey(3)
    scope = bind({}, rngs={'params': raw})
    k = scope.push('x').make_rng()
    assert k.dtype == jnp.uint32 and k.shape == (2,)
    np.testing.assert_array_equal(k, fold_static(raw, ('x', 1)))
    # Same bits as the typed key of the same seed.
    np.testing.assert_array_equal(
        k, _kd(bind({}, rngs={'params': jax.random.key(3)}).push('x')
               .make_rng()))

  def test_lazykey_rng_accepted(self):
    lazy = LazyKey(KEY, ('pre',))
    scope = bind({}, rngs={'params': lazy})
    _assert_same_key(scope.make_rng(), fold_static(KEY, ('pre', 1)))

  def test_invalid_rng_type(self):
    with pytest.raises(errors.InvalidRngTypeError) as info:
      init(lambda s: None)(0)
    assert '"params"' in str(info.value)
    with pytest.raises(errors.InvalidRngTypeError) as info:
      apply(lambda s: None)({}, rngs={'dropout': np.zeros(2, np.float32)})
    assert '"dropout"' in str(info.value)
    with pytest.raises(errors.InvalidRngError, match='rngs should be a '
                       'dictionary mapping strings'):
      bind({}, rngs={'params': 'not a key'})
    with pytest.raises(errors.InvalidRngTypeError):
      init(lambda s: None)(jnp.zeros((2,), jnp.int32))

  def test_batched_typed_key_rejected(self):
    keys = jax.random.split(KEY, 3)
    with pytest.raises(errors.InvalidRngTypeError):
      init(lambda s: s.param('w', zeros_init, (1,)))(keys)


# -- push, naming, rewound -----------------------------------------------------


class TestPushAndNames:

  def test_push_reserves_name(self):
    scope = bind({})
    scope.push('a')
    with pytest.raises(errors.NameInUseError) as info:
      scope.push('a')
    msg = str(info.value)
    assert 'submodule' in msg and '"a"' in msg

  def test_push_reuse(self):
    scope = bind({'params': {'a': {'w': 1}}})
    first = scope.push('a')
    second = scope.push('a', reuse=True)
    assert second.path == first.path == ('a',)
    assert second.get_variable('params', 'w') == 1
    # reuse=True also works for a name never pushed before.
    fresh = scope.push('b', reuse=True)
    assert fresh.path == ('b',)
    with pytest.raises(errors.NameInUseError):
      scope.push('b')

  def test_push_default_name_and_prefix(self):
    scope = bind({})
    assert scope.push(prefix='layer_').name == 'layer_0'
    assert scope.push(prefix='layer_').name == 'layer_1'
    assert scope.push().name == '0'
    assert scope.push().name == '1'
    assert scope.default_name('layer_') == 'layer_2'

  def test_default_name_skips_variable_names(self):
    def f(scope):
      scope.param('dense0', zeros_init, (1,))
      return scope.push(prefix='dense').name

    name, _ = init(f)(KEY)
    assert name == 'dense1'

  def test_child_and_variable_name_clash(self):
    def child_then_param(scope):
      scope.push('x')
      scope.param('x', zeros_init, (1,))

    def param_then_child(scope):
      scope.param('x', zeros_init, (1,))
      scope.push('x')

    with pytest.raises(errors.NameInUseError):
      init(child_then_param)(KEY)
    with pytest.raises(errors.NameInUseError) as info:
      init(param_then_child)(KEY)
    assert 'submodule' in str(info.value)

  def test_name_must_be_str(self):
    with pytest.raises(TypeError):
      bind({}).push(3)
    with pytest.raises(TypeError):
      bind({}, mutable=True).variable('c', 1, lambda: 0)

  def test_name_in_use_reports_owner_path(self):
    scope = bind({}).push('outer')
    scope.push('inner')
    with pytest.raises(errors.NameInUseError) as info:
      scope.push('inner')
    assert '/outer' in str(info.value)

  def test_path_and_path_text(self):
    root = bind({})
    assert root.path == ()
    assert root.path_text == '/'
    b = root.push('a').push('b')
    assert b.path == ('a', 'b')
    assert b.path_text == '/a/b'
    assert b.name == 'b'
    assert b.parent.name == 'a'
    assert b.root is root
    assert repr(b) == 'Scope(/a/b)'

  def test_rewound_clears_reservations_keeps_rngs(self):
    scope = bind({}, rngs={'params': KEY}, mutable=True)
    w = scope.param('w', normal_init, (2,))
    k1 = scope.make_rng()  # params counter -> 2
    again = scope.rewound()
    # Same name may be declared again and returns the stored value.
    np.testing.assert_array_equal(again.param('w', normal_init, (2,)), w)
    _assert_same_key(again.make_rng(), fold_static(KEY, (3,)))
    _assert_different_key(k1, fold_static(KEY, (3,)))
    assert again.path == scope.path

  def test_rewound_rewind_rngs(self):
    scope = bind({}, rngs={'params': KEY})
    k1 = scope.make_rng()
    rewound = scope.rewound(rewind_rngs=True)
    _assert_same_key(rewound.make_rng(), k1)
    # The original scope keeps its own counter.
    _assert_same_key(scope.make_rng(), fold_static(KEY, (2,)))

  def test_rewound_shares_variables(self):
    scope = bind({}, mutable=True)
    scope.rewound().put_variable('c', 'x', 1)
    assert scope.get_variable('c', 'x') == 1


# -- variables() / mutable_variables() / mutability --------------------------


class TestCollections:

  def test_variables_of_root_and_child(self):
    xs = {'params': {'a': {'w': 1}, 'b': {'w': 2}}, 'stats': {'a': {'m': 3}}}
    scope = bind(xs)
    assert scope.variables() == xs
    assert scope.push('a').variables() == {'params': {'w': 1},
                                           'stats': {'m': 3}}
    # Child b has no 'stats' entry: the collection is left out.
    assert scope.push('b').variables() == {'params': {'w': 2}}
    assert scope.push('c').variables() == {}

  def test_mutable_variables(self):
    scope = bind({'params': {'w': 1}, 'stats': {'m': 2}, 'cache': {'k': 3}},
                 mutable=['stats', 'cache'])
    assert scope.mutable_variables() == {'stats': {'m': 2}, 'cache': {'k': 3}}
    assert bind({'params': {'w': 1}}).mutable_variables() == {}

  def test_collections_created_by_writes_appear(self):
    scope = bind({'params': {'w': 1}}, mutable=['cache'])
    assert 'cache' not in scope.variables()
    scope.push('sub').put_variable('cache', 'k', 0)
    assert scope.variables()['cache'] == {'sub': {'k': 0}}
    assert scope.mutable_variables() == {'cache': {'sub': {'k': 0}}}

  @pytest.mark.parametrize('mutable, expected', [
      (True, {'params': True, 'stats': True, 'cache': True}),
      (False, {'params': False, 'stats': False, 'cache': False}),
      ('stats', {'params': False, 'stats': True, 'cache': False}),
      (['stats', 'cache'], {'params': False, 'stats': True, 'cache': True}),
      (('params',), {'params': True, 'stats': False, 'cache': False}),
      ({'cache'}, {'params': False, 'stats': False, 'cache': True}),
      (DenyList('params'), {'params': False, 'stats': True, 'cache': True}),
      (DenyList(['params', 'cache']),
       {'params': False, 'stats': True, 'cache': False}),
      ([], {'params': False, 'stats': False, 'cache': False}),
  ])
  def test_is_mutable_collection(self, mutable, expected):
    scope = bind({}, mutable=mutable)
    child = scope.push('c')
    for col, want in expected.items():
      assert scope.is_mutable_collection(col) is want, col
      assert child.is_mutable_collection(col) is want, col

  def test_invalid_filter(self):
    scope = bind({}, mutable=3)
    with pytest.raises(errors.InvalidFilterError) as info:
      scope.is_mutable_collection('params')
    assert '3' in str(info.value)
    with pytest.raises(errors.InvalidFilterError):
      apply(lambda s: None, mutable=None)({'params': {}})

  def test_scope_constructor_with_parent_uses_own_mutable(self):
    parent = bind({}, mutable=True)
    assert parent.is_mutable_collection('params')
    child = Scope({}, mutable=False, parent=parent, name='x', path=('x',))
    assert not child.is_mutable_collection('params')


# -- entry points --------------------------------------------------------------


class TestEntryPoints:

  def test_init_rng_key_and_dict_equivalent(self):
    x = jnp.ones((2, 3))
    _, v1 = init(dense)(KEY, x, 4)
    _, v2 = init(dense)({'params': KEY}, x, 4)
    assert_identical(v1, v2, same_containers=True)
    _, v3 = init(dense)(jax.random.key(1), x, 4)
    with pytest.raises(AssertionError):
      assert_identical(v1, v3)

  def test_init_with_extra_rng_sequences(self):
    def f(scope):
      w = scope.param('w', normal_init, (3,))
      return scope.make_rng('dropout'), w

    (k, _), variables = init(f)({'params': KEY, 'dropout': jax.random.key(9)})
    _assert_same_key(k, fold_static(jax.random.key(9), (1,)))
    assert set(variables) == {'params'}

  def test_init_flags(self):
    def f(scope):
      return scope.get_flag('initializing'), scope.has_flag('initializing')

    assert init(f)(KEY)[0] == (True, True)
    assert apply(f)({}) == (None, False)
    assert init(f, flags={'extra': 1})(KEY)[0] == (True, True)
    assert apply(lambda s: s.get_flag('extra'), flags={'extra': 1})({}) == 1
    assert apply(lambda s: s.push('c').get_flag('extra', 5))({}) == 5

  def test_apply_returns_out_only_when_not_mutable(self):
    _, variables = init(dense)(KEY, jnp.ones((1, 3)), 2)
    out = apply(dense)(variables, jnp.ones((1, 3)), 2)
    assert isinstance(out, jax.Array)
    assert out.shape == (1, 2)

  def test_apply_mutable_returns_mutated(self):
    def f(scope):
      count = scope.variable('counter', 'n', lambda: 0)
      count.value += 1
      scope.variable('cache', 'c', lambda: 'x')
      return scope.param('w', zeros_init, (1,))

    variables = {'params': {'w': jnp.ones(1)}, 'counter': {'n': 10},
                 'cache': {'c': 'y'}}
    out, mutated = apply(f, mutable=['counter'])(variables)
    np.testing.assert_array_equal(out, np.ones(1))
    assert mutated == {'counter': {'n': 11}}
    out, mutated = apply(f, mutable=True)(variables)
    assert set(mutated) == {'params', 'counter', 'cache'}
    assert mutated['counter'] == {'n': 11}
    out, mutated = apply(f, mutable=DenyList('params'))(variables)
    assert set(mutated) == {'counter', 'cache'}

  def test_apply_mutable_empty_list_still_returns_tuple(self):
    result = apply(lambda s: 7, mutable=[])({'params': {}})
    assert result == (7, {})

  def test_apply_creates_missing_mutable_collection(self):
    def f(scope):
      scope.push('bn').variable('batch_stats', 'mean', jnp.zeros, (2,))
      return 0

    out, mutated = apply(f, mutable=['batch_stats'])({'params': {}})
    assert set(mutated) == {'batch_stats'}
    np.testing.assert_array_equal(mutated['batch_stats']['bn']['mean'],
                                  np.zeros(2))

  def test_init_mutable_subset(self):
    def f(scope):
      scope.param('w', zeros_init, (1,))
      if scope.is_mutable_collection('stats'):
        scope.variable('stats', 's', lambda: 1)

    _, variables = init(f, mutable=['params'])(KEY)
    assert set(variables) == {'params'}
    _, variables = init(f)(KEY)
    assert set(variables) == {'params', 'stats'}

  def test_apply_rngs_key_or_dict(self):
    def f(scope):
      return scope.make_rng('dropout')

    k_from_key = apply(f)({}, rngs=KEY)  # a bare key is the 'params' rng
    k_from_dict = apply(f)({}, rngs={'dropout': KEY})
    _assert_same_key(k_from_key, fold_static(KEY, (1,)))
    _assert_same_key(k_from_key, k_from_dict)
    with pytest.raises(errors.InvalidRngError):
      apply(f)({})

  def test_apply_kwargs_forwarded(self):
    def f(scope, x, *, scale):
      return x * scale

    assert apply(f)({}, 2, scale=3) == 6
    out, _ = init(f)(KEY, 2, scale=4)
    assert out == 8

  def test_input_dict_never_mutated(self):
    def f(scope):
      a = scope.push('a')
      a.variable('stats', 'm', jnp.zeros, (2,)).value = jnp.full((2,), 5.0)
      scope.variable('stats', 'new', lambda: 1)
      scope.put_variable('cache', 'k', 3)
      w = a.param('w', zeros_init, (2,))
      return w

    variables = {
        'params': {'a': {'w': jnp.ones(2)}},
        'stats': {'a': {'m': jnp.zeros(2)}, 'other': {'z': jnp.ones(1)}},
    }
    snapshot = pycopy.deepcopy(variables)
    inner_ids = (id(variables['stats']), id(variables['stats']['a']),
                 id(variables['params']['a']))
    _, mutated = apply(f, mutable=True)(variables)
    assert_identical(variables, snapshot, same_containers=True)
    assert set(variables['stats']) == {'a', 'other'}
    assert set(variables['stats']['a']) == {'m'}
    assert 'cache' not in variables
    assert inner_ids == (id(variables['stats']), id(variables['stats']['a']),
                         id(variables['params']['a']))
    np.testing.assert_array_equal(mutated['stats']['a']['m'], [5.0, 5.0])
    assert mutated['stats']['new'] == 1
    assert mutated['cache'] == {'k': 3}
    assert mutated['stats'] is not variables['stats']
    # bind with mutable collections copies as well.
    scope = bind(variables, mutable=True)
    scope.push('a').put_variable('stats', 'm', 0)
    assert_identical(variables, snapshot, same_containers=True)

  def test_frozen_dict_variables(self):
    variables = freeze({'params': {'w': jnp.ones(2)}, 'stats': {'n': 1}})

    def f(scope):
      v = scope.variable('stats', 'n')
      v.value = v.value + 1
      return scope.param('w', zeros_init, (2,))

    out, mutated = apply(f, mutable=['stats'])(variables)
    np.testing.assert_array_equal(out, np.ones(2))
    assert mutated == {'stats': {'n': 2}}
    assert variables['stats']['n'] == 1
    assert isinstance(variables, FrozenDict)

  def test_scope_invalid_after_apply(self):
    captured = {}

    def f(scope):
      captured['scope'] = scope
      scope.param('w', zeros_init, (1,))
      return 0

    _, variables = init(f)(KEY)
    scope = captured['scope']
    assert scope.invalid
    with pytest.raises(errors.InvalidScopeError):
      scope.make_rng('params')
    with pytest.raises(errors.InvalidScopeError):
      scope.push('child')
    with pytest.raises(errors.InvalidScopeError):
      scope.put_variable('params', 'w', 1)
    with pytest.raises(errors.InvalidScopeError):
      scope.rewound()
    apply(f)(variables)
    assert captured['scope'].invalid
    # The stored variables were not touched by the failed writes.
    np.testing.assert_array_equal(variables['params']['w'], np.zeros(1))

  def test_scope_invalidated_even_when_fn_raises(self):
    captured = {}

    def f(scope):
      captured['scope'] = scope
      raise RuntimeError('boom')

    with pytest.raises(RuntimeError, match='boom'):
      apply(f)({})
    assert captured['scope'].invalid
    with pytest.raises(errors.InvalidScopeError):
      captured['scope'].push('x')

  def test_bind_is_usable_and_not_invalidated(self):
    scope = bind({'params': {'w': 1}}, rngs=KEY)
    assert not scope.invalid
    assert scope.param('w', lambda k: 0) == 1
    _assert_same_key(scope.make_rng(), fold_static(KEY, (1,)))


# -- errors ----------------------------------------------------------------


class TestErrors:

  def test_param_shape_error(self):
    def model(scope, x, features):
      return dense(scope.push('dense0'), x, features)

    x = jnp.ones((2, 3))
    _, variables = init(model)(KEY, x, 4)
    with pytest.raises(errors.ScopeParamShapeError) as info:
      apply(model)(variables, x, 5)
    msg = str(info.value)
    assert '/dense0' in msg
    assert '"kernel"' in msg
    assert '(3, 4)' in msg and '(3, 5)' in msg
    assert msg.index('(3, 5)') < msg.index('(3, 4)')  # expected, then stored

  def test_param_shape_error_root_and_nested(self):
    variables = {'params': {'b': jnp.zeros(3),
                            'outer': {'inner': {'b': jnp.zeros(2)}}}}
    with pytest.raises(errors.ScopeParamShapeError) as info:
      apply(lambda s: s.param('b', zeros_init, (4,)))(variables)
    assert '(3,)' in str(info.value) and '(4,)' in str(info.value)
    with pytest.raises(errors.ScopeParamShapeError) as info:
      apply(lambda s: s.push('outer').push('inner').param(
          'b', zeros_init, (2, 1)))(variables)
    msg = str(info.value)
    assert '/outer/inner' in msg and '(2,)' in msg and '(2, 1)' in msg

  def test_param_shape_checked_repeatedly(self):
    # The shape check caches expected shapes per initializer+args; a second
    # call with different args must still be checked.
    variables = {'params': {'b': jnp.zeros(3)}}
    f = lambda s, n: s.param('b', zeros_init, (n,))
    np.testing.assert_array_equal(apply(f)(variables, 3), np.zeros(3))
    with pytest.raises(errors.ScopeParamShapeError):
      apply(f)(variables, 2)
    np.testing.assert_array_equal(apply(f)(variables, 3), np.zeros(3))
    with pytest.raises(errors.ScopeParamShapeError):
      apply(f)(variables, 2)

  def test_param_shape_checked_for_recreated_closures_and_partials(self):
    # Initializers re-created per call (closures, partials) over different
    # sizes must each be checked against their own shapes.
    import functools

    def make(n):
      return lambda key: jnp.zeros((n,))

    def full(key, n):
      return jnp.zeros((n,))

    variables = {'params': {'b': jnp.zeros(3)}}
    for init_fn in (make(3), functools.partial(full, n=3)):
      np.testing.assert_array_equal(
          apply(lambda s: s.param('b', init_fn))(variables), np.zeros(3))
    for init_fn in (make(2), functools.partial(full, n=2)):
      with pytest.raises(errors.ScopeParamShapeError):
        apply(lambda s: s.param('b', init_fn))(variables)
    two = {'params': {'b': jnp.zeros(2)}}
    np.testing.assert_array_equal(
        apply(lambda s: s.param('b', make(2)))(two), np.zeros(2))

  def test_param_shape_check_bound_method_initializers(self):
    class Layer:

      def __init__(self, n):
        self.n = n

      def init_bias(self, key):
        return jnp.zeros((self.n,))

    wide, narrow = Layer(3), Layer(2)

    def f(scope):
      a = scope.push('wide').param('b', wide.init_bias)
      b = scope.push('narrow').param('b', narrow.init_bias)
      return a.shape, b.shape

    _, variables = init(f)(KEY)
    assert variables['params']['narrow']['b'].shape == (2,)
    assert apply(f)(variables) == ((3,), (2,))

  def test_param_shape_check_not_stale_for_mutable_closure(self):
    class Config:
      n = 3

    cfg = Config()
    init_fn = lambda key: jnp.zeros((cfg.n,))
    variables = {'params': {'b': jnp.zeros(3)}}
    apply(lambda s: s.param('b', init_fn))(variables)
    cfg.n = 2
    with pytest.raises(errors.ScopeParamShapeError):
      apply(lambda s: s.param('b', init_fn))(variables)

  def test_param_shape_error_with_boxed_pytree_init(self):
    def two(key, n):
      return {'a': jnp.zeros(n), 'b': meta.Partitioned(jnp.zeros((n, 2)),
                                                       ('x', None))}

    _, variables = init(lambda s: s.param('p', two, 3))(KEY)
    apply(lambda s: s.param('p', two, 3))(variables)
    with pytest.raises(errors.ScopeParamShapeError) as info:
      apply(lambda s: s.param('p', two, 4))(variables)
    assert '(3,)' in str(info.value) and '(4,)' in str(info.value)

  def test_param_not_found(self):
    variables = {'params': {'layer': {'other': jnp.zeros(1)}}}
    with pytest.raises(errors.ScopeParamNotFoundError) as info:
      apply(lambda s: s.push('layer').param('kernel', zeros_init, (1,)))(
          variables)
    msg = str(info.value)
    assert '"kernel"' in msg and '/layer' in msg

  def test_collection_not_found_for_param(self):
    with pytest.raises(errors.ScopeCollectionNotFound) as info:
      apply(lambda s: s.push('enc').param('kernel', zeros_init, (1,)))({})
    msg = str(info.value)
    assert '"params"' in msg and '"kernel"' in msg and '/enc' in msg
    # 'params' exists at the root but not for this child: as in Linen, that
    # is a missing parameter, not a missing collection.
    with pytest.raises(errors.ScopeParamNotFoundError):
      apply(lambda s: s.push('enc').param('kernel', zeros_init, (1,)))(
          {'params': {'dec': {'kernel': 0}}})

  def test_variable_not_found(self):
    variables = {'batch_stats': {'bn': {'mean': 0}}}
    with pytest.raises(errors.ScopeVariableNotFoundError) as info:
      apply(lambda s: s.push('bn').variable('batch_stats', 'var'))(variables)
    msg = str(info.value)
    assert '"var"' in msg and '"batch_stats"' in msg and '/bn' in msg

  def test_modify_immutable(self):
    def f(scope):
      v = scope.push('bn').variable('batch_stats', 'mean')
      v.value = 1

    with pytest.raises(errors.ModifyScopeVariableError) as info:
      apply(f)({'batch_stats': {'bn': {'mean': 0}}})
    msg = str(info.value)
    assert '"mean"' in msg and '"batch_stats"' in msg and '/bn' in msg
    assert errors.ImmutableVariableError is errors.ModifyScopeVariableError

  def test_invalid_variables_type(self):
    for bad in ([1, 2], 'params', 3):
      with pytest.raises(errors.ApplyScopeInvalidVariablesTypeError) as info:
        apply(lambda s: 0)(bad)
      assert type(bad).__name__ in str(info.value)
    with pytest.raises(errors.ApplyScopeInvalidVariablesTypeError):
      bind(None)

  def test_invalid_variables_structure(self):
    params = {'kernel': jnp.zeros((3, 4)), 'bias': jnp.zeros(4)}
    with pytest.raises(errors.ApplyScopeInvalidVariablesStructureError) as info:
      apply(dense)({'params': {'params': params}}, jnp.ones((1, 3)), 4)
    assert 'extra params layer' in str(info.value)
    # Params passed without the collection level: a type error, as in Flax.
    with pytest.raises(errors.ApplyScopeInvalidVariablesTypeError) as info:
      apply(dense)(params, jnp.ones((1, 3)), 4)
    msg = str(info.value)
    assert "'kernel'" in msg and "'bias'" in msg
    # Non-string collection names (a type error, as in Flax).
    with pytest.raises(errors.ApplyScopeInvalidVariablesTypeError):
      apply(lambda s: 0)({1: {}})
    with pytest.raises(errors.ApplyScopeInvalidVariablesStructureError):
      bind({'params': {'params': {}}})

  def test_all_errors_are_liftmods_errors(self):
    for cls in (errors.ScopeParamShapeError, errors.ScopeParamNotFoundError,
                errors.ScopeCollectionNotFound,
                errors.ScopeVariableNotFoundError,
                errors.ModifyScopeVariableError, errors.NameInUseError,
                errors.InvalidRngError, errors.InvalidRngTypeError,
                errors.ApplyScopeInvalidVariablesTypeError,
                errors.ApplyScopeInvalidVariablesStructureError,
                errors.InvalidScopeError, errors.InvalidFilterError):
      assert issubclass(cls, errors.LiftmodsError)
    assert errors.FlaxError is errors.LiftmodsError

  def test_invalid_scope_message_names_scope(self):
    captured = {}

    def f(scope):
      captured['s'] = scope.push('kept').rewound()
      captured['s'].invalidate()

    apply(f)({})
    with pytest.raises(errors.InvalidScopeError) as info:
      captured['s'].push('x')
    assert '"kept"' in str(info.value)


def test_param_shape_check_follows_rebound_globals():
  """A user initializer reading a module global is re-keyed on the global's
  current value, so rebinding it is never served a stale shape."""
  import liftmods as nn
  namespace = {'jnp': jnp, 'WIDTH': 3}
  exec('def init(key, shape):\n  return jnp.zeros((WIDTH,))', namespace)
  init_fn = namespace['init']

  class M(nn.Module):

    @nn.compact
    def __call__(self):
      return self.param('w', init_fn, ())

  v3 = M().init(jax.random.key(0))
  M().apply(v3)
  namespace['WIDTH'] = 5
  v5 = M().init(jax.random.key(0))
  M().apply(v5)
  with pytest.raises(errors.ScopeParamShapeError, match=r'\(5,\).*\(3,\)'):
    M().apply(v3)
