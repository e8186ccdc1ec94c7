"""The older T5X-style partitioning API of Linen (``flax.linen.partitioning``).

Parameters are declared with ``param_with_axes(name, init, ..., axes=...)``:
the value stays a plain array and its logical axis names are sown into a
parallel ``params_axes`` collection (``<name>_axes`` entries), which
``get_axis_names`` turns into a tree of logical PartitionSpecs.
``scan_with_axes`` / ``vmap_with_axes`` add the stacked axis to those names.

>>> import jax, jax.numpy as jnp
>>> import liftmods as nn
>>> from liftmods import partitioning as nn_partitioning
>>> class Dense(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     w = nn_partitioning.param_with_axes(
...         'w', nn.initializers.ones, (x.shape[-1], 4), axes=('embed', 'mlp'))
...     return x @ w
>>> variables = Dense().init(jax.random.key(0), jnp.ones((1, 3)))
>>> nn_partitioning.get_axis_names(variables['params_axes'])['w']
P('embed', 'mlp')
"""
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax

from liftmods import errors, transforms
from liftmods.core.frozen_dict import freeze, unfreeze
from liftmods.core.lift import In as ScanIn, Out as ScanOut
from liftmods.traverse_util import flatten_dict, unflatten_dict
from liftmods.core import filters, frozen_dict, lift
from liftmods.core import scope as core_scope
from liftmods.module import current_module
from liftmods.spmd import (RulesFallback, is_logical_names, logical_to_mesh,
                           logical_to_mesh_axes)
from liftmods.spmd import get_logical_axis_rules as get_axis_rules
from liftmods.spmd import logical_axis_rules as axis_rules
from liftmods.spmd import set_logical_axis_rules as set_axis_rules
# Type aliases Linen code imports from this module (flax.linen.partitioning).
from liftmods.typing import (  # pylint: disable=unused-import
    Array, ArrayPytree, CollectionFilter, InOutAxis, InOutScanAxis,
    LogicalPartitionSpec, LogicalPartitionSpecPytree, LogicalRules,
    PRNGSequenceFilter, PartitionSpecPytree)
from liftmods.spmd import with_logical_constraint as with_sharding_constraint

__all__ = [
    'AxisMetadata', 'PartitionedVariable', 'RulesFallback', 'axis_rules',
    'get_axis_names', 'get_axis_rules', 'logical_to_mesh',
    'logical_to_mesh_axes', 'param_with_axes', 'remat', 'scan_with_axes',
    'set_axis_rules', 'variable_with_axes', 'vmap_with_axes',
    'with_sharding_constraint',
]


@dataclasses.dataclass(frozen=True)
class AxisMetadata:
  """The logical axis names of one variable, stored in an ``*_axes`` collection.

  A pytree with no array leaves.

  Attributes:
    names: one logical name (or None) per dimension of the variable.
  """

  names: Any


jax.tree_util.register_pytree_node(
    AxisMetadata, lambda m: ((), m.names), lambda names, _: AxisMetadata(names))


def _merge_axes(old, new):
  """Sow reduction: the first names win; sowing different ones is an error."""
  if not isinstance(new, AxisMetadata):
    raise TypeError('Expected newly sown value to be an AxisMetadata')
  if isinstance(old, AxisMetadata):
    if old != new:
      raise ValueError('If axis names are sown twice, expected them to match. '
                       f'Got {old} and {new}.')
  elif old:
    raise AssertionError(f'Non-initial-or-AxisMetadata value encountered: {old}')
  return new


def _current(module):
  module = current_module() if module is None else module
  if module is None:
    raise ValueError('param_with_axes / variable_with_axes must be called '
                     'inside a module method (or given module=).')
  return module


def param_with_axes(name: str, init_fn: Callable[..., Any], *init_args: Any,
                    axes: tuple[str | None, ...] | None = None,
                    module: Any = None, **init_kwargs: Any) -> Array:
  """``module.param`` that also records the parameter's logical axis names.

  The names go to ``params_axes`` (as ``<name>_axes``) and the value is
  constrained to them.

  Args:
    name: the parameter's name.
    init_fn: its initializer.
    *init_args: arguments of ``init_fn`` after the key.
    axes: one logical name (or None) per dimension.
    module: the module to declare it in (default: the running one).
    **init_kwargs: keyword arguments of ``init_fn``.

  Returns:
    The parameter's value.

  Raises:
    ValueError: called outside a module method without ``module``.
  """
  module = _current(module)
  value = module.param(name, init_fn, *init_args, **init_kwargs)
  if axes is not None:
    value = with_sharding_constraint(value, jax.sharding.PartitionSpec(*axes))
    module.sow('params_axes', f'{name}_axes', AxisMetadata(axes),
               reduce_fn=_merge_axes)
  return value


class PartitionedVariable(core_scope.Variable):
  """A Variable whose reads and writes are constrained to its logical axes.

  Args:
    scope: the scope holding the variable.
    collection: its collection.
    name: its name.
    axes: one logical name (or None) per dimension (None: no constraint).
    fallback: what ``with_logical_constraint`` does with unmapped names.
  """

  __slots__ = ('axes', 'fallback')

  def __init__(self, scope: core_scope.Scope, collection: str, name: str,
               axes: tuple[str | None, ...] | None = None,
               fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED):
    super().__init__(scope, collection, name, unbox=False)
    self.axes = axes
    self.fallback = fallback

  def _constrain(self, value):
    if self.axes is None:
      return value
    return with_sharding_constraint(value, self.axes, fallback=self.fallback)

  @property
  def value(self):
    return self._constrain(self.scope.get_variable(self.collection, self.name))

  @value.setter
  def value(self, value):
    self.scope.put_variable(self.collection, self.name, self._constrain(value))


def variable_with_axes(collection: str, name: str,
                       init_fn: Callable[..., Any], *init_args: Any,
                       axes: tuple[str | None, ...] | None = None,
                       module: Any = None,
                       fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
                       **init_kwargs: Any) -> PartitionedVariable:
  """``module.variable`` that also records the variable's logical axis names.

  The names go to ``<collection>_axes`` (as ``<name>_axes``).

  Args:
    collection: the variable's collection.
    name: its name.
    init_fn: makes the initial value, ``init_fn(*init_args,
      **init_kwargs)``.
    *init_args: arguments of ``init_fn``.
    axes: one logical name (or None) per dimension.
    module: the module to declare it in (default: the running one).
    fallback: what ``with_logical_constraint`` does with unmapped names.
    **init_kwargs: keyword arguments of ``init_fn``.

  Returns:
    A PartitionedVariable constrained to ``axes``.

  Raises:
    ScopeVariableNotFoundError: the variable is missing and ``collection``
      is not mutable.
  """
  module = _current(module)
  scope = module.scope
  scope.reserve(name, collection)
  if not scope.has_variable(collection, name):
    if not scope.is_mutable_collection(collection):
      raise errors.ScopeVariableNotFoundError(name, collection,
                                              scope.path_text)
    value = init_fn(*init_args, **init_kwargs)
    if axes is not None:
      value = with_sharding_constraint(value, axes, fallback=fallback)
    scope.put_variable(collection, name, value)
    core_scope.note_creation(scope, collection, name)
  if axes is not None:
    module.sow(f'{collection}_axes', f'{name}_axes', AxisMetadata(axes),
               reduce_fn=_merge_axes)
  return PartitionedVariable(scope, collection, name, axes, fallback)


def get_axis_names(axes_metadata: Any) -> Any:
  """The logical PartitionSpecs recorded in an ``*_axes`` collection.

  Args:
    axes_metadata: e.g. ``variables['params_axes']``.

  Returns:
    A FrozenDict of PartitionSpecs keyed like the variables (the ``_axes``
    suffix dropped).
  """

  def specs(names):
    return jax.tree_util.tree_map(
        lambda n: None if n is None else jax.sharding.PartitionSpec(*n),
        names, is_leaf=is_logical_names)

  def walk(tree):
    out = {}
    for key, value in tree.items():
      if isinstance(value, AxisMetadata):
        out[re.sub(r'_axes$', '', key)] = specs(value.names)
      else:
        out[key] = walk(value)
    return out

  return frozen_dict.freeze(walk(frozen_dict.unfreeze(axes_metadata)))


# -- transforms that keep the axis names in step -------------------------------


def _map_names(meta_tree, fn):
  def one(m):
    if not isinstance(m, AxisMetadata):
      return m
    return m.__class__(jax.tree_util.tree_map(
        lambda n: None if n is None else fn(list(n)), m.names,
        is_leaf=is_logical_names))
  return jax.tree_util.tree_map(one, meta_tree,
                                is_leaf=lambda x: isinstance(x, AxisMetadata))


def _is_mutable(col: str) -> bool:
  module = current_module()
  return True if module is None else module.is_mutable_collection(col)


def _add_axis_to_metadata(fn, axis_pos, axis_name, axis_col='params_axes'):
  """Wraps ``fn`` so that ``axis_col``'s names gain ``axis_name`` at
  ``axis_pos`` on the way out and lose it on the way in."""
  axis_pos = getattr(axis_pos, 'axis', axis_pos)

  def insert(names):
    names.insert(axis_pos, axis_name)
    return tuple(names)

  def remove(names):
    if names[axis_pos] != axis_name:
      raise ValueError(f'Expected axis {axis_name} at position {axis_pos} in '
                       f'axis metadata {names}.')
    names.pop(axis_pos)
    return tuple(names)

  return transforms.map_variables(
      fn, axis_col, mutable=_is_mutable(axis_col),
      trans_in_fn=lambda tree: _map_names(tree, remove),
      trans_out_fn=lambda tree: _map_names(tree, insert))


def scan_with_axes(target: Any, variable_axes: Mapping[Any, Any] = {},  # pylint: disable=dangerous-default-value
                   variable_broadcast: CollectionFilter = False,
                   variable_carry: CollectionFilter = False,
                   split_rngs: Mapping[Any, bool] = {},  # pylint: disable=dangerous-default-value
                   in_axes: Any = 0, out_axes: Any = 0,
                   length: int | None = None, reverse: bool = False,
                   unroll: int = 1, axis_name: str = 'layers',
                   axes_collections: tuple[str, ...] = ('params',),
                   data_transform: Callable[..., Any] | None = None,
                   methods: Any = None) -> Any:
  """``nn.scan`` that also adds the scanned axis to the ``*_axes`` names.

  The ``*_axes`` collections are broadcast; the names of the scanned
  collections gain ``axis_name`` at their scanned axis.

  Args:
    target: a Module class or a function of a module.
    variable_axes: as for ``nn.scan``.
    variable_broadcast: as for ``nn.scan``.
    variable_carry: as for ``nn.scan``.
    split_rngs: as for ``nn.scan``.
    in_axes: as for ``nn.scan``.
    out_axes: as for ``nn.scan``.
    length: as for ``nn.scan``.
    reverse: as for ``nn.scan``.
    unroll: as for ``nn.scan``.
    axis_name: the logical name of the scanned axis.
    axes_collections: the collections whose ``*_axes`` names are updated.
    data_transform: as for ``nn.scan``.
    methods: as for ``nn.scan``.

  Returns:
    The scanned class or function.
  """
  axes_filters = tuple(f'{col}_axes' for col in axes_collections)
  scanned = transforms.scan(
      target, variable_axes=variable_axes,
      variable_broadcast=filters.union(variable_broadcast, axes_filters),
      variable_carry=variable_carry, split_rngs=split_rngs, in_axes=in_axes,
      out_axes=out_axes, length=length, reverse=reverse, unroll=unroll,
      data_transform=data_transform, methods=methods)
  for col in axes_collections:
    if col in variable_axes:
      scanned = _add_axis_to_metadata(scanned, variable_axes[col], axis_name,
                                      f'{col}_axes')
  return scanned


def vmap_with_axes(target: Any, variable_axes: Mapping[Any, Any],
                   split_rngs: Mapping[Any, bool] = {},  # pylint: disable=dangerous-default-value
                   in_axes: Any = 0, out_axes: Any = 0,
                   axis_size: int | None = None, axis_name: str | None = None,
                   partitioning_axis_names: Mapping[str, str] = {},  # pylint: disable=dangerous-default-value
                   spmd_axis_name: str | None = None,
                   methods: Any = None) -> Any:
  """``nn.vmap`` that also adds the vmapped axis to the ``*_axes`` names.

  Args:
    target: a Module class or a function of a module.
    variable_axes: as for ``nn.vmap``.
    split_rngs: as for ``nn.vmap``.
    in_axes: as for ``nn.vmap``.
    out_axes: as for ``nn.vmap``.
    axis_size: as for ``nn.vmap``.
    axis_name: as for ``nn.vmap``.
    partitioning_axis_names: ``{collection: logical name}`` added to the
      names in ``<collection>_axes`` at the vmapped axis.
    spmd_axis_name: as for ``nn.vmap``.
    methods: as for ``nn.vmap``.

  Returns:
    The vmapped class or function.
  """
  variable_axes = dict(variable_axes)
  for col in partitioning_axis_names:
    variable_axes[f'{col}_axes'] = None
  vmapped = transforms.vmap(
      target, variable_axes=variable_axes, split_rngs=split_rngs,
      in_axes=in_axes, out_axes=out_axes, axis_size=axis_size,
      axis_name=axis_name, spmd_axis_name=spmd_axis_name, methods=methods)
  for col, axis in variable_axes.items():
    if col in partitioning_axis_names:
      vmapped = _add_axis_to_metadata(vmapped, axis,
                                      partitioning_axis_names[col],
                                      f'{col}_axes')
  return vmapped


def core_remat_static(fn: Callable[..., Any], variables: CollectionFilter = True,
                      rngs: PRNGSequenceFilter = True, concrete: bool = False,
                      prevent_cse: bool = True,
                      static_argnums: tuple[int, ...] = (),
                      policy: Callable[..., bool] | None = None
                      ) -> Callable[..., Any]:
  """The core (scope-function) remat with static arguments.

  Args:
    fn: ``fn(scope, *args)``.
    variables: the collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.
    concrete: not supported (True raises when called).
    prevent_cse: as in ``jax.checkpoint``.
    static_argnums: static arguments, counted from the first argument after
      the scope.
    policy: a ``jax.checkpoint_policies`` rule.

  Returns:
    The rematerialized scope function.
  """
  return lift.checkpoint(fn, variables=variables, rngs=rngs,
                         concrete=concrete, prevent_cse=prevent_cse,
                         static_argnums=tuple(static_argnums), policy=policy)


def remat(target: Any, variables: CollectionFilter = True,
          rngs: PRNGSequenceFilter = True, concrete: bool = False,
          prevent_cse: bool = True, static_argnums: int | tuple[int, ...] = (),
          policy: Callable[..., bool] | None = None, methods: Any = None) -> Any:
  """``nn.remat`` whose ``static_argnums`` count from the first argument after ``self``.

  Args:
    target: a Module class or a function of a module.
    variables: the collections the target sees.
    rngs: the rng sequences it sees.
    concrete: not supported; must be False.
    prevent_cse: as in ``jax.checkpoint``.
    static_argnums: static arguments; 0 is the first non-module argument.
    policy: a ``jax.checkpoint_policies`` rule.
    methods: as for ``nn.remat``.

  Returns:
    The rematerialized class or function.

  Raises:
    NotImplementedError: ``concrete`` is True.
  """
  if concrete:
    raise NotImplementedError(
        'The concrete argument is deprecated. Use static_argnums instead.')
  if isinstance(static_argnums, int):
    static_argnums = (static_argnums,)
  # Named like Linen's lifted class (``Core_remat_static<Module>``), so the
  # auto-names, and with them the parameter keys, match.
  return transforms.lift_transform(
      lift.checkpoint, 'core_remat_static', target, variables=variables,
      rngs=rngs, concrete=False, prevent_cse=prevent_cse,
      static_argnums=tuple(static_argnums), policy=policy, methods=methods)


# -- the other names of flax.linen.partitioning --------------------------------
# Code written for Linen reaches these as attributes of
# flax.linen.partitioning. ``nn`` (the package) sits above this module in the
# layer map; liftmods/__init__.py binds it.
# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
import functools
from typing import Optional, Tuple
# pylint: enable=g-import-not-at-top,wrong-import-position,unused-import

# Names of flax.linen.partitioning that mean nothing in liftmods, and why.
from liftmods import linen_names  # pylint: disable=g-import-not-at-top,wrong-import-position

_LINEN_ONLY = {
    **linen_names.shared('flax', 'struct'),
}


__getattr__ = linen_names.not_provided(__name__, 'flax.linen.partitioning',
                                        _LINEN_ONLY)
