"""The loop engine of lifted scan: ``lax.scan`` with vmap-style axes and
loop-invariant ("broadcast") inputs and outputs, plus the carry checks.

``scan_with_broadcast`` knows nothing about scopes: it loops a pure
``body(broadcast_in, carry, *xs)``. ``liftmods.core.lift.scan`` feeds it the
packed variable groups, and ``nn.Stack`` shares its rng-counter replay.
"""
import jax
from jax import lax
from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe

from liftmods import errors
from liftmods.core.pack import broadcast, describe_aval, typeof, var_name


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
  out_broadcast = any(axis is broadcast for axis in jax.tree_util.tree_leaves(
      out_axes, is_leaf=lambda x: x is broadcast))

  def run(broadcast_in, init, *args):
    if rng_replay is not None and not out_broadcast:
      replayed = rng_replay.replayed(
          lambda verify: traced(broadcast_in, init, args, False, verify))
      if replayed is not None:
        return replayed[0]
    if rng_replay is None:
      return traced(broadcast_in, init, args, True, None)
    out = traced(broadcast_in, init, args, True, None)
    rng_replay.record(*out[3])
    return out[:3]

  def traced(broadcast_in, init, args, invariants, verify):
    xs = jax.tree_util.tree_map(_to_front, in_axes, args)

    def full_inputs(x_slice):
      return jax.tree_util.tree_map(
          lambda axis, arg, x: arg if axis is broadcast else x, in_axes,
          args, x_slice)

    consts_out = None
    if invariants and check_invariants and (writes_broadcast or out_broadcast):
      in_avals = (jax.tree_util.tree_map(lambda x: _abstract(x, False), init),
                  jax.tree_util.tree_map(lambda x: _abstract(x, True), xs))
      flat_avals, in_tree = jax.tree_util.tree_flatten(in_avals)
      out_trees = []

      def invariant_part(*flat):
        carry, x_slice = jax.tree_util.tree_unflatten(in_tree, flat)
        b_out, _, ys = body(broadcast_in, carry, *full_inputs(x_slice))
        ys = jax.tree_util.tree_map(
            lambda axis, y: y if axis is broadcast else (), out_axes, ys)
        flat_out, out_tree = jax.tree_util.tree_flatten((b_out, ys))
        out_trees.append(out_tree)
        return flat_out

      debug = jax.api_util.debug_info('liftmods scan (loop invariants)',
                                      invariant_part, tuple(flat_avals), {})
      _, out_pvals, _ = pe.trace_to_jaxpr_nounits(
          lu.wrap_init(invariant_part, debug_info=debug),
          [pe.PartialVal.unknown(a) for a in flat_avals])
      dependent = [i for i, pval in enumerate(out_pvals)
                   if not pval.is_known()]
      out_tree = out_trees[-1]
      if dependent:
        positions = jax.tree_util.tree_unflatten(
            out_tree, list(range(out_tree.num_leaves)))
        paths = {i: path for path, i in
                 jax.tree_util.tree_flatten_with_path(positions)[0]}
        raise errors.BroadcastVariableError(explain(paths[dependent[0]]))
      broadcast_in, consts_out = jax.tree_util.tree_unflatten(
          out_tree, [pval.get_known() for pval in out_pvals])
    elif out_broadcast and not check_invariants:
      raise ValueError('scan with check_constancy_invariants=False cannot '
                       'return outputs with out_axes=broadcast.')
    after_first = rng_replay.state() if rng_replay is not None else None

    unchecked = not check_invariants and consts_out is None

    def loop_body(carry, x_slice):
      b_out, carry, ys = body(broadcast_in, carry, *full_inputs(x_slice))
      if unchecked:
        _check_nothing_broadcast_made(broadcast_in, b_out, explain)
      if verify is not None:
        verify()
      ys = jax.tree_util.tree_map(
          lambda axis, y: () if axis is broadcast else y, out_axes, ys)
      return carry, ys

    carry, ys = lax.scan(loop_body, init, xs, length=length, reverse=reverse,
                         unroll=unroll, _split_transpose=split_transpose)
    ys = jax.tree_util.tree_map(_from_front, out_axes, ys)
    if consts_out is not None:
      ys = jax.tree_util.tree_map(
          lambda axis, const, y: const if axis is broadcast else y, out_axes,
          consts_out, ys)
    if rng_replay is not None and verify is None:
      return broadcast_in, carry, ys, (after_first, rng_replay.state())
    return broadcast_in, carry, ys

  return run


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


def check_carry(kind, scopes, vars_in, vars_out, c_in, c_out):
  """Raises ScanCarryError if the carry changed structure, shape or dtype."""

  def leaf_problem(a, b):
    a_aval, b_aval = typeof(a), typeof(b)
    if a_aval is None or b_aval is None:
      return None
    if tuple(a_aval.shape) != tuple(b_aval.shape) or (
        a_aval.dtype != b_aval.dtype and not getattr(a_aval, 'weak_type', 0)):
      return (f'went in as {describe_aval(a_aval)} and came out as '
              f'{describe_aval(b_aval)}')
    return None

  for scope, cols_in, cols_out in zip(scopes, vars_in, vars_out):
    for col in sorted(set(cols_in) | set(cols_out)):
      flat_in = dict(jax.tree_util.tree_flatten_with_path(
          cols_in.get(col, {}))[0])
      flat_out = dict(jax.tree_util.tree_flatten_with_path(
          cols_out.get(col, {}))[0])
      added = [p for p in flat_out if p not in flat_in]
      removed = [p for p in flat_in if p not in flat_out]
      if added or removed:
        what = []
        if added:
          what.append('created ' + ', '.join(
              f'"{var_name(p)}"' for p in added))
        if removed:
          what.append('dropped ' + ', '.join(
              f'"{var_name(p)}"' for p in removed))
        raise errors.ScanCarryError(
            f'{kind} at {scope.path_text}: the body {" and ".join(what)} in '
            f'carried collection "{col}"; carried variables must exist '
            'before the loop and keep their structure. Initialize them '
            'outside the loop.')
      for path, leaf in flat_in.items():
        problem = leaf_problem(leaf, flat_out[path])
        if problem:
          raise errors.ScanCarryError(
              f'{kind} at {scope.path_text}: carried variable '
              f'"{var_name(path)}" of collection "{col}" {problem}; a '
              'carry must keep its shape and dtype across iterations.')
  in_leaves, in_tree = jax.tree_util.tree_flatten_with_path(c_in)
  out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(c_out)
  if in_tree != out_tree:
    raise errors.ScanCarryError(
        f'{kind} at {scopes[0].path_text}: the body returned a carry with '
        f'structure {out_tree}, but it received {in_tree}; a carry must keep '
        'its structure.')
  for (path, a), (_, b) in zip(in_leaves, out_leaves):
    problem = leaf_problem(a, b)
    if problem:
      entry = jax.tree_util.keystr(path)
      what = f'carry entry {entry}' if entry else 'carry'
      raise errors.ScanCarryError(
          f'{kind} at {scopes[0].path_text}: the {what} {problem}; a carry '
          'must keep its shape and dtype across iterations.')
