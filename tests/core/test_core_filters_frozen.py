"""Tests of liftmods.core.filters, frozen_dict and meta."""
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from liftmods import errors
from liftmods.core import frozen_dict as fd_mod
from liftmods.core import meta
from liftmods.core.filters import (DenyList, filter_to_set, in_filter,
                                   intersect, is_empty, subtract, union)
from liftmods.core.frozen_dict import (FrozenDict, copy, freeze, pop,
                                       pretty_repr, unfreeze)

# -- filters ---------------------------------------------------------------

UNIVERSE = ('params', 'batch_stats', 'cache', 'intermediates')
# A name no generated filter mentions: open filters must match it.
OUTSIDE = 'zz_unmentioned'
ALL_NAMES = UNIVERSE + (OUTSIDE,)

names = st.sampled_from(UNIVERSE)
finite_filters = st.one_of(
    st.just(False),
    names,
    st.lists(names, max_size=4),
    st.lists(names, max_size=4).map(tuple),
    st.frozensets(names),
)
filters = st.one_of(
    st.just(True),
    finite_filters,
    finite_filters.map(DenyList),
)


def brute(f):
  """The set of names in ALL_NAMES that filter ``f`` selects."""
  return {n for n in ALL_NAMES if in_filter(f, n)}


class TestInFilter:

  def test_basic_forms(self):
    assert in_filter(True, 'x')
    assert not in_filter(False, 'x')
    assert in_filter('x', 'x') and not in_filter('x', 'y')
    assert in_filter(['a', 'x'], 'x') and not in_filter(['a'], 'x')
    assert in_filter(('x',), 'x')
    assert in_filter({'x'}, 'x')
    assert not in_filter([], 'x')
    assert not in_filter(DenyList('x'), 'x') and in_filter(DenyList('x'), 'y')
    assert not in_filter(DenyList(['x', 'y']), 'y')
    assert not in_filter(DenyList(True), 'x')
    assert in_filter(DenyList(False), 'x')
    assert in_filter(DenyList(DenyList('x')), 'x')
    assert not in_filter(DenyList(DenyList('x')), 'y')

  def test_string_is_not_substring_match(self):
    assert not in_filter('params', 'param')
    assert not in_filter('param', 'params')

  @pytest.mark.parametrize('bad', [3, None, 1.5, object()])
  def test_invalid_filter(self, bad):
    with pytest.raises(errors.InvalidFilterError) as info:
      in_filter(bad, 'params')
    assert repr(bad) in str(info.value)

  def test_invalid_filter_nested_in_denylist(self):
    with pytest.raises(errors.InvalidFilterError):
      in_filter(DenyList(7), 'params')

  def test_filter_to_set(self):
    assert filter_to_set(False) == set()
    assert filter_to_set('a') == {'a'}
    assert filter_to_set(['a', 'b', 'a']) == {'a', 'b'}
    with pytest.raises(ValueError):
      filter_to_set(True)
    with pytest.raises(ValueError):
      filter_to_set(DenyList('a'))
    with pytest.raises(errors.InvalidFilterError):
      filter_to_set(5)

  def test_denylist_is_hashable_and_compares_by_value(self):
    assert DenyList('a') == DenyList('a')
    assert DenyList('a') != DenyList('b')
    assert hash(DenyList('a')) == hash(DenyList('a'))
    with pytest.raises(Exception):
      DenyList('a').deny = 'b'


class TestFilterAlgebra:

  def test_examples(self):
    assert union(True, 'a') is True
    assert union('a', ['b']) == {'a', 'b'}
    assert union(False, 'a') == 'a'
    assert union(DenyList('a'), 'a') is True
    assert union(DenyList(['a', 'b']), 'a') == DenyList({'b'})
    assert union(DenyList(['a', 'b']), DenyList(['b', 'c'])) == DenyList({'b'})
    assert intersect(True, 'a') == 'a'
    assert intersect(['a', 'b'], ['b', 'c']) == {'b'}
    assert intersect(DenyList('a'), ['a', 'b']) == {'b'}
    assert intersect(DenyList('a'), DenyList('b')) == DenyList({'a', 'b'})
    assert intersect(False, True) is False
    assert subtract(True, 'a') == DenyList('a')
    assert subtract(['a', 'b'], 'a') == {'b'}
    assert subtract(['a', 'b'], DenyList('a')) == {'a'}
    assert subtract(DenyList('a'), 'b') == DenyList({'a', 'b'})
    assert subtract('a', True) is False
    assert subtract(DenyList('a'), DenyList(['a', 'b'])) == {'b'}

  def test_is_empty_examples(self):
    assert is_empty(False)
    assert is_empty([])
    assert is_empty(())
    assert not is_empty('a')
    assert not is_empty(['a'])
    assert not is_empty(True)
    assert not is_empty(DenyList('a'))
    with pytest.raises(errors.InvalidFilterError):
      is_empty(4)

  @settings(max_examples=200, deadline=None)
  @given(filters, filters)
  def test_union_matches_brute_force(self, a, b):
    assert brute(union(a, b)) == brute(a) | brute(b)

  @settings(max_examples=200, deadline=None)
  @given(filters, filters)
  def test_intersect_matches_brute_force(self, a, b):
    assert brute(intersect(a, b)) == brute(a) & brute(b)

  @settings(max_examples=200, deadline=None)
  @given(filters, filters)
  def test_subtract_matches_brute_force(self, a, b):
    assert brute(subtract(a, b)) == brute(a) - brute(b)

  @settings(max_examples=100, deadline=None)
  @given(filters, filters, filters)
  def test_algebra_composes(self, a, b, c):
    # Results of the algebra are themselves valid filters for further ops.
    left = subtract(union(a, b), intersect(b, c))
    assert brute(left) == (brute(a) | brute(b)) - (brute(b) & brute(c))

  @settings(max_examples=200, deadline=None)
  @given(filters)
  def test_is_empty_matches_brute_force(self, f):
    # The universe includes a name no filter mentions, so an open filter
    # (True or a DenyList of finite names) always matches something here.
    assert is_empty(f) == (not brute(f))

  @settings(max_examples=100, deadline=None)
  @given(filters, filters)
  def test_results_are_open_only_when_needed(self, a, b):
    # A result is closed (finite) iff the brute-force set excludes OUTSIDE.
    for result in (union(a, b), intersect(a, b), subtract(a, b)):
      is_open = result is True or isinstance(result, DenyList)
      assert is_open == in_filter(result, OUTSIDE)


# -- FrozenDict ----------------------------------------------------------------


class TestFrozenDict:

  def test_mapping_interface(self):
    fd = FrozenDict({'a': 1, 'b': {'c': 2}})
    assert fd['a'] == 1
    assert len(fd) == 2
    assert 'a' in fd and 'z' not in fd
    assert list(fd) == ['a', 'b']
    assert fd.get('z', 9) == 9
    assert isinstance(fd['b'], FrozenDict)
    assert fd['b']['c'] == 2
    assert FrozenDict(a=1) == FrozenDict({'a': 1})
    assert FrozenDict() == {}

  def test_immutable(self):
    fd = freeze({'a': {'b': 1}})
    with pytest.raises(ValueError):
      fd['a'] = 2
    with pytest.raises(ValueError):
      fd['a']['b'] = 2
    with pytest.raises((TypeError, AttributeError)):
      del fd['a']
    with pytest.raises(AttributeError):
      fd.update({'x': 1})
    assert fd == {'a': {'b': 1}}

  def test_constructor_copies_input(self):
    raw = {'a': {'b': 1}}
    fd = FrozenDict(raw)
    raw['a']['b'] = 99
    raw['z'] = 0
    assert fd == {'a': {'b': 1}}

  def test_equality_and_hash(self):
    a = freeze({'x': 1, 'y': {'z': 2}})
    b = freeze({'y': {'z': 2}, 'x': 1})
    assert a == b
    assert hash(a) == hash(b)
    assert a == {'x': 1, 'y': {'z': 2}}
    assert {'x': 1, 'y': {'z': 2}} == a
    assert a != freeze({'x': 1, 'y': {'z': 3}})
    assert a != [('x', 1)]
    assert len({a, b}) == 1
    with pytest.raises(TypeError):
      hash(freeze({'w': [1, 2]}))

  def test_freeze_unfreeze_roundtrip(self):
    raw = {'params': {'dense': {'w': np.ones(2)}}, 'n': 3}
    fd = freeze(raw)
    assert isinstance(fd['params']['dense'], FrozenDict)
    back = unfreeze(fd)
    assert type(back) is dict
    assert type(back['params']) is dict
    assert type(back['params']['dense']) is dict
    assert back['params']['dense']['w'] is raw['params']['dense']['w']
    assert fd.unfreeze() == back
    # unfreeze of a plain dict is a deep (container) copy.
    copied = unfreeze(raw)
    copied['params']['dense']['extra'] = 1
    assert 'extra' not in raw['params']['dense']
    assert unfreeze(5) == 5

  def test_copy_does_not_mutate(self):
    fd = freeze({'a': 1, 'b': 2})
    new = copy(fd, {'b': 3, 'c': {'d': 4}})
    assert isinstance(new, FrozenDict)
    assert new == {'a': 1, 'b': 3, 'c': {'d': 4}}
    assert isinstance(new['c'], FrozenDict)
    assert fd == {'a': 1, 'b': 2}
    assert fd.copy() == fd and fd.copy() is not fd
    assert (fd | {'z': 0}) == {'a': 1, 'b': 2, 'z': 0}

  def test_copy_plain_dict(self):
    raw = {'a': 1}
    new = copy(raw, {'b': 2})
    assert type(new) is dict
    assert new == {'a': 1, 'b': 2}
    assert raw == {'a': 1}
    assert copy(raw) is not raw
    with pytest.raises(TypeError):
      copy([('a', 1)])

  def test_pop_does_not_mutate(self):
    fd = freeze({'a': 1, 'b': {'c': 2}})
    rest, value = pop(fd, 'b')
    assert isinstance(rest, FrozenDict)
    assert rest == {'a': 1}
    assert value == {'c': 2} and isinstance(value, FrozenDict)
    assert fd == {'a': 1, 'b': {'c': 2}}
    with pytest.raises(KeyError):
      pop(fd, 'missing')

  def test_pop_plain_dict(self):
    raw = {'a': 1, 'b': 2}
    rest, value = pop(raw, 'a')
    assert type(rest) is dict
    assert (rest, value) == ({'b': 2}, 1)
    assert raw == {'a': 1, 'b': 2}
    with pytest.raises(KeyError):
      pop(raw, 'zz')
    with pytest.raises(TypeError):
      pop([1], 0)

  def test_pretty_repr(self):
    fd = freeze({'a': 1, 'b': {'c': 2}, 'e': {}})
    expected = ('FrozenDict({\n'
                '    a: 1,\n'
                '    b: {\n'
                '        c: 2,\n'
                '    },\n'
                '    e: {},\n'
                '})')
    assert pretty_repr(fd) == expected
    assert repr(fd) == expected
    assert fd.pretty_repr() == expected
    assert pretty_repr({'a': 1}, num_spaces=2) == '{\n  a: 1,\n}'
    assert pretty_repr({}) == '{}'
    assert pretty_repr(FrozenDict()) == 'FrozenDict({})'
    assert pretty_repr(3) == '3'

  def test_pytree_flatten_unflatten(self):
    fd = freeze({'b': 2.0, 'a': {'y': 1.0, 'x': 3.0}})
    leaves, treedef = jax.tree_util.tree_flatten(fd)
    assert leaves == [3.0, 1.0, 2.0]  # sorted keys, depth first
    rebuilt = jax.tree_util.tree_unflatten(treedef, [10.0, 20.0, 30.0])
    assert isinstance(rebuilt, FrozenDict)
    assert isinstance(rebuilt['a'], FrozenDict)
    assert rebuilt == {'a': {'x': 10.0, 'y': 20.0}, 'b': 30.0}
    doubled = jax.tree_util.tree_map(lambda v: v * 2, fd)
    assert isinstance(doubled, FrozenDict)
    assert doubled == {'a': {'x': 6.0, 'y': 2.0}, 'b': 4.0}

  def test_pytree_key_paths(self):
    fd = freeze({'b': 2, 'a': {'c': 1}})
    flat, _ = jax.tree_util.tree_flatten_with_path(fd)
    paths = [(tuple(k.key for k in path), leaf) for path, leaf in flat]
    assert paths == [(('a', 'c'), 1), (('b',), 2)]
    for path, _ in flat:
      assert all(isinstance(k, jax.tree_util.DictKey) for k in path)
    assert jax.tree_util.keystr(flat[0][0]) == "['a']['c']"

  def test_pytree_through_jit(self):
    fd = freeze({'w': jnp.ones(2), 'b': {'c': jnp.zeros(1)}})
    out = jax.jit(lambda t: jax.tree_util.tree_map(lambda v: v + 1, t))(fd)
    assert isinstance(out, FrozenDict)
    np.testing.assert_array_equal(out['w'], [2.0, 2.0])
    np.testing.assert_array_equal(out['b']['c'], [1.0])

  def test_pickle(self):
    fd = freeze({'a': {'b': 1}, 'c': 'x'})
    back = pickle.loads(pickle.dumps(fd))
    assert isinstance(back, FrozenDict)
    assert isinstance(back['a'], FrozenDict)
    assert back == fd

  def test_module_exports(self):
    assert fd_mod.FrozenDict is FrozenDict


# -- meta ------------------------------------------------------------------


class TestMeta:

  def test_partitioned_unbox_without_mesh(self):
    value = jnp.arange(6.0).reshape(2, 3)
    box = meta.Partitioned(value, ('a', 'b'))
    assert box.unbox() is value
    assert box.unbox(apply_constraint=False) is value
    assert meta.is_axis_metadata(box)
    assert not meta.is_axis_metadata(value)

  def test_partitioned_is_pytree_with_static_names(self):
    box = meta.Partitioned(jnp.ones(3), ('x',))
    leaves, treedef = jax.tree_util.tree_flatten(box)
    assert len(leaves) == 1
    new = jax.tree_util.tree_unflatten(treedef, [jnp.zeros(3)])
    assert isinstance(new, meta.Partitioned) and new.names == ('x',)
    doubled = jax.tree_util.tree_map(lambda v: v * 2, box)
    np.testing.assert_array_equal(doubled.value, [2.0, 2.0, 2.0])
    assert doubled.names == ('x',)
    # names are static: boxes with different names have different treedefs.
    other = meta.Partitioned(jnp.ones(3), ('y',))
    assert jax.tree_util.tree_structure(other) != treedef

  def test_add_axis(self):
    box = meta.Partitioned(jnp.ones((2, 3)), ('a', 'b'))
    params = {meta.PARTITION_NAME: 'layers'}
    assert box.add_axis(0, params).names == ('layers', 'a', 'b')
    assert box.add_axis(1, params).names == ('a', 'layers', 'b')
    assert box.add_axis(2, params).names == ('a', 'b', 'layers')
    # Beyond the known names: padded with None.
    assert box.add_axis(4, params).names == ('a', 'b', None, None, 'layers')
    assert box.add_axis(0, {meta.PARTITION_NAME: None}).names == (None, 'a',
                                                                  'b')
    assert box.names == ('a', 'b')  # original untouched

  def test_add_axis_without_partition_name(self):
    box = meta.Partitioned(jnp.ones(2), ('a',))
    with pytest.raises(errors.LiftError) as info:
      box.add_axis(0, {})
    assert meta.PARTITION_NAME in str(info.value)

  def test_remove_axis_inverts_add_axis(self):
    box = meta.Partitioned(jnp.ones((2, 3)), ('a', 'b'))
    params = {meta.PARTITION_NAME: 'layers'}
    for i in range(3):
      back = box.add_axis(i, params).remove_axis(i, params)
      # Field by field: a dataclass __eq__ on Python 3.13 compares the
      # arrays with ==, whose truth value is ambiguous (as in Linen).
      assert back.value is box.value and back.names == box.names
      assert back.mesh == box.mesh
    # Linen checks the removed axis's name (an AssertionError there).
    with pytest.raises(AssertionError, match="named 'a'.*expects 'layers'"):
      box.remove_axis(0, params)

  def test_tree_add_remove_axis(self):
    tree = {'w': meta.Partitioned(jnp.ones((2, 3)), ('a', 'b')),
            'plain': jnp.ones(2)}
    params = {meta.PARTITION_NAME: 'L'}
    added = meta.add_axis(tree, 0, params)
    assert added['w'].names == ('L', 'a', 'b')
    assert added['plain'] is tree['plain']
    removed = meta.remove_axis(added, 0, params)
    assert removed['w'].names == ('a', 'b')

  def test_with_partitioning(self):
    init_fn = meta.with_partitioning(jax.nn.initializers.ones, ('in', 'out'))
    box = init_fn(jax.random.key(0), (2, 3))
    assert isinstance(box, meta.Partitioned)
    assert box.names == ('in', 'out')
    assert box.mesh is None
    np.testing.assert_array_equal(box.value, np.ones((2, 3)))
    # names given as a list become a tuple (hashable, static).
    box2 = meta.with_partitioning(jax.nn.initializers.zeros, ['x', None])(
        jax.random.key(0), (2, 2))
    assert box2.names == ('x', None)

  def test_get_partition_spec(self):
    P = jax.sharding.PartitionSpec
    tree = {'w': meta.Partitioned(jnp.ones((2, 3)), ('a', None)),
            'b': jnp.ones(3)}
    specs = meta.get_partition_spec(tree)
    assert specs == {'w': P('a', None), 'b': P()}
    assert tree['w'].get_partition_spec() == P('a', None)

  def test_partitioned_with_mesh_unboxes_with_sharding(self):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
    box = meta.Partitioned(jnp.ones((2, 3)), ('data', None), mesh=mesh)
    out = box.unbox()
    np.testing.assert_array_equal(out, np.ones((2, 3)))
    assert isinstance(out.sharding, jax.sharding.NamedSharding)
    assert out.sharding.spec == jax.sharding.PartitionSpec('data', None)
    sharding = meta.get_sharding({'w': box, 'p': jnp.ones(1)}, mesh)
    assert sharding['w'].spec == jax.sharding.PartitionSpec('data', None)
    assert sharding['p'].spec == jax.sharding.PartitionSpec()

  def test_unbox_tree(self):
    tree = {'a': meta.Partitioned(jnp.zeros(2), ('x',)),
            'b': {'c': meta.Partitioned(jnp.ones(3), (None,))},
            'd': jnp.full(1, 5.0)}
    out = meta.unbox(tree)
    assert not any(isinstance(x, meta.AxisMetadata) for x in
                   jax.tree_util.tree_leaves(out, is_leaf=meta.is_axis_metadata))
    np.testing.assert_array_equal(out['b']['c'], np.ones(3))
    assert out['d'] is tree['d']
    assert meta.unbox(jnp.ones(1)).shape == (1,)

  def test_unbox_nested_boxes(self):
    inner = meta.Partitioned(jnp.zeros(2), ('a',))
    out = meta.unbox({'w': meta.Partitioned(inner, ('b',))})
    assert not isinstance(out['w'], meta.AxisMetadata)
    np.testing.assert_array_equal(out['w'], np.zeros(2))

  def test_replace_boxed_tree(self):
    tree = {'a': meta.Partitioned(jnp.zeros(2), ('x',)), 'b': jnp.zeros(1)}
    updates = {'a': jnp.ones(2), 'b': jnp.ones(1)}
    out = meta.replace_boxed(tree, updates)
    assert isinstance(out['a'], meta.Partitioned)
    assert out['a'].names == ('x',)
    np.testing.assert_array_equal(out['a'].value, np.ones(2))
    assert not isinstance(out['b'], meta.Partitioned)
    assert out['b'] is updates['b']
    assert isinstance(tree['a'], meta.Partitioned)
    np.testing.assert_array_equal(tree['a'].value, np.zeros(2))

  def test_custom_axis_metadata_subclass(self):
    calls = []

    class Tagged(meta.AxisMetadata):

      def __init__(self, value):
        self.value = value

      def unbox(self):
        return self.value

      def replace_boxed(self, val):
        return Tagged(val)

      def add_axis(self, index, params):
        calls.append(('add', index))
        return self

      def remove_axis(self, index, params):
        calls.append(('remove', index))
        return self

    jax.tree_util.register_pytree_node(
        Tagged, lambda t: ((t.value,), None), lambda _, c: Tagged(c[0]))
    tree = {'t': Tagged(1), 'p': 2}
    assert meta.unbox(tree) == {'t': 1, 'p': 2}
    meta.add_axis(tree, 3, {})
    meta.remove_axis(tree, 1, {})
    assert calls == [('add', 3), ('remove', 1)]
    out = meta.replace_boxed(tree, {'t': 10, 'p': 20})
    assert isinstance(out['t'], Tagged) and out['t'].value == 10

  def test_axis_metadata_is_abstract(self):
    with pytest.raises(TypeError):
      meta.AxisMetadata()
