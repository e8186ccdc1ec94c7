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
from typing import Any

import jax

from liftmods import errors

PARTITION_NAME = 'partition_name'


class AxisMetadata(abc.ABC):
  """A box around a variable value; subclasses must be pytrees whose only
  child is the boxed value."""

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


def is_axis_metadata(x) -> bool:
  return isinstance(x, AxisMetadata)


def map_axis_meta(fn, tree):
  """Applies ``fn`` to every box in ``tree``; other leaves stay."""
  return jax.tree_util.tree_map(
      lambda x: fn(x) if isinstance(x, AxisMetadata) else x, tree,
      is_leaf=is_axis_metadata)


def unbox(tree):
  """Replaces every box in ``tree`` with its value (boxes in boxes too)."""
  return map_axis_meta(lambda box: unbox(box.unbox()), tree)


def add_axis(tree, index: int, params: dict):
  return map_axis_meta(lambda box: box.add_axis(index, params), tree)


def remove_axis(tree, index: int, params: dict):
  return map_axis_meta(lambda box: box.remove_axis(index, params), tree)


def replace_boxed(tree, updates):
  """Puts the leaves of ``updates`` into the boxes of ``tree`` (where boxed)."""
  def put(old, new):
    if not is_axis_metadata(old):
      return new
    inner = old.unbox(apply_constraint=False) if isinstance(
        old, Partitioned) else old.unbox()
    return old.replace_boxed(replace_boxed(inner, new))

  return jax.tree_util.tree_map(put, tree, updates, is_leaf=is_axis_metadata)


def _global_mesh():
  get = getattr(jax.sharding, 'get_abstract_mesh', None)
  mesh = get() if get else None
  return None if mesh is None or mesh.empty else mesh


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Partitioned(AxisMetadata):
  """A value with one logical/mesh axis name (or None) per dimension.

  Unboxing applies the names as a sharding constraint when a mesh is set.
  """

  value: Any
  names: tuple = dataclasses.field(metadata=dict(static=True))
  mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))

  def unbox(self, apply_constraint: bool = True):
    if apply_constraint and (self.mesh is not None or _global_mesh()):
      spec = self.get_partition_spec()
      target = (jax.sharding.NamedSharding(self.mesh, spec)
                if self.mesh is not None else spec)
      return jax.lax.with_sharding_constraint(self.value, target)
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
    names = list(self.names)
    names.pop(index)
    return self.replace(names=tuple(names))

  def get_partition_spec(self):
    return jax.sharding.PartitionSpec(*self.names)

  def get_sharding(self, mesh):
    return jax.sharding.NamedSharding(mesh, self.get_partition_spec())


def with_partitioning(fn, names, mesh=None):
  """Wraps an initializer so that its output is boxed as Partitioned."""

  def wrapper(*args, **kwargs):
    return Partitioned(fn(*args, **kwargs), tuple(names), mesh=mesh)

  return wrapper


def get_partition_spec(tree):
  """PartitionSpecs for boxed leaves; an empty spec for plain arrays."""
  return jax.tree_util.tree_map(
      lambda x: x.get_partition_spec() if isinstance(x, Partitioned)
      else jax.sharding.PartitionSpec(), tree, is_leaf=is_axis_metadata)


def get_sharding(tree, mesh):
  return jax.tree_util.tree_map(
      lambda x: x.get_sharding(mesh) if isinstance(x, Partitioned)
      else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
      tree, is_leaf=is_axis_metadata)
