"""Lifted ``jax.shard_map``: a scope function run once per shard of a mesh.

Inside ``fn(scope, *args)`` every array is the block one device holds, and
collectives (``lax.psum``, ``lax.ppermute``, ``lax.all_to_all``) over the
mesh axes work as in a hand-written ``jax.shard_map``. Variables cross the
boundary like arguments: each has a ``PartitionSpec``, the global array is
cut into blocks on the way in and the blocks are assembled on the way out
(created and mutated variables included). A variable's spec comes from, in
order:

1. ``variable_specs[filter]`` of the first filter matching its collection,
   when that is a ``PartitionSpec`` (every variable of those collections) or
   a callable ``(collection, path, value) -> PartitionSpec``;
2. its partitioning metadata (a ``Partitioned`` box: ``box_spec(box)``,
   which maps logical names through the rules at module level);
3. otherwise ``ShardMapSpecError`` names the variable.

On a mesh whose manual axes are Explicit,
arguments and variables are first resharded to their specs (JAX's
``shard_map`` takes only inputs laid out as their specs there). Boxes cross
unboxed: inside, a variable is the plain local block (a sharding
constraint cannot name an axis that is manual there), and it leaves in a box
with the metadata it came with. RNG sequences listed in ``split_rngs`` with
True give each shard its own key (the key folded with the shard's index over
the manual axes), with a mesh axis (or axes) keys that differ along those
axes only, with False the same key everywhere.

Output specs of variables that only exist once the body has run (``init``)
are read from a first, abstract trace; the rng counters are put back after
it, so the body's keys are those of a single run.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> from liftmods.core import init, meta
>>> def layer(scope, x):
...   w = scope.param('w', meta.with_partitioning(
...       lambda k, s: jnp.ones(s), ('x',)), (x.shape[-1],))
...   return jax.lax.psum(x * w, 'x')
>>> mesh = jax.make_mesh((1,), ('x',))
>>> sharded = shard_map(layer, mesh, in_specs=(P(None, 'x'),), out_specs=P(),
...                     split_rngs={'params': True})
>>> y, v = init(sharded)(jax.random.key(0), jnp.ones((2, 4)))
>>> y.shape, v['params']['w'].value.shape
((2, 4), (4,))
"""
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax, random
from jax.sharding import PartitionSpec

from liftmods import errors
from liftmods.core import explicit, meta
from liftmods.core.filters import intersect, union
from liftmods.core.pack import outer_scopes, pack, unzip2, var_name
from liftmods.core.rng_counters import restore_scopes, snapshot_scopes

__all__ = ['shard_map']

_NOT_REPLICATED = (
    'an output (a variable, or the result) that its spec declares '
    'replicated along a mesh axis can differ between the shards along it. '
    "Usually a variable was initialised with rng keys split over an axis "
    'it is replicated along: split the sequence over the axes the variable '
    "is sharded on only (split_rngs={'params': 'model'}) or not at all "
    '(False); else an out_specs entry leaves out an axis its value varies '
    "over. JAX's message is chained below")


def _box_spec(box) -> PartitionSpec:
  return box.get_partition_spec()


def _is_box(x) -> bool:
  return meta.is_axis_metadata(x)


def _mesh_of(mesh):
  if mesh is not None:
    return _inside_outer_map(mesh)
  mesh = meta.get_global_mesh()
  if mesh is None:
    raise ValueError('shard_map: no mesh. Pass mesh=..., or call inside '
                     '`with jax.set_mesh(mesh):`.')
  return mesh


def _inside_outer_map(mesh):
  """``mesh``, or the context's abstract mesh when this map is nested in
  another over the same mesh: JAX wants the mesh whose outer axes are
  Manual there, and a module written with ``mesh=`` nests unchanged."""
  context = meta.get_global_mesh()
  manual = jax.sharding.AxisType.Manual
  if (context is None or manual not in context.axis_types or
      tuple(context.axis_names) != tuple(mesh.axis_names) or
      tuple(context.axis_sizes) != tuple(mesh.axis_sizes)):
    return mesh
  return context


class _Specs:
  """The specs of a transform's variables, and the checks on them."""

  def __init__(self, scopes, mesh, box_spec, manual):
    self.scopes, self.mesh = scopes, mesh
    self.box_spec, self.manual = box_spec, manual

  def where(self, scope_index, collection, path) -> str:
    return (f'shard_map at {self.scopes[scope_index].path_text}: variable '
            f'"{var_name(path)}" of collection "{collection}"')

  def of_leaf(self, rule, where_args, leaf) -> PartitionSpec:
    scope_index, collection, path = where_args
    if isinstance(rule, PartitionSpec):
      return rule
    if callable(rule):
      return rule(collection, tuple(var_name(path).split('/')), leaf)
    if _is_box(leaf):
      return self.box_spec(leaf)
    raise errors.ShardMapSpecError(self.where(*where_args))

  def check(self, spec, leaf, where_args):
    """Raises when ``spec`` names an axis the mesh lacks or does not divide
    ``leaf``'s (global) shape."""
    value = leaf.value if _is_box(leaf) else leaf
    self.check_at(spec, getattr(value, 'shape', ()), self.where(*where_args))

  def arguments(self, in_specs, args):
    """``check_at`` for every array of ``args`` under its spec."""
    for i, (spec, arg) in enumerate(zip(in_specs, args)):
      specs = jax.tree.broadcast(spec, arg, is_leaf=_is_spec)
      for (path, s), x in zip(
          jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0],
          jax.tree_util.tree_leaves(arg)):
        if s is not None and hasattr(x, 'shape'):
          self.check_at(s, x.shape, f'shard_map at {self.scopes[0].path_text}'
                        f': argument {i + 1}{jax.tree_util.keystr(path)}')

  def check_at(self, spec, shape, where):
    """``check`` of an array of ``shape``, said of ``where``."""
    sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
    for dim, entry in enumerate(spec):
      size = 1
      for axis in meta.spec_axes(entry):
        if axis not in sizes:
          raise errors.MeshAxisNotFoundError(where, spec, axis,
                                             self.mesh.axis_names)
        if axis not in self.manual:
          raise errors.ShardMapSpecError(
              where, f'its spec {spec} names mesh axis {axis!r}, which is '
              f'not one of the manual axes {tuple(sorted(self.manual))}')
        size *= sizes[axis]
      if dim >= len(shape):
        raise errors.ShardMapSpecError(
            where, f'its spec {spec} has more entries than its shape '
            f'{tuple(shape)} has dimensions')
      if shape[dim] % size:
        raise errors.ShardingDivisibilityError(where, shape, spec, dim, size)

  def split(self, groups, rules, check: bool):
    """One walk over variable ``groups`` (one rule per group): the spec of
    every variable (box), the groups with boxes unboxed, and the boxes by
    their path (to put the outputs back into)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(groups,
                                                            is_leaf=_is_box)
    specs, plain, boxes = [], [], {}
    for path, leaf in leaves:
      group, scope, col = path[0].idx, path[1].idx, path[2].key
      where_args = (scope, col, path[3:])
      spec = self.of_leaf(rules[group], where_args, leaf)
      if check:
        self.check(spec, leaf, where_args)
      specs.append(spec)
      if _is_box(leaf):
        boxes[path] = leaf
        leaf = leaf.unbox(apply_constraint=False)
      plain.append(leaf)
    return (treedef.unflatten(specs), treedef.unflatten(plain), boxes)


def _rebox(out_groups, boxes):
  """Puts every output leaf whose input was a box back into that box."""
  def put(path, leaf):
    box = boxes.get(path)
    if box is not None and not _is_box(leaf):
      return box.replace_boxed(leaf)
    return leaf

  return jax.tree_util.tree_map_with_path(put, out_groups, is_leaf=_is_box)


def _explicit(mesh, manual) -> bool:
  return any(t == jax.sharding.AxisType.Explicit
             for name, t in zip(mesh.axis_names, mesh.axis_types)
             if name in manual)


def _is_spec(x) -> bool:
  return x is None or isinstance(x, PartitionSpec)


def _with_kept_axes(x, spec, manual):
  """``spec`` (over manual axes) with, per dimension, the axes ``x``'s type
  already shards it over that are not manual: those stay with the
  partitioner, so a batch split over an Explicit ``data`` axis stays split
  when only ``model`` is manual."""
  kept = explicit.spec_of(x) if explicit.explicit_mesh(x) else ()
  entries = []
  for i, entry in enumerate(tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))):
    others = tuple(a for a in meta.spec_axes(kept[i] if i < len(kept) else None)
                   if a not in manual)
    axes = others + meta.spec_axes(entry)
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*entries)


def _reshard(specs, tree, mesh, manual):
  """``tree`` laid out as ``specs`` (a tree prefix) says on the manual
  axes, keeping its layout on the others: on a mesh with Explicit axes an
  array's type carries its sharding, and ``jax.shard_map`` takes only
  inputs already laid out as their in_specs."""
  def one(spec, sub):
    spec = PartitionSpec() if spec is None else spec
    return jax.tree_util.tree_map(
        lambda x: meta.constrain(x, _with_kept_axes(x, spec, manual), mesh),
        sub)
  return jax.tree_util.tree_map(one, specs, tree, is_leaf=_is_spec)


def _split_axes(split, manual) -> tuple:
  """The mesh axes a ``split_rngs`` value splits over."""
  if split is True:
    return tuple(sorted(manual))
  if not split:
    return ()
  axes = (split,) if isinstance(split, str) else tuple(split)
  unknown = [a for a in axes if a not in manual]
  if unknown:
    raise ValueError(f'shard_map: split_rngs names {unknown}, which are not '
                     f'manual mesh axes {tuple(sorted(manual))}.')
  return axes


def _shard_index(mesh, axes):
  """This shard's position over ``axes``, in mesh order."""
  index = 0
  for name, size in zip(mesh.axis_names, mesh.axis_sizes):
    if name in axes:
      index = index * size + lax.axis_index(name)
  return index


def shard_map(fn: Callable[..., Any], mesh: Any, in_specs: Any,
              out_specs: Any, variable_specs: Mapping = {True: None},  # pylint: disable=dangerous-default-value
              split_rngs: Mapping = {},  # pylint: disable=dangerous-default-value
              axis_names: Any = None, check_vma: bool = True,
              box_spec: Callable[[Any], PartitionSpec] = _box_spec,
              ) -> Callable[..., Any]:
  """``jax.shard_map`` for scope functions.

  Args:
    fn: ``fn(scope, *args)``, written for one shard.
    mesh: the mesh (None: the one set with ``jax.set_mesh``).
    in_specs: one spec (or spec tree) per positional argument after the
      scope, as ``jax.shard_map``'s ``in_specs``.
    out_specs: the output's spec (tree prefix), as in ``jax.shard_map``.
    variable_specs: ``{collection filter: rule}``, a rule being None (each
      variable's partitioning metadata), a ``PartitionSpec`` for all of
      them, or ``rule(collection, path, value) -> PartitionSpec``.
      Collections no filter matches do not enter.
    split_rngs: ``{rng filter: split}``: ``True`` gives every shard its
      own key of the sequence (the key folded with the shard's index), a
      mesh axis name or tuple of names splits over those axes only (shards
      that differ only along other axes share keys), ``False`` gives every
      shard the same key; sequences not listed do not enter. A variable
      created inside must be made with keys that are split over no axis it
      is replicated along (JAX's ``check_vma`` reports one that is).
    axis_names: the mesh axes that are manual inside (None: all).
    check_vma: as in ``jax.shard_map``.
    box_spec: the mesh spec of a partitioning box (the module level maps
      logical names through the rules here).

  Returns:
    The lifted ``f(scope, *args)``.
  """
  filters, rules = unzip2(variable_specs.items())
  rng_filters, rng_splits = unzip2(split_rngs.items())
  out_union = False
  for f in filters:
    out_union = union(out_union, f)

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, *args):
    scopes = outer_scopes(make_scopes)
    the_mesh = _mesh_of(mesh)
    manual = frozenset(the_mesh.axis_names if axis_names is None
                       else axis_names)
    specs = _Specs(scopes, the_mesh, box_spec, manual)
    var_specs, plain_in, boxes = specs.split(variable_groups, rules,
                                             check=True)

    split_axes = [_split_axes(split, manual) for split in rng_splits]

    def body(plain, rng_groups, args):
      rng_groups = tuple(
          jax.tree_util.tree_map(lambda k, a=axes: random.fold_in(
              k, _shard_index(the_mesh, a)), g) if axes else g
          for g, axes in zip(rng_groups, split_axes))
      scope = make_scopes(plain, rng_groups)
      y = fn(scope, *args)
      return y, _rebox(repack_fn(scope), boxes)

    specs.arguments(tuple(in_specs), args)
    all_in_specs = (var_specs, PartitionSpec(), tuple(in_specs))
    inputs = (plain_in, rng_groups, args)
    if _explicit(the_mesh, manual):
      inputs = _reshard(all_in_specs, inputs, the_mesh, manual)

    def run(out_var_specs, check):
      return jax.shard_map(
          body, mesh=the_mesh, in_specs=all_in_specs,
          out_specs=(out_specs, out_var_specs), axis_names=manual,
          check_vma=check)(*inputs)

    if not any(intersect(s.mutable, out_union) for s in scopes):
      out_var_specs = tuple(tuple({} for _ in scopes) for _ in filters)
    else:  # what init creates is known once the body has run
      before = snapshot_scopes(scopes)
      _, out_shapes = jax.eval_shape(lambda: run(PartitionSpec(), False))
      restore_scopes(scopes, before)
      out_var_specs = specs.split(out_shapes, rules, check=False)[0]
    try:
      return run(out_var_specs, check_vma)
    except ValueError as e:
      if 'replicat' not in str(e):
        raise
      raise errors.ShardMapSpecError(
          f'shard_map at {scopes[0].path_text}', _NOT_REPLICATED,
          crossing=False) from e

  return pack(inner, filters, filters, rng_filters, name='shard_map')
