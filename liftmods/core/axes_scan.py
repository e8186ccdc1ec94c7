"""The loop engine of lifted scan: ``lax.scan`` with vmap-style axes and
loop-invariant ("broadcast") inputs and outputs, plus the carry checks.

``scan_with_broadcast`` knows nothing about scopes: it loops a pure
``body(broadcast_in, carry, *xs)``. The two loops over scopes,
``liftmods.core.lift.scan`` and ``liftmods.core.layer_scan``, share the
prologue here (``slice_groups``), the carry check (``carry_mismatch``) and
the driver that replays rng counters instead of tracing a body twice
(``trace_loop``).
"""
from typing import Any, Callable

import jax
from jax import lax

from liftmods import errors, jax_private
from liftmods.core import explicit, meta
from liftmods.core.pack import (broadcast, check_variable_axes, describe_aval,
                                split_keys, typeof, var_name)
from liftmods.core.rng_counters import ReplayMismatch, RngReplay


def _abstract(x, scanned: bool):
  """The abstract value of ``x`` (of one slice of it, when ``scanned``)."""
  aval = jax.typeof(x)
  if not scanned:
    return aval
  sharding = getattr(aval, 'sharding', None)
  spec = tuple(getattr(sharding, 'spec', ()) or ())
  if spec and spec[0] is not None:
    raise ValueError('scan: the scanned axis of an input cannot be sharded '
                     f'(got spec {spec}).')
  if sharding is not None and spec:
    return aval.update(shape=aval.shape[1:], sharding=sharding.update(
        spec=jax.sharding.PartitionSpec(*spec[1:])))
  return aval.update(shape=aval.shape[1:])


def _to_front(axis, xs):
  if axis is broadcast:
    return ()
  if axis == 0:
    return xs
  return jax.tree_util.tree_map(lambda x: jax.numpy.moveaxis(x, axis, 0), xs)


def _from_front(axis, ys):
  if axis is broadcast:
    return ()
  if axis == 0:
    return ys
  return jax.tree_util.tree_map(lambda y: jax.numpy.moveaxis(y, 0, axis), ys)


def scan_with_broadcast(body, in_axes, out_axes, length, reverse, unroll,
                        split_transpose, check_invariants, explain,
                        writes_broadcast=True, rng_replay=None):
  """``lax.scan`` with vmap-style axes plus loop-invariant outputs.

  ``body(broadcast_in, carry, *xs) -> (broadcast_out, carry, ys)``. Inputs
  whose axis is ``broadcast`` are passed whole to every iteration; outputs
  whose axis is ``broadcast`` must not depend on the iteration and are
  returned once. ``broadcast_out`` is computed by running the body once
  outside the loop with the carry and the scanned inputs abstract; the loop
  then runs with it as ``broadcast_in``. Anything of ``broadcast_out`` that
  depends on the abstract part is an error, described by ``explain(path)``.
  When nothing broadcast can be written (``writes_broadcast`` False and no
  ``broadcast`` out axis) that extra trace can be skipped so the body is
  traced once. Callers pass ``writes_broadcast=True`` whenever rngs cross
  the loop: the extra trace advances rng counters, and Linen's keys depend
  on that; ``rng_replay`` (an ``rng_counters.RngReplay``) then lets a
  repeated trace of the same site skip it anyway.
  """
  out_broadcast = _any_broadcast(out_axes)
  first_trace = runs_first_trace(out_axes, check_invariants, writes_broadcast)
  if out_broadcast and not check_invariants:
    raise ValueError('scan with check_constancy_invariants=False cannot '
                     'return outputs with out_axes=broadcast.')

  def scan_loop(broadcast_in, init, *args):
    xs = explicit.unshard_leading(
        jax.tree_util.tree_map(_to_front, in_axes, args))

    def full_inputs(x_slice):
      return jax.tree_util.tree_map(
          lambda axis, arg, x: arg if axis is broadcast else x, in_axes,
          args, x_slice)

    def step(b_in, carry, x_slice):
      return body(b_in, carry, *full_inputs(x_slice))

    def first():
      if not first_trace:
        return broadcast_in, None
      return _invariant_outputs(step, broadcast_in, init, xs, out_axes,
                                explain)

    def loop(first_out, verify):
      b_in, consts_out = (broadcast_in, None) if first_out is None else first_out
      carry, ys = _loop(step, b_in, init, xs, out_axes, verify,
                        not check_invariants, explain, length, reverse, unroll,
                        split_transpose)
      if consts_out is not None:
        ys = jax.tree_util.tree_map(
            lambda axis, const, y: const if axis is broadcast else y,
            out_axes, consts_out, ys)
      return b_in, carry, ys

    # Outputs that are broadcast come from the first trace: never skip it.
    return trace_loop(None if out_broadcast else rng_replay, first, loop)

  return scan_loop


def _any_broadcast(out_axes) -> bool:
  return any(axis is broadcast for axis in jax.tree_util.tree_leaves(
      out_axes, is_leaf=lambda x: x is broadcast))


def runs_first_trace(out_axes, check_invariants: bool,
                     writes_broadcast: bool) -> bool:
  """Whether ``scan_with_broadcast`` (same arguments) traces the body once
  before the loop: then the loop's body sees the rng counters that trace
  left."""
  return check_invariants and (writes_broadcast or _any_broadcast(out_axes))


def _invariant_outputs(step, broadcast_in, init, xs, out_axes, explain):
  """``(broadcast_out, broadcast ys)`` from one trace of ``step`` with the
  carry and the scanned slice abstract; raises when any of it depends on
  them."""
  in_avals = (jax.tree_util.tree_map(lambda x: _abstract(x, False), init),
              jax.tree_util.tree_map(lambda x: _abstract(x, True), xs))
  flat_avals, in_tree = jax.tree_util.tree_flatten(in_avals)

  def invariant_part(*flat):
    carry, x_slice = jax.tree_util.tree_unflatten(in_tree, flat)
    b_out, _, ys = step(broadcast_in, carry, x_slice)
    ys = jax.tree_util.tree_map(
        lambda axis, y: y if axis is broadcast else (), out_axes, ys)
    return b_out, ys

  known, out_tree = jax_private.known_outputs(
      invariant_part, flat_avals, 'liftmods scan (loop invariants)')
  dependent = [i for i, value in enumerate(known)
               if isinstance(value, jax_private.Unknown)]
  if dependent:
    positions = jax.tree_util.tree_unflatten(
        out_tree, list(range(out_tree.num_leaves)))
    paths = {i: path for path, i in
             jax.tree_util.tree_flatten_with_path(positions)[0]}
    raise errors.BroadcastVariableError(explain(paths[dependent[0]]))
  return jax.tree_util.tree_unflatten(out_tree, known)


def _loop(step, broadcast_in, init, xs, out_axes, verify, unchecked, explain,
          length, reverse, unroll, split_transpose):
  """The ``lax.scan`` itself; the ys of broadcast out axes are ``()``."""
  # On Explicit axes the carry keeps the layout it enters with (its type);
  # decided once here, not by walking both carries in every body trace.
  keep_layout = explicit.explicit_mesh(*jax.tree_util.tree_leaves(init))

  def loop_body(carry, x_slice):
    b_out, new_carry, ys = step(broadcast_in, carry, x_slice)
    carry = (new_carry if keep_layout is None
             else explicit.like(new_carry, carry))
    if unchecked:
      _check_nothing_broadcast_made(broadcast_in, b_out, explain)
    if verify is not None:
      verify()
    ys = jax.tree_util.tree_map(
        lambda axis, y: () if axis is broadcast else y, out_axes, ys)
    return carry, ys

  carry, ys = lax.scan(loop_body, init, xs, length=length, reverse=reverse,
                       unroll=unroll, _split_transpose=split_transpose)
  return carry, jax.tree_util.tree_map(_from_front, out_axes, ys)


def trace_loop(replay: RngReplay | None, first: Callable[[], Any],
               loop: Callable[[Any, Callable[[], None] | None], Any]) -> Any:
  """Traces a loop whose body Linen traces once more beforehand.

  ``first()`` is that extra trace (its counter effect is what Linen's keys
  depend on); ``loop(first_out, verify)`` traces the loop, calling
  ``verify()`` after its body when ``verify`` is not None. With a recorded
  ``replay`` hit, the counters jump to their recorded post-``first`` state
  and ``loop(None, replay.verify)`` runs alone; if the body then moves the
  counters differently, they are put back and both run. Every full run is
  recorded in ``replay`` (when given).

  Args:
    replay: the site's ``RngReplay``, or None to always run both.
    first: the extra trace.
    loop: the loop's trace.

  Returns:
    What ``loop`` returns.
  """
  if replay is not None and replay.jump():
    try:
      return loop(None, replay.verify)
    except ReplayMismatch:
      replay.rewind()
  first_out = first()
  if replay is None:
    return loop(first_out, None)
  after_first = replay.state()
  out = loop(first_out, None)
  replay.record(after_first, replay.state())
  return out


def _check_nothing_broadcast_made(broadcast_in, broadcast_out, explain):
  """Without the constancy check the loop returns the broadcast inputs
  unchanged, so a broadcast variable the body creates would be dropped
  (Linen drops it silently); refuse instead."""
  known = {path for path, _ in
           jax.tree_util.tree_flatten_with_path(broadcast_in)[0]}
  for path, _ in jax.tree_util.tree_flatten_with_path(broadcast_out)[0]:
    if path not in known:
      raise errors.BroadcastVariableError(
          explain((jax.tree_util.SequenceKey(0),) + path,
                  created_unchecked=True))


def _box_axis(axis: int, box: Any) -> int:
  """``axis`` counted from the front of the boxed value (which holds the
  transform's axis): a negative axis names the same dimension of every
  variable, -1 the last. Linen hands it on as it is, and ``Partitioned``
  then inserts its name one place before the end, misaligned with the
  value."""
  ndim = getattr(getattr(box, 'value', None), 'ndim', None)
  return axis + ndim if axis < 0 and ndim is not None else axis


def add_axis(tree: Any, axis: int, params: dict) -> Any:
  """``meta.add_axis`` of a transform's variable axis (may be negative)."""
  return meta.map_axis_meta(
      lambda box: box.add_axis(_box_axis(axis, box), params), tree)


def remove_axis(tree: Any, axis: int, params: dict) -> Any:
  """``meta.remove_axis`` of a transform's variable axis (may be negative)."""
  return meta.map_axis_meta(
      lambda box: box.remove_axis(_box_axis(axis, box), params), tree)


def slice_groups(kind, scopes, variable_groups, axes, rng_groups, splits,
                 size, source, metadata_params, explain_axis=None):
  """What one iteration of a loop sees of the packed groups.

  The prologue every loop shares: each variable group loses its loop axis
  (``axes``, one per group; boxed values through ``metadata_params``),
  checked to be of ``size`` (``source`` says where the size came from;
  ``explain_axis`` may word the error, see ``check_variable_axes``); each rng
  group is split ``size`` ways where its ``splits`` flag is set.

  Returns:
    ``(sliced variable groups, rng groups)``.
  """
  sliced = tuple(remove_axis(group, axis, metadata_params)
                 for group, axis in zip(variable_groups, axes))
  check_variable_axes(kind, scopes, sliced, axes, size, source,
                      explain=explain_axis)
  keys = tuple(split_keys(group, size) if split else group
               for group, split in zip(rng_groups, splits))
  return sliced, keys


def _leaf_problem(a, b):
  a_aval, b_aval = typeof(a), typeof(b)
  if a_aval is None or b_aval is None:
    return None
  if tuple(a_aval.shape) != tuple(b_aval.shape) or (
      a_aval.dtype != b_aval.dtype and not getattr(a_aval, 'weak_type', 0)):
    return (f'went in as {describe_aval(a_aval)} and came out as '
            f'{describe_aval(b_aval)}')
  return None


def carry_mismatch(c_in, c_out) -> str | None:
  """How a loop body's carry changed (its structure, or an entry's shape or
  dtype), as a sentence about "the body"; None when it did not."""
  in_leaves, in_tree = jax.tree_util.tree_flatten_with_path(c_in)
  out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(c_out)
  if in_tree != out_tree:
    return (f'the body returned a carry with structure {out_tree}, but it '
            f'received {in_tree}; a carry must keep its structure.')
  for (path, a), (_, b) in zip(in_leaves, out_leaves):
    problem = _leaf_problem(a, b)
    if problem:
      entry = jax.tree_util.keystr(path)
      what = f'carry entry {entry}' if entry else 'carry'
      return (f'the {what} {problem}; a carry must keep its shape and dtype '
              'across iterations.')
  return None


def check_carry(kind, scopes, vars_in, vars_out, c_in, c_out):
  """Raises ScanCarryError if the carried variables or the carry changed
  structure, shape or dtype."""
  for scope, cols_in, cols_out in zip(scopes, vars_in, vars_out):
    for col in sorted(set(cols_in) | set(cols_out)):
      _check_carried_collection(kind, scope, col, cols_in.get(col, {}),
                                cols_out.get(col, {}))
  mismatch = carry_mismatch(c_in, c_out)
  if mismatch:
    raise errors.ScanCarryError(f'{kind} at {scopes[0].path_text}: {mismatch}')


def _check_carried_collection(kind, scope, col, before, after):
  flat_in = dict(jax.tree_util.tree_flatten_with_path(before)[0])
  flat_out = dict(jax.tree_util.tree_flatten_with_path(after)[0])
  added = [p for p in flat_out if p not in flat_in]
  removed = [p for p in flat_in if p not in flat_out]
  if added or removed:
    what = []
    if added:
      what.append('created ' + ', '.join(f'"{var_name(p)}"' for p in added))
    if removed:
      what.append('dropped ' + ', '.join(f'"{var_name(p)}"' for p in removed))
    err = errors.ScanCarryError(
        f'{kind} at {scope.path_text}: the body {" and ".join(what)} in '
        f'carried collection "{col}"; carried variables must exist before '
        'the loop and keep their structure. Initialize them outside the '
        'loop.')
    err.created = not removed  # lift.scan then runs iteration 0 on its own
    raise err
  for path, leaf in flat_in.items():
    problem = _leaf_problem(leaf, flat_out[path])
    if problem:
      raise errors.ScanCarryError(
          f'{kind} at {scope.path_text}: carried variable '
          f'"{var_name(path)}" of collection "{col}" {problem}; a carry must '
          'keep its shape and dtype across iterations.')
