"""Linen's partitioning APIs on one device, differential against flax.linen:
logical axis rules, LogicallyPartitioned, the older ``nn.partitioning``
helpers, boxes through lifted transforms, and the fixes for their known gaps.
(Multi-device behaviour is in test_spmd_mesh.py.)"""
import threading

import flax
import flax.core.meta as flax_meta
import flax.linen as fnn
import flax.linen.partitioning as fnn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import liftmods as nn
from liftmods import errors
from liftmods import partitioning as nn_partitioning
from liftmods.core import meta

KEY = jax.random.key(0)


def auto_mesh(shape=(1, 1), names=('data', 'model')):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def same_tree(a, b):
  la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
  lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
  assert len(la) == len(lb), (a, b)
  for x, y in zip(la, lb):
    if hasattr(x, 'shape') and not isinstance(x, P):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    else:
      assert x == y, (a, b)


# -- logical_to_mesh_axes -----------------------------------------------------

RULE_SETS = [
    (),
    (('batch', 'data'), ('embed', 'model')),
    (('batch', 'data'), ('embed', 'data'), ('mlp', 'model')),
    (('batch', ('data', 'model')), ('mlp', 'model')),
    (('batch', None), ('batch', 'data'), ('heads', 'model')),
    (('embed', 'model'), ('mlp', 'model'), ('mlp', 'data')),
    (('heads', ('data', 'model')), ('embed', 'data'), ('kv', None)),
]
NAMES = [
    ('batch', 'embed'), ('embed', 'mlp'), ('batch', 'mlp'), ('mlp', 'embed'),
    (None, 'mlp'), ('heads', 'kv', 'embed'), ('batch', None, 'heads'),
    ('unknown', 'mlp'), (), ('batch', P.UNCONSTRAINED, 'mlp'),
]


@pytest.mark.parametrize('rules', RULE_SETS)
def test_logical_to_mesh_axes_matches_linen(rules):
  for names in NAMES:
    assert nn.logical_to_mesh_axes(names, rules) == fnn.logical_to_mesh_axes(
        names, rules), (names, rules)
    with nn.logical_axis_rules(rules), fnn.logical_axis_rules(rules):
      assert nn.logical_to_mesh_axes(names) == fnn.logical_to_mesh_axes(names)
  assert nn.logical_to_mesh_axes(None, rules) is None


_LOGICAL = st.sampled_from(['batch', 'embed', 'mlp', 'heads', 'kv', None])
_MESH = st.one_of(st.none(), st.sampled_from(['data', 'model', 'fsdp']),
                  st.lists(st.sampled_from(['data', 'model', 'fsdp']),
                           min_size=1, max_size=2).map(tuple))


@settings(max_examples=60, deadline=None)
@given(names=st.lists(_LOGICAL, max_size=4),
       rules=st.lists(st.tuples(_LOGICAL.filter(bool), _MESH), max_size=6))
def test_logical_to_mesh_axes_matches_linen_on_random_rules(names, rules):
  names, rules = tuple(names), tuple(rules)
  try:
    expected = fnn.logical_to_mesh_axes(names, rules)
  except ValueError as e:
    with pytest.raises(ValueError, match='occur more than once'):
      nn.logical_to_mesh_axes(names, rules)
    assert 'occur more than once' in str(e)
    return
  assert nn.logical_to_mesh_axes(names, rules) == expected


def test_logical_to_mesh_axes_errors_match_linen():
  for names, rules in [(('a', 'a'), ()), (('a',), 'a:x')]:
    with pytest.raises(ValueError) as ours:
      nn.logical_to_mesh_axes(names, rules)
    with pytest.raises(ValueError) as theirs:
      fnn.logical_to_mesh_axes(names, rules)
    assert str(ours.value) == str(theirs.value)


def test_logical_to_mesh_and_sharding_trees_match_linen():
  rules = RULE_SETS[2]
  tree = {'a': P('batch', 'embed'), 'b': {'c': P('mlp'), 'd': None}}
  assert nn.logical_to_mesh(tree, rules) == fnn.logical_to_mesh(tree, rules)
  mesh = auto_mesh()
  assert (nn.logical_to_mesh_sharding(tree, mesh, rules) ==
          fnn.logical_to_mesh_sharding(tree, mesh, rules))


def test_rules_context_nests_restores_and_is_per_thread():
  assert nn.get_logical_axis_rules() == ()
  outer, inner = (('a', 'x'),), (('b', 'y'),)
  with nn.logical_axis_rules(outer):
    with pytest.raises(RuntimeError):
      with nn.logical_axis_rules(inner):
        assert nn.get_logical_axis_rules() == inner
        raise RuntimeError
    assert nn.get_logical_axis_rules() == outer
    seen = []
    t = threading.Thread(target=lambda: seen.append(nn.get_logical_axis_rules()))
    t.start()
    t.join()
    assert seen == [()]
  nn.set_logical_axis_rules(inner)
  try:
    assert nn.spmd.get_logical_axis_rules() == inner
    assert nn.partitioning.get_axis_rules() == inner
  finally:
    nn.set_logical_axis_rules(())


# -- with_logical_constraint ---------------------------------------------------


def _lowered(lib, fallback=None, rules=RULE_SETS[2]):
  kw = {} if fallback is None else {'fallback': fallback}

  def f(x):
    return lib.with_logical_constraint(x * 2, ('batch', 'mlp'), rules=rules,
                                       **kw)

  with jax.set_mesh(auto_mesh()):
    return jax.jit(f).lower(jnp.ones((2, 4))).as_text()


@pytest.mark.parametrize('fallback', [None, 'AXIS_IS_UNSHARDED',
                                      'NO_CONSTRAINT'])
def test_with_logical_constraint_lowers_like_linen(fallback):
  ours = _lowered(nn, fallback and getattr(nn.spmd.RulesFallback, fallback))
  theirs = _lowered(fnn, fallback and getattr(fnn.spmd.RulesFallback,
                                              fallback))
  assert ours.count('sharding') == theirs.count('sharding')
  assert ours.replace('liftmods', '') == theirs.replace('flax', '')


def test_with_logical_constraint_fallbacks():
  rules = (('batch', 'data'),)  # 'mlp' is unmapped
  x = jnp.ones((2, 4))
  with pytest.raises(ValueError, match=r"did not match a rule"):
    with jax.set_mesh(auto_mesh()):
      nn.with_logical_constraint(x, ('batch', 'mlp'), rules=rules,
                                 fallback=nn.spmd.RulesFallback.RAISE_ERROR)
  no = _lowered(nn, nn.spmd.RulesFallback.NO_CONSTRAINT, rules)
  assert 'sharding_constraint' not in no and 'Sharding' not in no
  # Without rules, or without a mesh, nothing is constrained.
  assert nn.with_logical_constraint(x, ('batch', 'mlp'), rules=()) is x
  assert nn.with_logical_constraint(x, ('batch', 'mlp'), rules=rules) is x


def test_with_logical_constraint_on_a_pytree():
  rules = RULE_SETS[1]
  xs = {'a': jnp.ones((2, 4)), 'b': jnp.ones(3)}
  specs = {'a': ('batch', 'embed'), 'b': None}

  def lower(lib):
    with jax.set_mesh(auto_mesh()):
      return jax.jit(lambda t: lib.with_logical_constraint(
          t, specs, rules=rules)).lower(xs).as_text()

  assert lower(nn).count('sharding') == lower(fnn).count('sharding') > 0


# -- boxes -------------------------------------------------------------------------


class Block:
  """The same model written against either library."""

  @staticmethod
  def make(lib):

    class MLP(lib.Module):

      @lib.compact
      def __call__(self, x):
        h = lib.Dense(8, kernel_init=lib.with_logical_partitioning(
            lib.initializers.lecun_normal(), ('embed', 'mlp')),
                      bias_init=lib.with_logical_partitioning(
                          lib.initializers.zeros_init(), ('mlp',)))(x)
        h = lib.with_logical_constraint(lib.relu(h), ('batch', 'mlp'))
        return lib.Dense(x.shape[-1], kernel_init=lib.with_partitioning(
            lib.initializers.lecun_normal(), ('model', None)))(h)

    return MLP


def test_logically_partitioned_init_matches_linen():
  x = jnp.ones((2, 4))
  ours = Block.make(nn)().init(KEY, x)
  theirs = Block.make(fnn)().init(KEY, x)
  box = ours['params']['Dense_0']['kernel']
  assert type(box) is nn.LogicallyPartitioned
  assert box.names == ('embed', 'mlp') and box.rules is None
  same_tree(nn.get_partition_spec(ours), fnn.get_partition_spec(theirs))
  same_tree(nn.unbox(ours), fnn.unbox(theirs))
  rules = RULE_SETS[2]
  mesh = auto_mesh()
  assert (nn.logical_to_mesh_sharding(nn.get_partition_spec(ours), mesh, rules)
          == fnn.logical_to_mesh_sharding(fnn.get_partition_spec(theirs), mesh,
                                          rules))


def test_box_rules_and_mesh_fields():
  mesh = auto_mesh()
  init = nn.with_logical_partitioning(jnp.ones, ('embed', 'mlp'), mesh=mesh,
                                      rules=(('mlp', 'model'),))
  box = init((2, 4))
  assert box.mesh is mesh and box.rules == (('mlp', 'model'),)
  lowered = jax.jit(lambda b: b.unbox()).lower(box).as_text()
  assert 'sharding' in lowered  # the box's own mesh and rules apply
  assert jax.jit(lambda b: b.unbox(apply_constraint=False)).lower(
      box).as_text().count('sharding_constraint') == 0


def test_nnx_metadata_round_trip_matches_linen():
  v = jnp.ones((2, 3))
  ours = nn.Partitioned(v, ('a', None)).to_nnx_metadata()
  theirs = fnn.Partitioned(v, ('a', None)).to_nnx_metadata()
  assert sorted(ours) == sorted(theirs) == ['mesh', 'out_sharding', 'value']
  assert ours['out_sharding'] == theirs['out_sharding']
  back = nn.Partitioned.from_nnx_metadata({**ours, 'extra': 1})
  assert back.names == ('a', None) and back.value is v
  ours = nn.LogicallyPartitioned(v, ('a', 'b'), rules=(('a', 'x'),))
  theirs = fnn.LogicallyPartitioned(v, ('a', 'b'), rules=(('a', 'x'),))
  md, fmd = ours.to_nnx_metadata(), theirs.to_nnx_metadata()
  assert sorted(md) == sorted(fmd) == ['mesh', 'out_sharding',
                                       'sharding_rules', 'value']
  assert ours.names == ('a', 'b')  # not consumed by to_nnx_metadata
  back = nn.LogicallyPartitioned.from_nnx_metadata(md)
  assert back.rules == (('a', 'x'),) and back.names == ('a', 'b')


def test_partition_spec_and_sharding_of_non_array_leaves_match_linen():
  mesh = auto_mesh()
  tree = {'n': 3, 's': 'text', 'x': jnp.ones(2),
          'w': nn.Partitioned(jnp.ones((2, 2)), ('data', None))}
  ftree = {**tree, 'w': fnn.Partitioned(jnp.ones((2, 2)), ('data', None))}
  assert nn.get_partition_spec(tree) == fnn.get_partition_spec(ftree)
  assert nn.get_partition_spec(tree)['n'] is None
  assert nn.get_sharding(tree, mesh) == fnn.get_sharding(ftree, mesh)
  assert nn.get_sharding(tree, mesh)['s'] is None


def test_remove_axis_checks_the_partition_name_like_linen():
  params = {nn.PARTITION_NAME: 'layers'}
  for lib, err in ((nn, errors.PartitionAxisMismatchError),
                   (fnn, AssertionError)):
    box = lib.Partitioned(jnp.ones((2, 3)), ('a', 'b'))
    with pytest.raises(AssertionError):
      box.remove_axis(0, params)
    assert lib.meta.remove_axis(lib.meta.add_axis(box, 0, params), 0,
                                params).names == ('a', 'b')
    with pytest.raises(err):
      lib.meta.remove_axis({'w': box}, 1, {nn.PARTITION_NAME: 'x'})


def test_global_mesh_helpers_match_linen():
  assert meta.get_global_mesh() is None and not meta.global_mesh_defined()
  mesh = auto_mesh()
  with jax.set_mesh(mesh):
    assert meta.global_mesh_defined() and flax_meta.global_mesh_defined()
    assert meta.get_global_mesh() == flax_meta.get_global_mesh()
    assert meta.get_global_mesh().axis_names == ('data', 'model')


def test_box_classes_are_distinct_pytree_types():
  v = jnp.ones(2)
  ours, theirs = nn.Partitioned(v, ('a',)), fnn.Partitioned(v, ('a',))
  assert jax.tree.structure(ours) != jax.tree.structure(theirs)
  assert (jax.tree.structure(nn.LogicallyPartitioned(v, ('a',))) !=
          jax.tree.structure(fnn.LogicallyPartitioned(v, ('a',))))
  identity = jax.jit(lambda b: b)
  assert type(identity(theirs)) is fnn.Partitioned
  assert type(identity(ours)) is nn.Partitioned  # not a cache hit on theirs
  path, _ = jax.tree_util.tree_flatten_with_path(ours)
  assert path[0][0] == (jax.tree_util.GetAttrKey('value'),)


def test_partitioned_subclasses_are_pytrees_by_themselves():

  class Tagged(nn.Partitioned):
    tag: str = nn.meta.dataclasses.field(default='t',
                                         metadata=dict(static=True))

  box = Tagged(jnp.ones(2), ('a',), tag='x')
  doubled = jax.tree.map(lambda x: x * 2, box)
  assert type(doubled) is Tagged and doubled.tag == 'x'
  np.testing.assert_array_equal(doubled.value, 2 * np.ones(2))
  assert nn.meta.add_axis(box, 0, {nn.PARTITION_NAME: 'L'}).names == ('L', 'a')


# -- apply with stored (unboxed) parameters inside a mesh context --------------


@pytest.mark.parametrize('lib', [nn, fnn], ids=['liftmods', 'linen'])
def test_apply_with_unboxed_params_in_mesh_context(lib):
  model = Block.make(lib)()
  x = jnp.ones((2, 4))
  params = lib.unbox(model.init(KEY, x))
  mesh = auto_mesh()
  with jax.set_mesh(mesh), lib.logical_axis_rules(RULE_SETS[2]):
    y = model.apply(params, x)  # eager: the shape check adds no constraint
    text = jax.jit(model.apply).lower(params, x).as_text()
  # Only the activation constraint remains: reading stored parameters adds
  # nothing to the program.
  assert text.count('sharding_constraint') == 1, text
  np.testing.assert_allclose(y, model.apply(params, x), rtol=1e-6)


def test_apply_in_mesh_context_matches_linen():
  x = jnp.ones((2, 4))
  params = nn.unbox(Block.make(nn)().init(KEY, x))
  with jax.set_mesh(auto_mesh()), nn.logical_axis_rules(RULE_SETS[2]), \
      fnn.logical_axis_rules(RULE_SETS[2]):
    ours = Block.make(nn)().apply(params, x)
    theirs = Block.make(fnn)().apply(params, x)
  np.testing.assert_array_equal(ours, theirs)


# -- boxes through lifted transforms ------------------------------------------


def scanned(lib, partition_name='layers', logical=True):
  wrap = lib.with_logical_partitioning if logical else lib.with_partitioning

  class Layer(lib.Module):

    @lib.compact
    def __call__(self, x, _):
      k = self.param('k', wrap(lib.initializers.lecun_normal(),
                               ('embed', 'mlp')), (4, 4))
      return x @ k, None

  class Stack(lib.Module):

    @lib.compact
    def __call__(self, x):
      md = {} if partition_name is None else {
          lib.PARTITION_NAME: partition_name}
      return lib.scan(Layer, variable_axes={'params': 0},
                      split_rngs={'params': True}, length=3,
                      metadata_params=md)()(x, None)[0]

  return Stack()


@pytest.mark.parametrize('logical', [True, False])
def test_scan_adds_the_partition_name_like_linen(logical):
  x = jnp.ones((2, 4))
  ours = scanned(nn, logical=logical).init(KEY, x)
  theirs = scanned(fnn, logical=logical).init(KEY, x)
  same_tree(nn.get_partition_spec(ours), fnn.get_partition_spec(theirs))
  assert nn.get_partition_spec(ours)['params']['ScanLayer_0']['k'] == P(
      'layers', 'embed', 'mlp')
  same_tree(nn.unbox(ours), fnn.unbox(theirs))
  y = scanned(nn, logical=logical).apply(ours, x)
  np.testing.assert_array_equal(y, scanned(fnn, logical=logical).apply(
      theirs, x))


def test_scan_without_partition_name_raises_like_linen():
  x = jnp.ones((2, 4))
  with pytest.raises(flax.errors.PartitioningUnspecifiedError):
    scanned(fnn, None).init(KEY, x)
  with pytest.raises(errors.PartitioningUnspecifiedError):
    scanned(nn, None).init(KEY, x)


def test_vmap_and_add_metadata_axis_match_linen():

  def model(lib):

    class Inner(lib.Module):

      @lib.compact
      def __call__(self, x):
        return lib.Dense(3, kernel_init=lib.with_logical_partitioning(
            lib.initializers.ones, ('embed', 'mlp')))(x)

    class Outer(lib.Module):

      @lib.compact
      def __call__(self, x):
        v = lib.vmap(Inner, variable_axes={'params': 1},
                     split_rngs={'params': True}, in_axes=0,
                     metadata_params={lib.PARTITION_NAME: 'batch'})
        a = lib.add_metadata_axis(Inner, variable_axes={'params': 0},
                                  metadata_params={lib.PARTITION_NAME: None})
        return v(name='v')(x), a(name='a')(x[0])

    return Outer()

  x = jnp.ones((2, 3, 4))
  ours, theirs = model(nn).init(KEY, x), model(fnn).init(KEY, x)
  same_tree(nn.get_partition_spec(ours), fnn.get_partition_spec(theirs))
  assert nn.get_partition_spec(ours)['params']['v']['Dense_0']['kernel'] == P(
      'embed', 'batch', 'mlp')
  assert nn.get_partition_spec(ours)['params']['a']['Dense_0']['kernel'] == P(
      None, 'embed', 'mlp')


# -- the older partitioning API ---------------------------------------------------


def t5x_model(lib, part):

  class Layer(lib.Module):

    @lib.compact
    def __call__(self, x, _):
      w = part.param_with_axes('w', lib.initializers.lecun_normal(), (4, 4),
                               axes=('embed', 'mlp'))
      s = part.variable_with_axes('stats', 'count', jnp.zeros, (4,),
                                  axes=('mlp',))
      s.value = s.value + 1
      return x @ w, None

  class Model(lib.Module):

    @lib.compact
    def __call__(self, x):
      b = part.param_with_axes('b', lib.initializers.ones, (4,),
                               axes=('embed',))
      stack = part.scan_with_axes(
          Layer, variable_axes={'params': 0, 'stats': 0},
          split_rngs={'params': True}, length=2,
          axes_collections=('params', 'stats'))
      y, _ = stack(name='stack')(x + b, None)
      v = part.vmap_with_axes(
          lib.Dense, variable_axes={'params': 0}, split_rngs={'params': True},
          partitioning_axis_names={'params': 'ensemble'})
      return v(3, name='ens')(jnp.stack([y, y]))

  return Model()


def test_params_axes_trees_match_linen():
  x = jnp.ones((2, 4))
  ours = t5x_model(nn, nn_partitioning).init(KEY, x)
  theirs = t5x_model(fnn, fnn_partitioning).init(KEY, x)
  assert set(ours) == set(theirs) == {'params', 'params_axes', 'stats',
                                      'stats_axes'}
  for col in ('params_axes', 'stats_axes'):
    assert (nn.unfreeze(nn_partitioning.get_axis_names(ours[col])) ==
            flax.core.unfreeze(fnn_partitioning.get_axis_names(theirs[col])))
  axes = nn_partitioning.get_axis_names(ours['params_axes'])
  assert axes['stack']['w'] == P('layers', 'embed', 'mlp')
  assert axes['b'] == P('embed')
  same_tree(ours['params'], theirs['params'])
  same_tree(ours['stats'], theirs['stats'])
  out, upd = t5x_model(nn, nn_partitioning).apply(ours, x, mutable=['stats'])
  fout, fupd = t5x_model(fnn, fnn_partitioning).apply(theirs, x,
                                                      mutable=['stats'])
  np.testing.assert_array_equal(out, fout)
  same_tree(upd, fupd)


def test_partitioning_aliases_and_errors():
  assert nn.partitioning.axis_rules is nn.logical_axis_rules
  assert nn.partitioning.with_sharding_constraint is nn.with_logical_constraint

  class Twice(nn.Module):

    @nn.compact
    def __call__(self):
      nn_partitioning.param_with_axes('w', nn.initializers.ones, (2,),
                                      axes=('a',))
      self.sow('params_axes', 'w_axes', nn_partitioning.AxisMetadata(('b',)),
               reduce_fn=nn_partitioning._merge_axes)

  with pytest.raises(ValueError, match='expected them to match'):
    Twice().init(KEY)

  class Missing(nn.Module):

    @nn.compact
    def __call__(self):
      return nn_partitioning.variable_with_axes('cache', 'k', jnp.zeros, (2,),
                                                axes=('a',)).value

  with pytest.raises(errors.ScopeVariableNotFoundError, match='"k"'):
    Missing().apply({'params': {}})


def test_partitioning_remat_static_argnums_match_linen():

  def model(lib, part):

    class Block(lib.Module):

      @lib.compact
      def __call__(self, x, double: bool):
        y = lib.Dense(2)(x)
        return 2 * y if double else y

    class Model(lib.Module):

      @lib.compact
      def __call__(self, x):
        return part.remat(Block, static_argnums=(1,))()(x, True)

    return Model()

  x = jnp.ones((1, 3))
  ours = model(nn, nn_partitioning)
  theirs = model(fnn, fnn_partitioning)
  v = ours.init(KEY, x)
  same_tree(v, theirs.init(KEY, x))
  g = jax.grad(lambda v: ours.apply(v, x).sum())(v)
  fg = jax.grad(lambda v: theirs.apply(v, x).sum())(v)
  same_tree(g, fg)
  with pytest.raises(NotImplementedError):
    nn_partitioning.remat(nn.Dense, concrete=True)


def test_exports():
  for name in ('LogicallyPartitioned', 'with_logical_partitioning',
               'logical_axis_rules', 'get_logical_axis_rules',
               'set_logical_axis_rules', 'logical_to_mesh_axes',
               'logical_to_mesh', 'logical_to_mesh_sharding',
               'with_logical_constraint'):
    assert getattr(nn, name) is getattr(nn.spmd, name), name
    assert hasattr(fnn, name)
  for name in dir(fnn_partitioning):
    if not name.startswith('_') and callable(getattr(fnn_partitioning, name)):
      if name in ('ScanIn', 'ScanOut', 'CollectionFilter', 'PRNGSequenceFilter',
                  'Array', 'InOutAxis', 'InOutScanAxis', 'LogicalRules',
                  'ArrayPytree', 'LogicalPartitionSpec', 'Mapping',
                  'LogicalPartitionSpecPytree', 'PartitionSpecPytree',
                  'Optional', 'Tuple', 'Any', 'Callable', 'freeze',
                  'unfreeze', 'flatten_dict', 'unflatten_dict',
                  'core_remat_static'):
        continue
      assert hasattr(nn_partitioning, name), name
  assert nn.spmd.RulesFallback.RAISE_ERROR.value == 'raise_error'


def test_user_axis_metadata_through_scan_matches_linen():

  def model(lib):

    class Axes(lib.meta.AxisMetadata):

      def __init__(self, value, axes):
        self.value, self.axes = value, axes

      def unbox(self):
        return self.value

      def replace_boxed(self, val):
        return Axes(val, self.axes)

      def add_axis(self, index, params):
        axes = list(self.axes)
        axes.insert(index, params['tag'])
        return Axes(self.value, tuple(axes))

      def remove_axis(self, index, params):
        assert self.axes[index] == params['tag']
        return Axes(self.value, self.axes[:index] + self.axes[index + 1:])

    jax.tree_util.register_pytree_node(
        Axes, lambda b: ((b.value,), b.axes), lambda a, c: Axes(c[0], a))

    def boxed(key, shape, dtype=jnp.float32):
      return Axes(lib.initializers.lecun_normal()(key, shape, dtype),
                  ('in', 'out'))

    class Layer(lib.Module):

      @lib.compact
      def __call__(self, x, _):
        return lib.Dense(4, kernel_init=boxed)(x), None

    class Stack(lib.Module):

      @lib.compact
      def __call__(self, x):
        return lib.scan(Layer, variable_axes={'params': 1},
                        split_rngs={'params': True}, length=2,
                        metadata_params={'tag': 'L'})()(x, None)[0]

    return Stack()

  x = jnp.ones((2, 4))
  ours, theirs = model(nn).init(KEY, x), model(fnn).init(KEY, x)
  box = ours['params']['ScanLayer_0']['Dense_0']['kernel']
  fbox = theirs['params']['ScanLayer_0']['Dense_0']['kernel']
  assert box.axes == fbox.axes == ('in', 'L', 'out')
  same_tree(nn.unbox(ours), fnn.unbox(theirs))
  np.testing.assert_array_equal(model(nn).apply(ours, x),
                                model(fnn).apply(theirs, x))


def test_core_spmd_composite_and_from_sharding_rules_match_flax():
  from flax.core import spmd as theirs
  from liftmods.core import spmd as ours
  a, b = (('embed', 'data'),), (('mlp', 'model'), ('embed', 'data'))
  assert ours.composite_rules(a, b) == theirs.composite_rules(a, b)
  assert ours.composite_rules((), b) == theirs.composite_rules((), b)
  with pytest.raises(ValueError, match='Inconsistent logical axis'):
    ours.composite_rules(a, (('embed', 'model'),))
  names = ('embed', None, 'other')
  assert ours.from_sharding_rules(names, b) == theirs.from_sharding_rules(
      names, b)
