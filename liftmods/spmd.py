"""Logical axis names: annotate arrays with model-level names ('batch',
'embed', 'mlp', ...) and map them to mesh axes with rules, as Linen's
``flax.linen.spmd``.

Rules are ``(logical_name, mesh_axes)`` pairs in order of precedence;
``mesh_axes`` is a mesh axis name, a tuple of them, or None (replicated).
For each dimension the first rule naming it wins, unless one of the rule's
mesh axes is already used by another dimension of the same array; a name no
rule can place is replicated.

>>> rules = (('batch', 'data'), ('embed', 'data'), ('mlp', 'model'))
>>> logical_to_mesh_axes(('batch', 'embed', 'mlp'), rules)
P('data', None, 'model')
>>> with logical_axis_rules(rules):
...   logical_to_mesh_axes(('embed', None))
P('data', None)
"""
import contextlib
import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec

from liftmods import call_context
from liftmods.core import meta

# Type aliases under Linen's names, for annotations.
Array = Union[jax.Array, Any]
ArrayPytree = Any
LogicalNames = tuple[Union[str, None], ...]
LogicalPartitionSpec = Any  # a PartitionSpec of logical names, or None
LogicalPartitionSpecPytree = Any
LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]


# -- the rules context ---------------------------------------------------------


from liftmods.core.spmd import (get_logical_axis_rules,  # pylint: disable=g-multiple-import
                                 logical_axis_rules,
                                 set_logical_axis_rules)


# -- logical names to mesh axes ------------------------------------------------


class _Unassigned:
  """Marks a logical dimension that no rule has placed yet."""

  def __repr__(self):
    return 'UnassignedAxis'

  def __bool__(self):
    return False


# The entry ``assign_mesh_axes`` gives a logical name that no rule placed.
UNASSIGNED = _Unassigned()


def _mesh_axes_of(entry) -> set:
  if entry is None or entry is UNASSIGNED:
    return set()
  if isinstance(entry, (tuple, list)):
    return {a for a in entry if a is not None}
  return {entry}


def assign_mesh_axes(names: Sequence[Any] | None,
                     rules: LogicalRules | None = None) -> list | None:
  """The mesh axes of each dimension under the rules.

  Callers choose what an unplaced name means (replicated, an error, or no
  constraint).

  Args:
    names: one logical name (or None) per dimension, or None.
    rules: the rules (None: the context's).

  Returns:
    Per dimension: the mesh axes of the winning rule, ``UNASSIGNED`` for a
      logical name no rule placed, non-string entries unchanged; None for
      ``names=None``.

  Raises:
    ValueError: a name occurs twice, or ``rules`` is not a tuple or list.
  """
  if names is None:
    return None
  if rules is None:
    rules = get_logical_axis_rules()
  names = tuple(names)
  strings = [n for n in names if isinstance(n, str)]
  dups = tuple(dict.fromkeys(n for n in strings if strings.count(n) > 1))
  if dups:
    raise ValueError(
        f'Unsupported: Dimensions {dups} occur more than once in array names.')
  if not isinstance(rules, (tuple, list)):
    raise ValueError('Unknown axis rule specification type.')
  out = [UNASSIGNED if isinstance(n, str) else n for n in names]
  for logical, mesh_axes in rules:
    if logical not in names:
      continue
    pos = names.index(logical)
    if out[pos] is not UNASSIGNED:
      continue
    used = set().union(*map(_mesh_axes_of, out))
    new = _mesh_axes_of(mesh_axes) - {PartitionSpec.UNCONSTRAINED}
    if not used & new:
      out[pos] = mesh_axes
  return out


def logical_to_mesh_axes(array_dim_names: Sequence[str | None] | None,
                         rules: LogicalRules | None = None
                         ) -> PartitionSpec | None:
  """The mesh PartitionSpec of an array with the given logical dimension names.

  For each dimension the first rule naming it wins, unless one of its mesh
  axes is already used by another dimension; unplaced names are replicated.

  Args:
    array_dim_names: one logical name (or None) per dimension, or None.
    rules: ``((logical name, mesh axes), ...)`` (None: the context's).

  Returns:
    The PartitionSpec over mesh axes (None for ``array_dim_names=None``).

  Raises:
    ValueError: a name occurs twice, or ``rules`` is not a tuple or list.
  """
  out = assign_mesh_axes(array_dim_names, rules)
  if out is None:
    return None
  return PartitionSpec(*(None if a is UNASSIGNED else a for a in out))


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def logical_to_mesh(tree: Any, rules: LogicalRules | None = None) -> Any:
  """``logical_to_mesh_axes`` on every PartitionSpec in ``tree``.

  Args:
    tree: a pytree of logical PartitionSpecs.
    rules: the rules (None: the context's).

  Returns:
    The tree of mesh PartitionSpecs.
  """
  return jax.tree_util.tree_map(lambda x: logical_to_mesh_axes(x, rules),
                                tree, is_leaf=_is_spec)


def logical_to_mesh_sharding(tree: Any, mesh: jax.sharding.Mesh,
                             rules: LogicalRules | None = None) -> Any:
  """NamedShardings over ``mesh`` for a tree of logical PartitionSpecs.

  Args:
    tree: a pytree of logical PartitionSpecs.
    mesh: the device mesh.
    rules: the rules (None: the context's).

  Returns:
    The tree of NamedShardings.
  """
  return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec),
                                logical_to_mesh(tree, rules), is_leaf=_is_spec)


# -- constraints ---------------------------------------------------------------


class RulesFallback(enum.Enum):
  """What ``with_logical_constraint`` does with a name no rule maps.

  Attributes:
    AXIS_IS_UNSHARDED: leave that dimension unsharded.
    RAISE_ERROR: raise ``ValueError``.
    NO_CONSTRAINT: skip the constraint for that array.
  """

  AXIS_IS_UNSHARDED = 'axis_is_unsharded'
  RAISE_ERROR = 'raise_error'
  NO_CONSTRAINT = 'no_constraint'


def _constrain(x, spec, mesh):
  """``lax.with_sharding_constraint`` when a mesh is known, else ``x``."""
  if mesh is None and not meta.global_mesh_defined():
    return x
  if spec is None:  # no names: Linen constrains to the mesh's default
    if mesh is not None:
      return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, spec)
  return meta.constrain(x, spec, mesh)


def _constrain_one(names, x, fallback, rules, mesh):
  axes = assign_mesh_axes(names, rules)
  if axes is None:
    return _constrain(x, None, mesh)
  if any(a is UNASSIGNED for a in axes):
    if fallback == RulesFallback.RAISE_ERROR:
      raise ValueError(f'Axis names {names} did not match a rule')
    if fallback == RulesFallback.NO_CONSTRAINT:
      return x
    axes = [None if a is UNASSIGNED else a for a in axes]
  return _constrain(x, PartitionSpec(*axes), mesh)


def _is_name(x) -> bool:
  return x is None or isinstance(x, str) or x is PartitionSpec.UNCONSTRAINED


def is_logical_names(x: Any) -> bool:
  """Whether ``x`` is one array's logical names, a leaf of an annotation tree.

  Args:
    x: any value.

  Returns:
    True for None or a tuple of names (strings, None or
      ``PartitionSpec.UNCONSTRAINED``).
  """
  return x is None or (isinstance(x, tuple) and all(map(_is_name, x)))


def record_constraint_names() -> contextlib.AbstractContextManager[dict]:
  """Collects the logical names ``with_logical_constraint`` is called with.

  Only calls in this thread inside the ``with`` block count
  (``nn.init_sharded`` counts them as uses of the rules). A view on the
  call recorder (``call_context.record`` of ``CONSTRAINT_NAMES``): nested
  blocks each see the names of the blocks inside them.

  Returns:
    A context manager yielding a dict used as an ordered set of the names,
      filled as the block runs.

  >>> import jax.numpy as jnp
  >>> with record_constraint_names() as seen:
  ...   _ = with_logical_constraint(jnp.ones((2, 3)), ('batch', 'embed'))
  >>> list(seen)
  ['batch', 'embed']
  """
  return call_context.record(call_context.CONSTRAINT_NAMES)


def _add_constraint_names(seen: dict, logical_axis_resources) -> None:
  for names in jax.tree_util.tree_leaves(logical_axis_resources,
                                         is_leaf=is_logical_names):
    for n in names if isinstance(names, tuple) else (names,):
      if isinstance(n, str):
        seen[n] = None


def with_logical_constraint(
    x: ArrayPytree, logical_axis_resources: LogicalPartitionSpecPytree,
    rules: LogicalRules | None = None, mesh: jax.sharding.Mesh | None = None,
    fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED) -> ArrayPytree:
  """``jax.lax.with_sharding_constraint`` in logical names.

  Constrains each array of ``x`` to the mesh axes its names map to. Does
  nothing without rules, or without a mesh (``mesh`` or a mesh context).

  Args:
    x: an array or pytree of arrays.
    logical_axis_resources: logical names (a tuple or PartitionSpec per
      array), matching ``x``'s structure.
    rules: the rules (None: the context's).
    mesh: the mesh (None: the mesh context).
    fallback: what to do with a name no rule maps: leave the dimension
      unsharded, raise, or skip the constraint.

  Returns:
    ``x``, constrained.
  """
  # Without any recording block open, one dict truthiness test (as a
  # module call makes); else one lookup of the names block, filled directly.
  records = call_context.calls.records
  if records and logical_axis_resources is not None:
    seen = records.get(call_context.CONSTRAINT_NAMES)
    if seen is not None:
      _add_constraint_names(seen, logical_axis_resources)
  if rules is None:
    rules = get_logical_axis_rules()
  if not rules or logical_axis_resources is None:
    return x
  one = functools.partial(_constrain_one, fallback=fallback, rules=rules,
                          mesh=mesh)
  return jax.tree_util.tree_map(one, logical_axis_resources, x,
                                is_leaf=is_logical_names)


def logical_out_sharding(logical_names: Sequence[str | None],
                         rules: LogicalRules | None = None
                         ) -> PartitionSpec | None:
  """The ``out_sharding`` for an operation whose output has these logical
  dimension names, on a mesh with Explicit axes.

  There an array's sharding is part of its type, and JAX asks for the
  output's sharding where it cannot infer it (a contraction over a sharded
  dimension, a gather from a sharded table): ``lax.dot_general(...,
  out_sharding=...)``, ``x.at[i].get(out_sharding=...)``. It accepts only
  Explicit axes, so this maps the names through the rules and keeps the
  context mesh's Explicit axes; None (JAX's default) without a mesh or
  without Explicit axes, so the same model code runs on Auto meshes.

  Args:
    logical_names: one logical name (or None) per output dimension.
    rules: the rules (None: the context's).

  Returns:
    A ``PartitionSpec`` over the Explicit mesh axes, or None.

  >>> logical_out_sharding(('batch', 'embed'), (('batch', 'data'),)) is None
  True
  """
  mesh = meta.get_global_mesh()
  if mesh is None:
    return None
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == jax.sharding.AxisType.Explicit}
  if not explicit:
    return None
  return meta.keep_axes(logical_to_mesh_axes(logical_names, rules),
                        lambda axis: axis in explicit)


# -- logically partitioned variables -------------------------------------------


class LogicallyPartitioned(meta.Partitioned):
  """A Partitioned box whose names are logical.

  Unboxing constrains the value through the rules (the box's own, else the
  context's).

  Attributes:
    value: the boxed array.
    names: one logical name (or None) per dimension of ``value``.
    mesh: the mesh (None: the mesh context, if any).
    rules: the box's own rules (None: the context's).

  >>> import jax.numpy as jnp
  >>> init = with_logical_partitioning(jnp.zeros, ('embed', 'mlp'))
  >>> box = init((4, 8))
  >>> box.get_partition_spec()
  P('embed', 'mlp')
  >>> logical_to_mesh(box.get_partition_spec(), (('mlp', 'model'),))
  P(None, 'model')
  """

  rules: Any = dataclasses.field(default=None, metadata=dict(static=True))

  def unbox(self, apply_constraint: bool = True):
    if apply_constraint and (self.mesh is not None or
                             meta.global_mesh_defined()):
      return with_logical_constraint(self.value, self.get_partition_spec(),
                                     rules=self.rules, mesh=self.mesh)
    return self.value

  def to_nnx_metadata(self) -> dict:
    md = super().to_nnx_metadata()
    md['sharding_rules'] = md.pop('rules')
    return md

  @classmethod
  def from_nnx_metadata(cls, metadata: dict):
    md = dict(metadata)
    md['rules'] = md.pop('sharding_rules')
    return super().from_nnx_metadata(md)


def with_logical_partitioning(fn: Callable[..., Any],
                              names: Sequence[str | None],
                              mesh: jax.sharding.Mesh | None = None,
                              rules: LogicalRules | None = None
                              ) -> Callable[..., LogicallyPartitioned]:
  """Wraps an initializer so that its output is boxed as LogicallyPartitioned.

  Args:
    fn: the initializer, ``fn(key, shape, dtype)``.
    names: one logical name (or None) per dimension of the output.
    mesh: the mesh (None: the mesh context).
    rules: rules stored in the box (None: the context's when unboxed).

  Returns:
    The wrapped initializer.
  """

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return LogicallyPartitioned(fn(*args, **kwargs), tuple(names), mesh=mesh,
                                rules=rules)

  return wrapper


# -- the other names of flax.linen.spmd ----------------------------------------
# Code written for Linen reaches these as attributes of flax.linen.spmd.
# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
import collections

from jax import lax
# pylint: enable=g-import-not-at-top,wrong-import-position,unused-import

# Names of flax.linen.spmd that mean nothing in liftmods, and why.
from liftmods import linen_names  # pylint: disable=g-import-not-at-top,wrong-import-position

_LINEN_ONLY = {
    **linen_names.shared('struct'),
}


__getattr__ = linen_names.not_provided(__name__, 'flax.linen.spmd',
                                        _LINEN_ONLY)
