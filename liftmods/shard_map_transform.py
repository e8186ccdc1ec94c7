"""``nn.shard_map``: a module run once per shard of a device mesh.

Linen has no lifted ``shard_map``: code that needs collectives of its own
(ring attention, expert-parallel layers, custom reductions) leaves the
module system for ``jax.shard_map`` and threads the variables by hand. Here
the module stays a module. Its body sees one device's block of every input
and variable, and its variables cross the boundary with specs read from
their partitioning metadata through the active logical-axis rules (see
``liftmods.core.shard_map`` for the order in which specs are looked up).

>>> import jax, jax.numpy as jnp, liftmods as nn
>>> from jax.sharding import PartitionSpec as P
>>> class Local(nn.Module):
...   @nn.compact
...   def __call__(self, x):  # x: one shard's rows
...     w = self.param('w', nn.with_logical_partitioning(
...         nn.initializers.ones, ('embed',)), (x.shape[-1],))
...     return jax.lax.psum((x * w).sum(), 'data')
>>> mesh = jax.make_mesh((1,), ('data',),
...                      axis_types=(jax.sharding.AxisType.Auto,))
>>> Sharded = nn.shard_map(Local, mesh=mesh, in_specs=P('data'),
...                        out_specs=P(), split_rngs={'params': False})
>>> x = jnp.ones((4, 3))
>>> v = Sharded().init(jax.random.key(0), x)
>>> float(Sharded().apply(v, x))
12.0
"""
from collections.abc import Mapping
from typing import Any

from jax.sharding import PartitionSpec

from liftmods.core import shard_map as core_shard_map
from liftmods.core.frozen_dict import FrozenDict
from liftmods.spmd import LogicallyPartitioned, logical_to_mesh_axes
from liftmods.transforms import Methods, Target, lift_transform

__all__ = ['shard_map', 'mesh_spec']


def mesh_spec(box: Any) -> PartitionSpec:
  """The mesh ``PartitionSpec`` of a partitioning box.

  Args:
    box: a ``Partitioned`` box (mesh axis names) or a
      ``LogicallyPartitioned`` one (logical names, mapped through the box's
      rules or the context's; a name no rule maps is replicated, as in
      ``logical_to_mesh_axes``).

  Returns:
    The spec.
  """
  if isinstance(box, LogicallyPartitioned):
    return logical_to_mesh_axes(box.names, box.rules)
  return box.get_partition_spec()


def shard_map(target: Target, mesh: Any = None, in_specs: Any = (),
              out_specs: Any = PartitionSpec(),
              variable_specs: Mapping[Any, Any] = FrozenDict({True: None}),
              split_rngs: Mapping[Any, Any] = FrozenDict(),
              axis_names: Any = None, check_vma: bool = True,
              methods: Methods = None) -> Target:
  """Runs ``target`` once per shard of a mesh (``jax.shard_map`` with
  variables).

  Inside, every argument and variable is one device's block, and
  collectives over the mesh axes (``lax.psum``, ``lax.ppermute``,
  ``lax.all_to_all``, ``lax.axis_index``) work as in ``jax.shard_map``.

  Args:
    target: a Module class, or a function ``fn(module, *args)``.
    mesh: the mesh (None: the one set with ``jax.set_mesh``).
    in_specs: the spec of each positional argument after the module (a
      single spec for a single argument), as ``jax.shard_map``'s.
    out_specs: the output's spec (tree prefix).
    variable_specs: ``{collection filter: rule}``. A rule of None takes
      each variable's spec from its partitioning metadata
      (``nn.with_partitioning``, ``nn.with_logical_partitioning`` mapped
      through the active rules); a ``PartitionSpec`` applies to every
      variable of those collections (``PartitionSpec()``: replicated); a
      callable ``rule(collection, path, value)`` returns one. Collections
      no filter matches are not visible inside.
    split_rngs: ``{rng filter: split}``: True gives each shard its own key
      of that sequence, a mesh axis name (or tuple of names) keys that
      differ along those axes only, False the same key on every shard.
      Initialise a variable with keys split over no axis it is replicated
      along (``split_rngs={'params': 'model'}`` for parameters sharded over
      ``'model'`` only).
    axis_names: the mesh axes that are manual inside (None: all of them).
    check_vma: as in ``jax.shard_map``: checks that outputs declared
      replicated are.
    methods: for a Module class, the methods to transform.

  Returns:
    A subclass of ``target`` whose methods run per shard, or the lifted
      function.

  Raises:
    ShardMapSpecError: a variable has neither metadata nor a rule, or its
      spec names an axis that is not manual inside.
    MeshAxisNotFoundError: a variable's spec names an axis the mesh lacks.
    ShardingDivisibilityError: a sharded dimension does not divide.
  """
  specs = in_specs if isinstance(in_specs, tuple) else (in_specs,)
  return lift_transform(
      core_shard_map.shard_map, 'ShardMap', target, mesh, specs, out_specs,
      variable_specs=dict(variable_specs), split_rngs=dict(split_rngs),
      axis_names=axis_names, check_vma=check_vma, box_spec=mesh_spec,
      methods=methods)
