"""Axis metadata: boxes around variable values that carry per-axis facts
(e.g. partitioning names) and learn about axes added by vmap/scan.

>>> import jax.numpy as jnp
>>> box = Partitioned(jnp.zeros((3, 4)), ('embed', 'mlp'))
>>> unbox({'w': box})['w'].shape
(3, 4)
>>> add_axis({'w': box}, 0, {PARTITION_NAME: 'layers'})['w'].names
('layers', 'embed', 'mlp')
"""
import abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax

from liftmods import errors

PARTITION_NAME = 'partition_name'


A = TypeVar('A')


class AxisMetadata(Generic[A], metaclass=abc.ABCMeta):
  """A box around a variable value; subclasses must be pytrees whose only
  child is the boxed value. Generic in the boxed type, as in Linen
  (``AxisMetadata[jax.Array]``), and free of metaclass conflicts with
  dataclass-based pytree bases such as ``flax.struct.PyTreeNode``."""

  @classmethod
  def __subclasshook__(cls, other):
    # A box written against another module system's AxisMetadata (under
    # liftmods.compat, ``flax.core.meta`` stays flax's, and libraries such
    # as AQT subclass it) is a box here too: recognised by the protocol,
    # without importing that module system.
    if cls is AxisMetadata and all(
        callable(getattr(other, m, None)) for m in _BOX_PROTOCOL):
      return True
    return NotImplemented

  @abc.abstractmethod
  def unbox(self) -> Any:
    """Returns the boxed value."""

  @abc.abstractmethod
  def replace_boxed(self, val) -> 'AxisMetadata':
    """Returns a box like this one around ``val``."""

  @abc.abstractmethod
  def add_axis(self, index: int, params: dict) -> 'AxisMetadata':
    """Records that a transform added an axis at ``index``."""

  @abc.abstractmethod
  def remove_axis(self, index: int, params: dict) -> 'AxisMetadata':
    """Records that a transform removed the axis at ``index``."""


_BOX_PROTOCOL = tuple(
    name for name, v in vars(AxisMetadata).items()
    if getattr(v, '__isabstractmethod__', False))


def is_axis_metadata(val: Any) -> bool:
  """Whether ``val`` is an axis-metadata box.

  Args:
    val: any value.

  Returns:
    True for an ``AxisMetadata`` (or anything with its methods).
  """
  return isinstance(val, AxisMetadata)


def map_axis_meta(fn: Callable[[AxisMetadata], Any], tree: Any) -> Any:
  """Applies ``fn`` to every box in ``tree``; other leaves stay.

  Args:
    fn: called on each box; its result replaces the box.
    tree: a pytree that may hold boxes.

  Returns:
    The mapped tree.
  """
  return jax.tree_util.tree_map(
      lambda x: fn(x) if isinstance(x, AxisMetadata) else x, tree,
      is_leaf=is_axis_metadata)


def unbox(tree: Any) -> Any:
  """Replaces every box in ``tree`` with its value (boxes in boxes too).

  Args:
    tree: a pytree, e.g. variables made with ``with_partitioning``.

  Returns:
    The same tree without boxes.
  """
  return map_axis_meta(lambda box: unbox(box.unbox()), tree)


def add_axis(tree: Any, index: int, params: dict) -> Any:
  """Adds axis ``index`` to the metadata of every box in ``tree``.

  Args:
    tree: a pytree that may hold boxes.
    index: where the new axis goes.
    params: the transform's ``metadata_params``.

  Returns:
    The tree with updated boxes.
  """
  return map_axis_meta(lambda box: box.add_axis(index, params), tree)


def remove_axis(tree: Any, index: int, params: dict) -> Any:
  """Removes axis ``index`` from the metadata of every box in ``tree``.

  Args:
    tree: a pytree that may hold boxes.
    index: the axis to remove.
    params: the transform's ``metadata_params``.

  Returns:
    The tree with updated boxes.
  """
  return map_axis_meta(lambda box: box.remove_axis(index, params), tree)


def replace_boxed(tree: Any, updates: Any) -> Any:
  """Puts the leaves of ``updates`` into the boxes of ``tree`` (where boxed).

  Args:
    tree: a pytree that may hold boxes.
    updates: a tree of plain values of the same structure.

  Returns:
    ``tree``'s boxes holding ``updates``' values; unboxed leaves are
      replaced.
  """
  def put(old, new):
    if not is_axis_metadata(old):
      return new
    inner = old.unbox(apply_constraint=False) if isinstance(
        old, Partitioned) else old.unbox()
    return old.replace_boxed(replace_boxed(inner, new))

  return jax.tree_util.tree_map(put, tree, updates, is_leaf=is_axis_metadata)


def get_global_mesh():
  """The mesh set by ``jax.set_mesh`` / ``jax.sharding.use_mesh`` (as an
  abstract mesh), or None outside any mesh context."""
  get = getattr(jax.sharding, 'get_abstract_mesh', None)
  mesh = get() if get else None
  return None if mesh is None or mesh.empty else mesh


def global_mesh_defined() -> bool:
  """Whether a mesh context is active."""
  return get_global_mesh() is not None


def spec_axes(entry) -> tuple:
  """The mesh axes of one ``PartitionSpec`` entry (None, a name, a tuple of
  names; ``UNCONSTRAINED`` has none).

  >>> spec_axes('data'), spec_axes(('data', 'fsdp')), spec_axes(None)
  (('data',), ('data', 'fsdp'), ())
  """
  if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def keep_axes(spec, keep) -> jax.sharding.PartitionSpec:
  """``spec`` with every mesh axis for which ``keep(axis)`` is False left
  out (a dimension left with none becomes None).

  >>> P = jax.sharding.PartitionSpec
  >>> keep_axes(P(('a', 'b'), 'c'), lambda x: x != 'b') == P('a', 'c')
  True
  """
  out = []
  for entry in spec:
    if entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
      out.append(entry)
      continue
    kept = tuple(a for a in spec_axes(entry) if keep(a))
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return jax.sharding.PartitionSpec(*out)


def _check_divisible(x, spec, mesh):
  """On Explicit axes a dimension must divide over its mesh axes (a type
  cannot be padded): ShardingDivisibilityError, not JAX's ValueError."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  shape = jax.numpy.shape(x)
  for dim, entry in enumerate(tuple(spec)[:len(shape)]):
    size = 1
    for axis in spec_axes(entry):
      size *= sizes[axis]
    if shape[dim] % size:
      raise errors.ShardingDivisibilityError('sharding constraint', shape,
                                             tuple(spec), dim, size)


def constrain(x, spec, mesh=None):
  """``x`` laid out as ``spec`` says, on ``mesh`` (None: the mesh context),
  whatever the mesh's axis types.

  Auto axes get ``lax.with_sharding_constraint`` (a hint to the compiler),
  Explicit axes ``jax.sharding.reshard`` (the array's type carries its
  sharding there, and a constraint would only assert it). Axes that are
  Manual here (inside ``shard_map``) are left out: ``x`` is already one
  device's block along them; with nothing left to say, ``x`` is returned.

  Args:
    x: an array.
    spec: a ``PartitionSpec`` of mesh axis names.
    mesh: a ``jax.sharding.Mesh``, or None for the context's.

  Returns:
    ``x``, constrained.
  """
  context = get_global_mesh()
  names = (mesh or context).axis_names
  for entry in spec:
    for axis in spec_axes(entry):
      if axis not in names:
        raise errors.MeshAxisNotFoundError('sharding constraint', spec, axis,
                                           names)
  manual = set(context.manual_axes) if context is not None else set()
  if manual:
    spec = keep_axes(spec, lambda a: a not in manual)
    if not any(spec_axes(e) for e in spec):
      return x
  types = dict(zip(names, (mesh or context).axis_types))
  explicit = keep_axes(
      spec, lambda a: types.get(a) == jax.sharding.AxisType.Explicit)
  auto = keep_axes(
      spec, lambda a: types.get(a) != jax.sharding.AxisType.Explicit)
  named = lambda s: jax.sharding.NamedSharding(mesh, s) if mesh else s
  if any(t == jax.sharding.AxisType.Explicit for t in types.values()):
    _check_divisible(x, explicit, mesh or context)
    x = jax.sharding.reshard(x, named(explicit))
    if not any(spec_axes(e) for e in auto):
      return x
  return jax.lax.with_sharding_constraint(x, named(auto))


def _is_static(field: dataclasses.Field) -> bool:
  md = field.metadata
  return bool(md.get('static', False)) or md.get('pytree_node', True) is False


def _register_box(cls):
  """Makes ``cls`` a frozen dataclass pytree: ``value`` (and other fields
  not marked static) are children, static fields are the node's aux data.

  Registered as a custom node rather than with ``register_dataclass``: JAX
  compares dataclass nodes by class name and fields, so another library's
  ``Partitioned`` with the same fields would share tree structures (and jit
  cache entries) with ours; custom nodes are compared by class."""
  if '__dataclass_fields__' not in cls.__dict__:
    cls = dataclasses.dataclass(frozen=True)(cls)
  fields = dataclasses.fields(cls)
  data = tuple(f.name for f in fields if not _is_static(f))
  static = tuple(f.name for f in fields if _is_static(f))
  keys = tuple(jax.tree_util.GetAttrKey(n) for n in data)

  def flatten(box):
    return (tuple(getattr(box, n) for n in data),
            tuple(getattr(box, n) for n in static))

  def flatten_with_keys(box):
    children, aux = flatten(box)
    return tuple(zip(keys, children)), aux

  def unflatten(aux, children):
    box = object.__new__(cls)
    for n, v in zip(data + static, tuple(children) + aux):
      object.__setattr__(box, n, v)
    return box

  jax.tree_util.register_pytree_with_keys(
      cls, flatten_with_keys, unflatten, flatten_func=flatten)
  return cls


class Partitioned(AxisMetadata):
  """A value with one logical/mesh axis name (or None) per dimension.

  Unboxing applies the names as a sharding constraint when the box has a
  mesh or a mesh context is active. Subclasses become frozen dataclass
  pytrees by themselves (fields marked ``metadata={'static': True}`` are
  static), like Linen's ``struct.PyTreeNode``.

  Attributes:
    value: the boxed array.
    names: one mesh axis name (or None) per dimension of ``value``.
    mesh: the mesh the names refer to (None: the mesh context, if any).

  >>> import jax.numpy as jnp
  >>> box = Partitioned(jnp.ones((2, 4)), (None, 'model'))
  >>> get_partition_spec({'w': box, 'n': 3})
  {'n': None, 'w': P(None, 'model')}
  """

  value: Any
  names: tuple = dataclasses.field(metadata=dict(static=True))
  mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _register_box(cls)

  def unbox(self, apply_constraint: bool = True):
    if apply_constraint and (self.mesh is not None or global_mesh_defined()):
      return constrain(self.value, self.get_partition_spec(), self.mesh)
    return self.value

  def replace_boxed(self, val):
    return dataclasses.replace(self, value=val)

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)

  def _axis_name(self, params):
    if PARTITION_NAME not in params:
      raise errors.PartitioningUnspecifiedError(self)
    return params[PARTITION_NAME]

  def add_axis(self, index, params):
    names = list(self.names)
    names += [None] * (index - len(names))
    names.insert(index, self._axis_name(params))
    return self.replace(names=tuple(names))

  def remove_axis(self, index, params):
    expected = self._axis_name(params)
    names = list(self.names)
    if names[index] != expected:
      raise errors.PartitionAxisMismatchError(self.names, index, expected)
    names.pop(index)
    return self.replace(names=tuple(names))

  def get_partition_spec(self):
    return jax.sharding.PartitionSpec(*self.names)

  def get_sharding(self, mesh):
    return jax.sharding.NamedSharding(mesh, self.get_partition_spec())

  def to_nnx_metadata(self) -> dict:
    """The box's fields as ``nnx.Variable`` metadata (``names`` is called
    ``out_sharding`` there)."""
    md = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    md['out_sharding'] = md.pop('names')
    return md

  @classmethod
  def from_nnx_metadata(cls, metadata: dict):
    """The inverse of ``to_nnx_metadata`` (extra keys are ignored)."""
    md = dict(metadata)
    md['names'] = md.pop('out_sharding')
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in md.items() if k in known})


Partitioned = _register_box(Partitioned)


def with_partitioning(fn: Callable[..., Any], names: Sequence[str | None],
                      mesh: Any = None) -> Callable[..., Partitioned]:
  """Wraps an initializer so that its output is boxed as ``Partitioned``.

  Args:
    fn: the initializer, ``fn(key, shape, dtype)``.
    names: one mesh axis name (or None) per dimension of the output.
    mesh: the mesh the names refer to (None: the mesh context).

  Returns:
    The wrapped initializer.
  """

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return Partitioned(fn(*args, **kwargs), tuple(names), mesh=mesh)

  return wrapper


def _leaf_spec(x):
  if hasattr(x, 'get_partition_spec'):
    return x.get_partition_spec()
  if hasattr(x, 'shape'):
    return jax.sharding.PartitionSpec()
  return None


def get_partition_spec(tree: Any) -> Any:
  """The ``PartitionSpec`` of every leaf of ``tree``.

  Args:
    tree: a pytree, e.g. boxed variables.

  Returns:
    A tree of the same structure: the box's spec for boxes, an empty spec
      for plain arrays, None for other leaves (numbers, strings, ...).
  """
  return jax.tree_util.tree_map(_leaf_spec, tree, is_leaf=is_axis_metadata)


def get_sharding(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """The ``NamedSharding`` over ``mesh`` of every leaf of ``tree``.

  Args:
    tree: a pytree, e.g. boxed variables.
    mesh: the device mesh.

  Returns:
    A tree of the same structure, with the specs of
      ``get_partition_spec`` (None for leaves that are not arrays).
  """

  def sharding(x):
    if hasattr(x, 'get_sharding'):
      return x.get_sharding(mesh)
    spec = _leaf_spec(x)
    return None if spec is None else jax.sharding.NamedSharding(mesh, spec)

  return jax.tree_util.tree_map(sharding, tree, is_leaf=is_axis_metadata)
