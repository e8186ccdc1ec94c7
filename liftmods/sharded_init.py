"""Sharded initialisation in one call: every parameter is created directly
in its shards on the mesh, never whole on one device.

``init_sharded(module, mesh, rules)(rngs, *args)`` traces ``module.init``
abstractly, reads each variable's partitioning from its box
(``Partitioned``: mesh axis names; ``LogicallyPartitioned``: logical names
mapped through ``rules``; a plain array: replicated), checks it against the
mesh, and runs ``init`` under ``jax.jit`` with those ``out_shardings``. With
JAX's partitionable threefry (``jax_threefry_partitionable``, on by default)
XLA generates each shard's random bits where the shard lives, and the values
equal an unsharded ``module.init`` with the same key.

>>> import jax, jax.numpy as jnp
>>> import liftmods as nn
>>> mesh = jax.make_mesh((1,), ('model',),
...                      axis_types=(jax.sharding.AxisType.Auto,))
>>> dense = nn.Dense(4, kernel_init=nn.with_logical_partitioning(
...     nn.initializers.lecun_normal(), ('embed', 'mlp')))
>>> rules = (('embed', None), ('mlp', 'model'))  # 'embed' replicated
>>> variables, shardings = nn.init_sharded(dense, mesh, rules)(
...     jax.random.key(0), jnp.ones((2, 3)))
>>> shardings['params']['kernel'].spec
P(None, 'model')
>>> bool((variables['params']['kernel'] ==
...       nn.unbox(dense.init(jax.random.key(0), jnp.ones((2, 3))))['params']
...       ['kernel']).all())
True
"""
import difflib
import math
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from liftmods import errors, pipeline as pipelining
from liftmods.core import caching, meta
from liftmods.traceback_util import api_boundary
from liftmods.call_context import active_interceptors, calls, is_array
from liftmods.spmd import (UNASSIGNED, LogicalRules, LogicallyPartitioned,
                           RulesFallback, assign_mesh_axes,
                           get_logical_axis_rules, logical_axis_rules,
                           record_constraint_names)


class LogicalNamesWarning(UserWarning):
  """``init_sharded`` found a logical axis name of the model that no rule
  maps (so that dimension is replicated), or a rule whose name the model
  never uses: most often a typo."""


# Prepared inits kept per ``init_sharded`` function (each entry holds a
# ``jax.jit`` and, once called, its compiled program).
PREPARED_LIMIT = 8
PREPARED_POLICY = caching.Policy(
    holds='the shardings and the `jax.jit` of one `init_sharded(...)` '
          'function, per call signature',
    keyed_on='structure and plain values of the arguments, shapes and '
             'dtypes of their arrays, rules, active interceptors',
    bound=f'{PREPARED_LIMIT} entries per `init_sharded` function',
    cleared='on eviction; with the function')
caching.register('sharded_init.init_sharded.prepared', PREPARED_POLICY,
                 clear=caching.clear_bounded_caches)


def init_sharded(module: Any, mesh: jax.sharding.Mesh,
                 rules: LogicalRules | None = None, *, unbox: bool = True,
                 fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
                 warn_unmapped: bool = True,
                 **init_kwargs: Any) -> Callable[..., tuple[Any, Any]]:
  """Returns ``fn(rngs, *args, **kwargs) -> (variables, shardings)``.

  ``variables`` are ``module.init(rngs, *args, **init_kwargs, **kwargs)``
  created sharded over ``mesh`` (unboxed unless ``unbox=False``);
  ``shardings`` is the matching tree of ``NamedSharding``s, ready for a
  train step's ``in_shardings`` / ``out_shardings``. ``rules`` (default: the
  rules context) map logical names; a logical name no rule maps is
  replicated, or raises ``LogicalAxisUnmappedError`` with
  ``fallback=RulesFallback.RAISE_ERROR``. A spec naming a mesh axis the mesh
  lacks, or sharding a dimension its mesh axes do not divide, raises a
  ``ShardingError`` naming the variable's module path.

  A call traces the model (and compiles it) once per call signature: later
  calls with arguments of the same shapes, dtypes and plain values, under
  the same rules, reuse the shardings and the compiled init.

  The first call checks the model's logical names against the rules and
  warns once (``LogicalNamesWarning``) when a model name matches no rule or
  a rule's name matches nothing in the model: no variable's names and no
  ``with_logical_constraint`` call made while the model initializes (so a
  rule for activations, ``('batch', 'data')``, counts as used when the
  model constrains its activations with it). The warning names them, with
  the model name a misspelled rule name resembles. Map a name that should
  be replicated to ``None`` (``('embed', None)``), drop rules the model
  does not use, or pass ``warn_unmapped=False``, to silence it.

  Every variable of a pipelined ``nn.Stack`` has its layer axis (axis 0)
  on the pipeline's stage axis, annotated or not (``docs/pipeline.md``).

  Args:
    module: the Module to initialize.
    mesh: the mesh the variables are created on.
    rules: ``(logical name, mesh axes)`` pairs; None takes the rules
      context's.
    unbox: return the variables without their partitioning boxes.
    fallback: what a logical name no rule maps gives: replicated
      (``AXIS_IS_UNSHARDED``) or a ``LogicalAxisUnmappedError``
      (``RAISE_ERROR``).
    warn_unmapped: warn once about model names no rule maps and rule names
      the model never uses.
    **init_kwargs: passed to ``module.init`` on every call.

  Returns:
    ``fn(rngs, *args, **kwargs) -> (variables, shardings)``; ``fn.lower``
      takes the same arguments and returns ``(jax.stages.Lowered,
      shardings)``.
  """
  checked = not warn_unmapped
  if not jax.config.jax_threefry_partitionable:
    warnings.warn(
        'jax_threefry_partitionable is off: random initializers may be '
        'computed at full size before being sharded. Enable it with '
        'jax.config.update("jax_threefry_partitionable", True).')

  prepared = caching.BoundedCache(
      PREPARED_LIMIT, name='sharded_init.init_sharded.prepared',
      policy=PREPARED_POLICY)

  def prepare(rngs, args, kwargs):
    active = get_logical_axis_rules() if rules is None else rules
    dynamic, signature, rebuild = _split_call((rngs, args, kwargs), active)
    hit = None
    if signature is not None:
      try:
        hit = prepared.get(signature)
      except TypeError:  # an unhashable plain argument
        signature = None
    if hit is not None:
      return hit[0], dynamic, hit[1], active

    def call(dynamic):
      rngs, args, kwargs = rebuild(dynamic)
      return module.init(rngs, *args, **init_kwargs, **kwargs)

    def run(dynamic):
      variables = call(dynamic)
      return _strip(variables) if unbox else variables

    with (logical_axis_rules(active), record_constraint_names() as seen,
          pipelining.record_stage_axes() as stacks):
      boxed = jax.eval_shape(call, dynamic)
      shardings = mesh_shardings(boxed, mesh, active, fallback, stacks)
    nonlocal checked
    if not checked:
      checked = True
      _warn_unmatched(boxed, active, tuple(seen), stacklevel=4)
    jitted = jax.jit(run, out_shardings=shardings)
    if signature is not None:
      prepared[signature] = jitted, shardings
    return jitted, dynamic, shardings, active

  @api_boundary
  def init_fn(rngs, *args, **kwargs):
    jitted, dynamic, shardings, active = prepare(rngs, args, kwargs)
    with logical_axis_rules(active):
      return jitted(dynamic), shardings

  @api_boundary
  def lower(rngs, *args, **kwargs):
    """``(jax.stages.Lowered, shardings)`` of the sharded init, e.g. for
    ``.compile().memory_analysis()``."""
    jitted, dynamic, shardings, active = prepare(rngs, args, kwargs)
    with logical_axis_rules(active):
      return jitted.lower(dynamic), shardings

  init_fn.lower = lower
  return init_fn


_ARRAY = object()  # where an array leaf sits among the static leaves


def _split_call(tree, rules):
  """The array leaves of a call's arguments, the call's signature, and a
  function putting new array leaves back into the arguments.

  The signature is what a prepared init depends on besides the module: the
  tree structure, each plain leaf with its type (so ``1`` and ``True``
  differ), each array's shape, dtype and weak type, the rules and the
  active interceptors. It is None, and the call is prepared afresh, when
  something in this thread watches the trace (a recording block, a
  capture, a running module): a reused trace would show it nothing. A
  signature that cannot be hashed (an unhashable plain argument) is found
  so by the cache lookup, and that call is prepared afresh too.
  ``rebuild`` keeps the plain leaves only, never the arrays, so a kept
  entry holds no argument's buffers.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays, static, parts = [], [], []
  for x in leaves:  # one pass: is_array once per leaf
    if is_array(x):
      arrays.append(x)
      static.append(_ARRAY)
      parts.append((x.shape, x.dtype, bool(getattr(x, 'weak_type', False))))
    else:
      static.append(x)
      parts.append((type(x), x))

  def rebuild(new_arrays):
    new = iter(new_arrays)
    return treedef.unflatten([next(new) if x is _ARRAY else x
                              for x in static])

  if (calls.records or calls.capture_stack
      or calls.module_stack[-1] is not None):
    return arrays, None, rebuild
  signature = (treedef, tuple(parts), tuple(tuple(r) for r in rules),
               active_interceptors())
  return arrays, signature, rebuild


def mesh_shardings(boxed: Any, mesh: jax.sharding.Mesh,
                   rules: LogicalRules = (),
                   fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
                   stacks: Mapping[tuple, str] | None = None) -> Any:
  """The NamedSharding over ``mesh`` of every variable, checked against the mesh.

  Args:
    boxed: a tree of boxes, arrays or ShapeDtypeStructs.
    mesh: the device mesh.
    rules: the logical-to-mesh rules.
    fallback: what a logical name no rule maps gives.
    stacks: the module path of each pipelined stack mapped to its stage
      axis (``pipeline.record_stage_axes``); every variable under such a
      path has its layer axis on the stage axis, annotated or not.

  Returns:
    The tree of NamedShardings.

  Raises:
    ShardingError: a spec names a mesh axis the mesh lacks, or its axes do
      not divide the dimension.
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=meta.is_axis_metadata)
  out = [_leaf_sharding(path, leaf, mesh, rules, fallback, stacks or {})
         for path, leaf in paths]
  return treedef.unflatten(out)


def _stage_axis(path, stacks):
  """The stage axis of the pipelined stack holding the variable at key
  ``path`` (collection, module names..., variable name), or None."""
  names = tuple(_key_names(path)[1:-1])
  for prefix, axis in stacks.items():
    if names[:len(prefix)] == prefix:
      return axis
  return None


def _leaf_sharding(path, leaf, mesh, rules, fallback, stacks):
  value = leaf
  while isinstance(value, meta.AxisMetadata):
    value = (value.unbox(apply_constraint=False)
             if isinstance(value, meta.Partitioned) else value.unbox())
  if not hasattr(value, 'shape'):
    return None
  if isinstance(leaf, LogicallyPartitioned):
    spec = _logical_spec(path, leaf, rules, fallback)
  elif isinstance(leaf, meta.Partitioned):
    spec = leaf.get_partition_spec()
  else:
    spec = PartitionSpec()
  axis = _stage_axis(path, stacks)
  if axis is not None:
    spec = pipelining.stage_spec(_where(path), spec, np.ndim(value), axis)
  _check(path, np.shape(value), spec, mesh)
  return NamedSharding(mesh, spec)


def _logical_spec(path, box, rules, fallback):
  rules = box.rules if box.rules is not None else rules
  axes = assign_mesh_axes(box.names, rules)
  if any(a is UNASSIGNED for a in axes):
    if fallback == RulesFallback.RAISE_ERROR:
      unmapped = [n for n, a in zip(box.names, axes) if a is UNASSIGNED]
      raise errors.LogicalAxisUnmappedError(_where(path), box.names, rules,
                                            unmapped)
    axes = [None if a is UNASSIGNED else a for a in axes]
  return PartitionSpec(*axes)


def logical_name_mismatches(boxed: Any,
                            rules: LogicalRules) -> tuple[tuple, tuple]:
  """The model's logical names no rule maps, and the rule names no box uses.

  A box that carries its own rules is checked against those.

  Args:
    boxed: a tree that may hold LogicallyPartitioned boxes.
    rules: the rules.

  Returns:
    ``(model_only, rules_only)``.

  >>> import jax.numpy as jnp, liftmods as nn
  >>> box = nn.with_logical_partitioning(jnp.zeros, ('embed', 'mlp'))((2, 3))
  >>> logical_name_mismatches({'kernel': box},
  ...                         (('embed', 'fsdp'), ('mpl', 'tensor')))
  (('mlp',), ('mpl',))
  """
  boxes = _logical_boxes(boxed)
  return _mismatches(boxes, _box_names(boxes), rules)


def _mismatches(boxes, names, rules):
  """``logical_name_mismatches`` of the LogicallyPartitioned ``boxes``,
  whose names (``_box_names``) are ``names``."""
  rule_names = tuple(dict.fromkeys(rule[0] for rule in rules))
  model_only = {}
  for box in boxes:
    known = (rule_names if box.rules is None
             else {rule[0] for rule in box.rules})
    model_only.update((n, None) for n in _names(box) if n not in known)
  used = set(names)
  return tuple(model_only), tuple(n for n in rule_names if n not in used)


def model_names(boxed: Any) -> tuple:
  """Every logical axis name of the boxes in ``boxed``, in order met.

  Args:
    boxed: a tree that may hold LogicallyPartitioned boxes.

  Returns:
    The names.
  """
  return _box_names(_logical_boxes(boxed))


def _box_names(boxes):
  names = {}
  for box in boxes:
    names.update((n, None) for n in _names(box))
  return tuple(names)


def _logical_boxes(boxed):
  leaves = jax.tree_util.tree_leaves(boxed, is_leaf=meta.is_axis_metadata)
  return [x for x in leaves if isinstance(x, LogicallyPartitioned)]


def _names(box):
  return [n for n in box.names if isinstance(n, str)]


def _warn_unmatched(boxed, rules, constrained, stacklevel):
  boxes = _logical_boxes(boxed)  # the one walk of the tree
  names = _box_names(boxes)
  model_only, rules_only = _mismatches(boxes, names, rules)
  used = names + constrained
  rules_only = tuple(n for n in rules_only if n not in constrained)
  if not model_only and not rules_only:
    return
  parts = []
  if model_only:
    parts.append(f'the model\'s logical axis names {model_only} match no '
                 'rule, so those dimensions are replicated')
  if rules_only:
    hints = [f'{n!r} (did you mean {close[0]!r}?)' if close else repr(n)
             for n in rules_only
             for close in [difflib.get_close_matches(n, used, n=1)]]
    parts.append(f'the rules\' names {", ".join(hints)} match no variable '
                 'and no with_logical_constraint of the model')
  warnings.warn(
      f'init_sharded: {"; ".join(parts)}. Fix the spelling, map a name to '
      'None to replicate it on purpose, drop rules the model does not use, '
      'or pass warn_unmapped=False.',
      LogicalNamesWarning, stacklevel=stacklevel + 1)


def _check(path, shape, spec, mesh):
  if len(spec) > len(shape):
    raise errors.ShardingError(
        f'{_where(path)}: partition spec {spec} has {len(spec)} entries but '
        f'the variable has shape {tuple(shape)}.')
  for dim, entry in enumerate(spec):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      continue
    axes = entry if isinstance(entry, tuple) else (entry,)
    for axis in axes:
      if axis not in mesh.shape:
        raise errors.MeshAxisNotFoundError(_where(path), spec, axis,
                                           mesh.axis_names)
    size = math.prod(mesh.shape[a] for a in axes)
    if shape[dim] % size:
      raise errors.ShardingDivisibilityError(_where(path), shape, spec, dim,
                                             size)


def _key_names(path) -> list:
  return [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))))
          for k in path]


def _where(path) -> str:
  """'Variable "kernel" of collection "params" at /Dense_0' from a key path."""
  keys = _key_names(path)
  if len(keys) < 2:
    return f'Variable {"/".join(keys)!r}'
  col, *module_path, name = keys
  return (f'Variable "{name}" of collection "{col}" at '
          f'/{"/".join(module_path)}')


def _strip(tree):
  """Removes every box without applying its sharding constraint."""
  def one(box):
    inner = (box.unbox(apply_constraint=False)
             if isinstance(box, meta.Partitioned) else box.unbox())
    return _strip(inner)
  return meta.map_axis_meta(one, tree)
