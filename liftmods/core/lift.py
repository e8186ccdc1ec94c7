"""Lifted transforms: JAX transforms applied to functions of scopes.

A scope function ``fn(scope, *args)`` reads and writes variables through its
scope, so it cannot be handed to a JAX transform as it is; ``pack``
(``core.pack``) carries its variables and keys across the boundary as plain
pytrees, and every transform below is a short function over it.

Variable groups are tuples (one entry per collection filter) of tuples (one
entry per distinct outer scope) of ``{collection: variables}`` dicts. RNG
groups have the same layout with ``{sequence_name: key}`` dicts holding plain
JAX keys; the static part of each sequence (the scope names folded into it
lazily) stays outside the transform and is re-attached by ``make_scopes``.

PRNG sequences and their counters behave exactly as in Flax: the inner scope
shares the counters of the outer one, so a transform that traces its body
twice (scan does, to initialise broadcast variables) advances them twice, and
the keys drawn are bit-identical to ``flax.core.lift``.

This module holds map_variables, vmap, scan, the loops and branches and
remat; the rest lives next to it and is re-exported here: ``pack`` and the
axis markers (``core.pack``), scan's loop engine (``core.axes_scan``), the
loop over stacked layers (``core.layer_scan``), rng counter snapshots
(``core.rng_counters``), ``jit``/``fold_rngs``
(``core.lifted_jit``) and the differentiation transforms
(``core.autodiff``).

>>> import jax, jax.numpy as jnp
>>> from liftmods.core import init, lift
>>> def dense(scope, x):
...   w = scope.param('w', jax.nn.initializers.normal(), (x.shape[-1], 2))
...   return x @ w
>>> stacked = lift.vmap(dense, variable_axes={'params': 0},
...                     split_rngs={'params': True})
>>> y, variables = init(stacked)(jax.random.key(0), jnp.ones((4, 3)))
>>> y.shape, variables['params']['w'].shape
((4, 2), (4, 3, 2))
"""
import contextlib
import functools
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import jax
from jax import lax
from jax import random

from liftmods import errors
from liftmods.core import meta
from liftmods.core.autodiff import custom_vjp, jvp, value_and_grad, vjp
from liftmods.core.axes_scan import (add_axis, check_carry, remove_axis,
                                     runs_first_trace, scan_with_broadcast,
                                     slice_groups)
from liftmods.core.filters import in_filter, intersect, is_empty, subtract
from liftmods.core.frozen_dict import FrozenDict  # pylint: disable=unused-import
from liftmods.core.layer_scan import layer_scan
from liftmods.core.lifted_jit import fold_rngs, jit
from liftmods.core.pack import T  # pylint: disable=unused-import
from liftmods.core.pack import (In, Out, broadcast, check_variable_axes,
                                first_mapped_size, flat_axes, has_rngs,
                                infer_axis_size, outer_scopes, pack,
                                split_in_out_axes, split_keys, thaw, typeof,
                                unzip2, var_name)
from liftmods.core.rng_counters import (RngReplay, restore_scopes,
                                         snapshot_scopes)
from liftmods.core.rngs import LazyKey  # pylint: disable=unused-import
from liftmods.core.scan_peel import peel
from liftmods.core.scope import Scope, created_variables

__all__ = [
    'In', 'Out', 'broadcast', 'pack', 'map_variables', 'swap_collection',
    'vmap', 'scan', 'while_loop', 'fori_loop', 'cond', 'switch', 'checkpoint',
    'remat', 'remat_scan', 'jit', 'fold_rngs', 'custom_vjp', 'vjp', 'jvp',
    'value_and_grad', 'layer_scan',
]


# -- map_variables / swap_collection --------------------------------------------


def _identity(x):
  return x


id_fn = _identity


def map_variables(fn: Callable[..., Any], mapped_collections,
                  map_in_fn: Callable[..., Any] = _identity,
                  map_out_fn: Callable[..., Any] = _identity,
                  init: bool = False, mutable: bool = False, rngs=True,
                  variables=True):
  """Lets ``fn`` see ``map_in_fn`` of the collections ``mapped_collections``.

  ``map_in_fn``/``map_out_fn`` take and return ``{collection: variables}``
  for one scope. With ``mutable`` the body may write the mapped collections
  and ``map_out_fn`` maps what it wrote back; with ``init`` the body first
  runs unmapped once so that it can create them.
  """
  writes_target = mutable or init

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, *args,
            **kwargs):
    target, other = variable_groups
    if init:
      scopes = make_scopes((target, other), rng_groups)
      if any(not is_empty(s.mutable)
             for s in jax.tree_util.tree_leaves(
                 scopes, is_leaf=lambda x: isinstance(x, Scope))):
        fn(scopes, *args, **kwargs)
        created, _ = repack_fn(scopes)
        target = tuple(_keep_read_only(given, map_out_fn(made))
                       for given, made in zip(target, created))
    target = tuple(map_in_fn(thaw(x)) for x in target)
    narrow = True if writes_target else subtract(True, mapped_collections)
    scopes = make_scopes((target, other), rng_groups, mutable_filter=narrow)
    y = fn(scopes, *args, **kwargs)
    out_target, out_other = repack_fn(scopes)
    if writes_target:
      out_target = tuple(map_out_fn(x) for x in out_target)
    return y, (out_target, out_other)

  in_groups = (mapped_collections, variables)
  if writes_target:
    out_groups = in_groups
  else:
    out_groups = (False, subtract(variables, mapped_collections))
  return pack(inner, in_groups, out_groups, (rngs,), name='map_variables',
              enable_kwargs=True)


def _keep_read_only(given: dict, created: dict) -> dict:
  """The mapped collections after map_variables' init pass.

  The pass returns only the collections it could write; the read-only ones
  it was given stay as they were (Linen drops them, so the body then finds
  them empty: flax#2773).
  """
  kept = {col: x for col, x in given.items() if col not in created}
  return {**kept, **created}


def swap_collection(fn: Callable[..., Any], col_a: str, col_b: str):
  """Runs ``fn`` with collections ``col_a`` and ``col_b`` exchanged."""

  def swap(target):
    a = target.get(col_a, {})
    b = target.get(col_b, {})
    target[col_a], target[col_b] = b, a
    return target

  return map_variables(fn, (col_a, col_b), swap, swap, mutable=True)


@contextlib.contextmanager
def axis_owner(transform: str, path: str | None = None):
  """Names ``transform`` in a ``PartitioningUnspecifiedError`` raised inside.

  The innermost transform that adds or removes the axis names itself; an
  error already naming one passes through unchanged.

  Args:
    transform: the name the error's advice gives, e.g. ``'scan'``.
    path: the module path of the transformed scope, if known.

  Yields:
    Nothing; the block runs as it is.
  """
  try:
    yield
  except errors.PartitioningUnspecifiedError as e:
    if e.transform is not None:
      raise
    raise errors.PartitioningUnspecifiedError(e.target, transform,
                                              path) from None


# -- vmap ---------------------------------------------------------------------------


def vmap(fn: Callable[..., Any], variable_axes: Mapping, split_rngs: Mapping,
         in_axes: Any = 0, out_axes: Any = 0, axis_size: int | None = None,
         axis_name: str | None = None, spmd_axis_name: str | None = None,
         metadata_params: dict = {}  # pylint: disable=dangerous-default-value
         ) -> Callable[..., Any]:
  """``jax.vmap`` for scope functions.

  Args:
    fn: ``fn(scope, *args)``.
    variable_axes: ``{collection filter: axis}``; the axis the variables
      are stacked on (None: shared by all batch elements).
    split_rngs: ``{rng filter: bool}``: whether each batch element gets its
      own key (only the sequences listed are available inside).
    in_axes: as in ``jax.vmap``.
    out_axes: as in ``jax.vmap``.
    axis_size: as in ``jax.vmap``.
    axis_name: as in ``jax.vmap``.
    spmd_axis_name: as in ``jax.vmap``.
    metadata_params: passed to boxed variables (``meta.AxisMetadata``)
      when the axis is added or removed.

  Returns:
    The vectorized ``f(scope, *args)``.
  """
  var_in, var_out = split_in_out_axes(variable_axes)
  in_filters, var_in_axes = unzip2(var_in.items())
  out_filters, var_out_axes = unzip2(var_out.items())
  rng_filters, rng_splits = unzip2(split_rngs.items())
  rng_axes = tuple(0 if split else None for split in rng_splits)

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, *args):
    scopes = outer_scopes(make_scopes)
    with axis_owner('vmap', scopes[0].path_text):
      variable_groups = tuple(
          remove_axis(group, axis, metadata_params) if axis is not None
          else group for group, axis in zip(variable_groups, var_in_axes))

    size, source = infer_axis_size('vmap', 'batch size', 'inputs', in_axes,
                                   args, None, axis_size, 'axis_size')
    if size is None:
      size = first_mapped_size(variable_groups, var_in_axes)
      source = 'the batch size of the other mapped variables'
      if size is None:
        raise ValueError('vmap: cannot tell the batch size; pass axis_size.')
    check_variable_axes('vmap', scopes, variable_groups, var_in_axes, size,
                        source)

    reshard_to = None
    if spmd_axis_name is not None:
      flat_args = jax.tree_util.tree_leaves(args)
      for x, axis in zip(flat_args, flat_axes(in_axes, args)):
        if axis is None:
          continue
        spec = getattr(getattr(jax.typeof(x), 'sharding', None), 'spec', ())
        if len(spec) > axis and spec[axis] == spmd_axis_name:
          reshard_to = spmd_axis_name
          break
    rng_groups = tuple(
        split_keys(group, size, reshard_to) if split else group
        for group, split in zip(rng_groups, rng_splits))

    @functools.wraps(fn)
    def mapped(variable_groups, rng_groups, args):
      scope = make_scopes(variable_groups, rng_groups)
      y = fn(scope, *args)
      return y, repack_fn(scope)

    y, out_groups = jax.vmap(
        mapped, in_axes=(var_in_axes, rng_axes, in_axes),
        out_axes=(out_axes, var_out_axes), axis_name=axis_name,
        axis_size=axis_size, spmd_axis_name=spmd_axis_name)(
            variable_groups, rng_groups, args)
    with axis_owner('vmap', scopes[0].path_text):
      out_groups = tuple(
          add_axis(group, axis, metadata_params) if axis is not None
          else group for group, axis in zip(out_groups, var_out_axes))
    return y, out_groups

  return pack(inner, in_filters, out_filters, rng_filters, name='vmap')


def scan(fn: Callable[..., Any], variable_axes: Mapping = {},  # pylint: disable=dangerous-default-value
         variable_broadcast: Any = False, variable_carry: Any = False,
         split_rngs: Mapping = {},  # pylint: disable=dangerous-default-value
         in_axes: Any = 0, out_axes: Any = 0, length: int | None = None,
         reverse: bool = False, unroll: int = 1,
         _split_transpose: bool = False,
         data_transform: Callable[..., Any] | None = None,
         metadata_params: dict = {},  # pylint: disable=dangerous-default-value
         check_constancy_invariants: bool = True, *,
         _axis_owner: str = 'scan') -> Callable[..., Any]:
  """``jax.lax.scan`` for scope functions ``fn(scope, carry, *xs) -> (carry, ys)``.

  Args:
    fn: the body, ``fn(scope, carry, *xs) -> (carry, ys)``.
    variable_axes: ``{collection filter: axis}``; those collections get one
      slice per iteration, stacked on the axis.
    variable_broadcast: collections that are the same for all iterations;
      one run of the body outside the loop creates them, so they must not
      depend on the carry or the scanned inputs.
    variable_carry: collections threaded through the iterations.
    split_rngs: ``{rng filter: bool}``: which sequences get a different key
      per iteration.
    in_axes: the scanned axis of each input (``broadcast``, or None as in
      ``vmap``: passed whole to every iteration).
    out_axes: the axis the ``ys`` are stacked on.
    length: the number of iterations, when nothing is scanned.
    reverse: iterate from the end.
    unroll: iterations per loop step.
    _split_transpose: accepted for Linen compatibility.
    data_transform: ``(variable groups, rngs) -> (variable groups, rngs)``
      applied to what each iteration sees.
    metadata_params: passed to boxed variables when the axis is added or
      removed.
    check_constancy_invariants: trace the body once more to check that
      broadcast variables stay constant.
    _axis_owner: the transform a missing partition name is blamed on
      (``remat_scan`` loops through scan).

  Returns:
    ``f(scope, carry, *xs) -> (carry, ys)``.

  Raises:
    TypeError: a variable axis is not an int.
  """
  var_in, var_out = split_in_out_axes(variable_axes)
  in_filters, var_in_axes = unzip2(var_in.items())
  out_filters, var_out_axes = unzip2(var_out.items())
  for axis in var_in_axes + var_out_axes:
    if not isinstance(axis, int):
      raise TypeError(f'scan: variable axes must be ints, got {axis!r}')
  rng_filters, rng_splits = unzip2(split_rngs.items())
  rng_axes = tuple(0 if split else broadcast for split in rng_splits)
  # None means "not scanned", as in vmap's in_axes (Linen: a pytree error).
  in_axes = jax.tree_util.tree_map(
      lambda a: broadcast if a is None else a, in_axes,
      is_leaf=lambda a: a is None)

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, init, *args):
    scopes = outer_scopes(make_scopes)
    n, source = infer_axis_size('scan', 'length', 'scanned inputs', in_axes,
                                args, broadcast, length, 'length')
    if n is None:
      raise ValueError('scan: cannot tell the number of iterations; pass '
                       'length= or scanned inputs.')

    broadcast_vars, carry_vars = variable_groups[0], variable_groups[1]
    with axis_owner(_axis_owner, scopes[0].path_text):
      scan_vars, rng_groups = slice_groups(
          'scan', scopes, variable_groups[2:], var_in_axes, rng_groups,
          rng_splits, n, source, metadata_params)

    def body(broadcast_in, carry, scan_in, rngs, xs, creates=False):
      carry_in, c = carry
      groups = (broadcast_in, carry_in) + tuple(scan_in)
      if data_transform is not None:
        groups, rngs = data_transform(groups, rngs)
      scope = make_scopes(groups, rngs)
      result = fn(scope, c, *xs)
      if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise errors.ScanCarryError(
            f'scan at {scopes[0].path_text}: the body must return a pair '
            f'(carry, ys), got {type(result).__name__}.')
      c_out, ys = result
      out = repack_fn(scope)
      broadcast_out, carry_out, scan_out = out[0], out[1], out[2:]
      for group_in, group_out in zip(broadcast_in, broadcast_out):
        for col, collection in group_in.items():
          if col not in group_out:
            group_out[col] = collection  # read-only ones must stay available
      # The peeled first iteration may create carried variables.
      check_carry('scan', scopes, carry_out if creates else carry_in,
                  carry_out, c, c_out)
      return broadcast_out, (carry_out, c_out), (ys, scan_out)

    explain = functools.partial(_explain_broadcast, scopes)

    mutable_broadcast = any(
        not is_empty(intersect(s.mutable, variable_broadcast)) for s in scopes)
    rngs_cross = has_rngs(rng_groups)
    replay = None
    if rngs_cross and not mutable_broadcast:
      # The constancy check's extra trace advances rng counters, so runs
      # with and without it replay differently.
      site = (getattr(fn, '__code__', None),
              jax.tree_util.tree_structure((args, init)),
              check_constancy_invariants)
      replay = RngReplay(scopes, site)
    loop_axes = dict(in_axes=(var_in_axes, rng_axes, in_axes),
                     out_axes=(out_axes, var_out_axes))

    writes_broadcast = mutable_broadcast or rngs_cross

    def looped(iterations, b_in, carry, *xs, replay=None):
      return scan_with_broadcast(
          body, **loop_axes, length=iterations, reverse=reverse,
          unroll=unroll, split_transpose=_split_transpose,
          check_invariants=check_constancy_invariants, explain=explain,
          writes_broadcast=writes_broadcast,
          rng_replay=replay)(b_in, carry, *xs)

    # As in the loop: broadcast variables come from a first trace, and the
    # iteration itself draws its keys at the rng counters that trace left.
    two_traces = runs_first_trace(loop_axes['out_axes'],
                                  check_constancy_invariants,
                                  writes_broadcast)

    def first_iteration(b_in, carry, *xs):
      if two_traces:
        b_in = body(b_in, carry, *xs, creates=True)[0]
      out = body(b_in, carry, *xs, creates=True)
      if n > 1:
        restore_scopes(scopes, counters)  # the rest of the loop redraws
      return out

    inputs = (broadcast_vars, (carry_vars, init), scan_vars, rng_groups, args)
    # Only a scope that may write a carried collection can create one (the
    # snapshot walks every counter: not on the apply path).
    counters = snapshot_scopes(scopes) if any(
        not is_empty(intersect(s.mutable, variable_carry))
        for s in scopes) else None
    try:
      out = looped(length, *inputs, replay=replay)
    except errors.ScanCarryError as err:
      if counters is None or not getattr(err, 'created', False):
        raise
      restore_scopes(scopes, counters)
      out = peel(first_iteration, looped, *loop_axes.values(), n, reverse,
                 *inputs)
    broadcast_vars, (carry_vars, c), (ys, scan_out) = out
    with axis_owner(_axis_owner, scopes[0].path_text):
      scan_out = tuple(add_axis(group, axis, metadata_params)
                       for group, axis in zip(scan_out, var_out_axes))
    return (c, ys), (broadcast_vars, carry_vars) + scan_out

  return pack(inner, (variable_broadcast, variable_carry) + in_filters,
              (variable_broadcast, variable_carry) + out_filters,
              rng_filters, name='scan')


def _explain_broadcast(scopes, path, created_unchecked=False):
  """The message for a broadcast value of a scan that is not loop
  invariant; ``path`` leads to it in ``(broadcast variables, ys)``."""
  if path[0].idx == 0 and len(path) >= 3:
    scope = scopes[path[1].idx]
    col = path[2].key
    what = (f'scan at {scope.path_text}: broadcast variable '
            f'"{var_name(path[3:])}" of collection "{col}"')
    if created_unchecked:
      return (f'{what} is created inside the loop, but '
              'check_constancy_invariants=False skips the run that computes '
              'broadcast variables, so it would be lost. Create it before the '
              'loop, or keep the check on.')
    return (f'{what} depends on the carry or on the scanned inputs (or split '
            'rngs). A broadcast collection must be the same for all '
            'iterations: do not write it from loop-dependent values, or list '
            'it in variable_axes/variable_carry instead.')
  return (f'scan at {scopes[0].path_text}: output '
          f'{jax.tree_util.keystr(path[1:])} has out_axes=broadcast but '
          'depends on the loop.')


# -- loops and branches -------------------------------------------------------------


_NOT_FOUND = (errors.ScopeParamNotFoundError, errors.ScopeCollectionNotFound,
              errors.ScopeVariableNotFoundError)


def while_loop(cond_fn: Callable[..., Any], body_fn: Callable[..., Any],
               scope: Any, init: Any, carry_variables: Any = False,
               broadcast_variables: Any = True,
               split_rngs: Mapping = {}  # pylint: disable=dangerous-default-value
               ) -> Any:
  """``jax.lax.while_loop`` over scopes.

  A loop whose condition or body creates variables (during ``init``) first
  runs them once on the initial carry to create those variables, keeps the
  values they were created with, and then loops from there: the variables
  of a ``Dense`` used in the body, or a counter carried by the loop, start
  as they would in a Python ``while`` loop (Linen raises instead).

  Args:
    cond_fn: ``cond_fn(scope, carry) -> bool``.
    body_fn: ``body_fn(scope, carry) -> carry``.
    scope: the scope (or scopes) the functions run on.
    init: the initial carry.
    carry_variables: collections the body may update.
    broadcast_variables: collections the loop only reads.
    split_rngs: ``{rng filter: bool}``: which sequences get a new key per
      iteration.

  Returns:
    The final carry.
  """
  rng_filters, rng_splits = unzip2(split_rngs.items())
  read_only = subtract(broadcast_variables, carry_variables)

  def loop_rngs(rng_groups, i):
    return tuple(
        jax.tree_util.tree_map(lambda k: random.fold_in(k, i), group)
        if split else group
        for group, split in zip(rng_groups, rng_splits))

  def creatable(err, scopes) -> bool:
    """Whether ``err`` says the loop needs a variable it could create."""
    if isinstance(err, errors.WhileLoopInitError):
      return True
    col = getattr(err, 'collection', None)
    return col is not None and in_filter(read_only, col) and any(
        in_filter(s.mutable, col) for s in scopes)

  def inner(make_scopes, repack_fn, variable_groups, rng_groups):
    scopes = outer_scopes(make_scopes)
    carry_vars, broadcast_vars = variable_groups

    def hinted(err, where):
      if not creatable(err, scopes):
        return err
      return type(err)(*err.lookup, hint=(
          f'This lookup is in the {where} of the while_loop at '
          f'{scopes[0].path_text}, and a run of the condition and the body '
          'on the initial carry before the loop did not create it: create '
          'it before the loop.'))

    def cond_wrapper(state):
      i, loop_vars, carry = state
      inner_scope = make_scopes((loop_vars, broadcast_vars),
                                loop_rngs(rng_groups, -i),
                                mutable_filter=False)
      try:
        return cond_fn(inner_scope, carry)
      except _NOT_FOUND as err:
        raise hinted(err, 'condition') from err

    def body_wrapper(state):
      i, loop_vars, carry = state
      inner_scope = make_scopes((loop_vars, broadcast_vars),
                                loop_rngs(rng_groups, i))
      try:
        carry = body_fn(inner_scope, carry)
      except _NOT_FOUND as err:
        raise hinted(err, 'body') from err
      (new_vars,) = repack_fn(inner_scope)
      _check_no_new_variables(scopes, loop_vars, new_vars)
      return i + 1, new_vars, carry

    _, carry_vars, carry = lax.while_loop(cond_wrapper, body_wrapper,
                                          (0, carry_vars, init))
    return carry, (carry_vars,)

  def create(make_scopes, repack_fn, variable_groups, rng_groups):
    del repack_fn  # only the created variables go out
    is_scope = lambda x: isinstance(x, Scope)
    cond_scope = make_scopes(variable_groups, rng_groups)
    # The body sees what the condition created, on scopes with their names
    # free again: a module's setup runs once for each, as in the loop.
    body_scope = jax.tree_util.tree_map(lambda s: s.rewound(), cond_scope,
                                        is_leaf=is_scope)
    with created_variables() as created:
      cond_fn(cond_scope, init)
      body_fn(body_scope, init)
    for leaf in jax.tree_util.tree_leaves((cond_scope, body_scope),
                                          is_leaf=is_scope):
      leaf.root.invalidate()
    return None, _created_groups(created, outer_scopes(make_scopes),
                                 carry_variables)

  groups_in = (carry_variables, broadcast_variables)
  looped = pack(inner, groups_in, (carry_variables,), rng_filters,
                name='while_loop')
  scopes = jax.tree_util.tree_leaves(
      scope, is_leaf=lambda x: isinstance(x, Scope))
  if all(is_empty(s.mutable) for s in scopes):
    return looped(scope)  # nothing can be created
  counters = snapshot_scopes(scopes)
  try:
    return looped(scope)
  except (errors.WhileLoopInitError,) + _NOT_FOUND as err:
    if not creatable(err, scopes):
      raise
  restore_scopes(scopes, counters)
  # Before the loop, as Linen's documentation says to write it: every rng
  # sequence is there, unsplit.
  pack(create, groups_in, groups_in, (True,), name='while_loop')(scope)
  restore_scopes(scopes, counters)
  return looped(scope)


def _created_groups(created, outer, carry_filter) -> tuple:
  """``(carried, other)`` variable groups holding only the ``created``
  variables (``scope.created_variables`` entries) at their first values."""
  groups = tuple([{} for _ in outer] for _ in range(2))
  paths = [s.path for s in outer]
  for scope, col, name, value in created:
    root = scope.root
    group = groups[0 if in_filter(carry_filter, col) else 1]
    node = group[paths.index(root.path)].setdefault(col, {})
    for part in scope.path[len(root.path):]:
      node = node.setdefault(part, {})
    node[name] = value
  return tuple(tuple(g) for g in groups)


def _check_no_new_variables(scopes, vars_in, vars_out):
  for s, cols_in, cols_out in zip(scopes, vars_in, vars_out):
    for col, collection in cols_out.items():
      known = {p for p, _ in jax.tree_util.tree_flatten_with_path(
          cols_in.get(col, {}))[0]}
      new = [p for p, _ in jax.tree_util.tree_flatten_with_path(collection)[0]
             if p not in known]
      if new:
        raise errors.WhileLoopInitError(
            f'while_loop at {s.path_text}: the body created '
            + ', '.join(f'"{var_name(p)}"' for p in new)
            + f' in carried collection "{col}", which no run before the '
            'loop creates (a sow adds on every iteration): the carry cannot '
            'hold it; return it in the carry instead.')


def fori_loop(lower, upper, body_fn: Callable[..., Any], scope, init,
              carry_variables=False, broadcast_variables=True,
              split_rngs: Mapping = {}):  # pylint: disable=dangerous-default-value
  """``jax.lax.fori_loop`` over scopes: ``body_fn(scope, i, c) -> c``."""

  def cond_fn(_, state):
    return state[0] < upper

  def body(inner_scope, state):
    i, c = state
    return i + 1, body_fn(inner_scope, i, c)

  lower = jax.numpy.asarray(lower)
  _, carry = while_loop(cond_fn, body, scope, (lower, init),
                        carry_variables=carry_variables,
                        broadcast_variables=broadcast_variables,
                        split_rngs=split_rngs)
  return carry


def _branch_signature(out_groups):
  sig = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(out_groups)[0]:
    aval = typeof(leaf)
    sig[path] = None if aval is None else (tuple(aval.shape), aval.dtype)
  return sig


def _branch_error(kind, scopes, signatures):
  """CondBranchVariablesError if the branches wrote different variables."""
  first = signatures[0]
  for index, other in enumerate(signatures[1:], start=1):
    if other == first:
      continue
    for path in sorted(set(first) | set(other), key=str):
      a, b = first.get(path, 'missing'), other.get(path, 'missing')
      if a == b:
        continue
      # path: (filter group, scope, collection, *name)
      scope = scopes[path[1].idx]
      col = path[2].key
      name = var_name(path[3:])

      def show(x):
        if x == 'missing':
          return 'does not create it'
        return 'creates it' if x is None else f'creates it as {x[1]}{list(x[0])}'

      if 'missing' in (a, b):
        advice = ('All branches must create the same variables; run every '
                  'branch once during initialization, before the conditional.')
      else:
        advice = ('A variable several branches create must have one shape '
                  'and dtype: give the two another name each, or one shape.')
      return errors.CondBranchVariablesError(
          f'{kind} at {scope.path_text}: variable "{name}" of collection '
          f'"{col}": branch 0 {show(a)}, branch {index} {show(b)}. {advice}')
  return None


def _creation_only(signatures) -> bool:
  """Whether the branches differ only in which variables they create (not
  in the shape or dtype of one they all create)."""
  first = signatures[0]
  for other in signatures[1:]:
    for path in set(first) & set(other):
      if first[path] != other[path]:
        return False
  return True


def _branches(kind, branches, select, scope, operands, variables, rngs):
  def inner(make_scopes, repack_fn, variable_groups, rng_groups):
    scopes = outer_scopes(make_scopes)
    signatures = [None] * len(branches)

    def make(index, branch_fn):
      def pure(*ops):
        inner_scope = make_scopes(variable_groups, rng_groups)
        y = branch_fn(inner_scope, *ops)
        out = repack_fn(inner_scope)
        signatures[index] = _branch_signature(out)
        return y, out
      return pure

    pure = [make(i, b) for i, b in enumerate(branches)]
    try:
      return select(pure, *operands)
    except TypeError as err:
      if all(s is not None for s in signatures):
        better = _branch_error(kind, scopes, signatures)
        if better is not None:
          better.creation_only = _creation_only(signatures)
          raise better from err
      raise

  return pack(inner, (variables,), (variables,), (rngs,), name=kind)(scope)


def cond(pred, true_fun: Callable[..., Any], false_fun: Callable[..., Any],
         scope, *operands, variables=True, rngs=True):
  """``jax.lax.cond`` over scopes: ``true_fun(scope, *operands)`` or
  ``false_fun(scope, *operands)``. Both branches must create the same
  variables (their writes must have identical structure)."""
  return _branches(
      'cond', (true_fun, false_fun),
      lambda pure, *ops: lax.cond(pred, pure[0], pure[1], *ops),
      scope, operands, variables, rngs)


def switch(index, branches: Sequence[Callable[..., Any]], scope, *operands,
           variables=True, rngs=True):
  """``jax.lax.switch`` over scopes: ``branches[index](scope, *operands)``.
  All branches must create the same variables."""
  return _branches(
      'switch', tuple(branches),
      lambda pure, *ops: lax.switch(index, pure, *ops),
      scope, operands, variables, rngs)


# -- remat ------------------------------------------------------------------------------


def checkpoint(fn: Callable[..., Any], variables: Any = True,
               rngs: Any = True,
               concrete: bool = False, prevent_cse: bool = True,
               static_argnums: int | tuple = (),
               policy: Callable[..., bool] | None = None,
               static_argnames: Sequence[str] = ()) -> Callable[..., Any]:
  """``jax.checkpoint`` for scope functions.

  Intermediates of ``fn`` are recomputed in the backward pass instead of
  stored. ``remat`` is the same function.

  Args:
    fn: ``fn(scope, *args)``.
    variables: the collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.
    concrete: not supported (True raises ``NotImplementedError`` when
      called); use ``static_argnums``.
    prevent_cse: as in ``jax.checkpoint``.
    static_argnums: static arguments, counting those after the scope from 0.
    policy: a ``jax.checkpoint_policies`` rule.
    static_argnames: keyword arguments that are static when passed
      (``jax.checkpoint`` has no such option: they are bound outside it).

  Returns:
    The rematerialized ``f(scope, *args)``.
  """

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, *args,
            **kwargs):
    if concrete:
      raise NotImplementedError(
          'checkpoint(concrete=True) is not supported by JAX any more; use '
          'static_argnums.')
    shifted = jax.tree_util.tree_map(lambda i: i + 2, static_argnums)
    static_kwargs = {k: kwargs.pop(k) for k in static_argnames if k in kwargs}
    # A static parameter passed by keyword, or left at its default, is not
    # among the positional args (jax.checkpoint would reject its index).
    shifted = tuple(i for i in jax.tree_util.tree_leaves(shifted)
                    if i < 2 + len(args))

    @functools.wraps(fn)
    def rematted(variable_groups, rng_groups, *args, **kwargs):
      scope = make_scopes(variable_groups, rng_groups)
      y = fn(scope, *args, **kwargs, **static_kwargs)
      return y, repack_fn(scope)

    return jax.checkpoint(rematted, prevent_cse=prevent_cse, policy=policy,
                          static_argnums=shifted)(
                              variable_groups, rng_groups, *args, **kwargs)

  return pack(inner, (variables,), (variables,), (rngs,), name='remat',
              enable_kwargs=True)


remat = checkpoint


def remat_scan(body_fn: Callable[..., Any], lengths: Sequence[int],
               policy: Callable[..., bool] | None = None,
               variable_broadcast: Any = False, variable_carry: Any = False,
               variable_axes: Mapping = {True: 0},  # pylint: disable=dangerous-default-value
               split_rngs: Mapping = {True: True},  # pylint: disable=dangerous-default-value
               metadata_params: Mapping | Sequence[Mapping] = {}  # pylint: disable=dangerous-default-value
               ) -> Callable[..., Any]:
  """Repeats ``body_fn`` ``prod(lengths)`` times as nested rematerialized scans.

  Memory grows like ``n ** (1 / len(lengths))``. Variables get one leading
  axis per level.

  Arguments after the carry reach every application unchanged (Linen's
  ``remat_scan`` takes none: its body is called with the carry only).

  Args:
    body_fn: ``body_fn(scope, carry, *args, **kwargs) -> carry``.
    lengths: the loop lengths, outermost first.
    policy: a ``jax.checkpoint_policies`` rule.
    variable_broadcast: collections shared by every application.
    variable_carry: collections threaded through the applications.
    variable_axes: ``{collection filter: axis}`` of the stacked collections.
    split_rngs: ``{rng filter: bool}``.
    metadata_params: passed to boxed variables when a level adds its axis:
      one mapping for every level, or a sequence of one per level
      (outermost first).

  Returns:
    ``f(scope, carry, *args, **kwargs) -> carry``.

  Raises:
    ValueError: ``metadata_params`` is a sequence whose length is not
      ``len(lengths)``.
  """
  levels = _remat_scan_levels(body_fn, lengths, policy, variable_broadcast,
                              variable_carry, variable_axes, split_rngs,
                              metadata_params)

  def apply(scope, carry, *args, **kwargs):
    if not args and not kwargs:
      return levels(scope, carry)
    # The extra arguments are closed over, so that every level (and
    # jax.checkpoint) sees them as they were given: a Python flag stays
    # static, an array is one value shared by all applications.
    body = lambda inner, c: body_fn(inner, c, *args, **kwargs)
    return _remat_scan_levels(body, lengths, policy, variable_broadcast,
                              variable_carry, variable_axes, split_rngs,
                              metadata_params)(scope, carry)
  return apply


def _remat_scan_levels(body_fn, lengths, policy, variable_broadcast,
                       variable_carry, variable_axes, split_rngs,
                       metadata_params):
  """``remat_scan`` of a body taking the carry only."""
  per_level = level_metadata(metadata_params, lengths)
  level = functools.partial(scan, variable_broadcast=variable_broadcast,
                            variable_carry=variable_carry,
                            variable_axes=variable_axes,
                            split_rngs=split_rngs,
                            metadata_params=per_level[0],
                            _axis_owner='remat_scan')
  if len(lengths) == 1:
    def once(scope, carry):
      return body_fn(scope, carry), ()
    return lambda scope, c: level(once, length=lengths[0])(scope, c)[0]

  @functools.partial(remat, policy=policy, prevent_cse=False)
  def nested(scope, carry):
    carry = _remat_scan_levels(body_fn, lengths[1:], policy,
                               variable_broadcast, variable_carry,
                               variable_axes, split_rngs,
                               per_level[1:])(scope, carry)
    return carry, ()

  return lambda scope, c: level(nested, length=lengths[0])(scope, c)[0]


def level_metadata(metadata_params: Mapping | Sequence[Mapping],
                   lengths: Sequence[int]) -> tuple[Mapping, ...]:
  """One ``metadata_params`` mapping per level of ``remat_scan``.

  Args:
    metadata_params: one mapping for all levels, or one per level.
    lengths: the loop lengths, outermost first.

  Returns:
    A tuple of ``len(lengths)`` mappings.

  Raises:
    ValueError: a sequence of the wrong length.
  """
  if isinstance(metadata_params, Mapping):
    return (metadata_params,) * len(lengths)
  per_level = tuple(metadata_params)
  if len(per_level) != len(lengths):
    raise ValueError(
        f'remat_scan: metadata_params has {len(per_level)} entries but '
        f'lengths={tuple(lengths)} has {len(lengths)} levels; give one '
        'mapping per level (outermost first), or one mapping for all.')
  return per_level
