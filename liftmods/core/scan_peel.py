"""A loop's first iteration run on its own, for bodies that create carried
variables.

A ``lax.scan`` carry keeps one structure, so a body that creates a variable
of a carried collection (``nn.scan(..., variable_carry='batch_stats')``
around a ``BatchNorm`` during ``init``; flax#2052) cannot start the loop. The
program it describes is still clear: the loop runs the body ``n`` times, and
the first run creates the variables. ``peel`` runs exactly that: iteration 0
(the last index when ``reverse``) outside the loop, where creating variables
is allowed, then ``lax.scan`` over the ``n - 1`` others with the created
variables in the carry, and stitches the stacked outputs back together in
index order. It is only taken where the plain loop refuses, so a loop that
already runs keeps its program.

>>> import jax.numpy as jnp
>>> first, rest = split_iterations(0, jnp.arange(4.0), 4, reverse=False)
>>> first, rest
(Array(0., dtype=float32), Array([1., 2., 3.], dtype=float32))
"""
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp

from liftmods.core.pack import broadcast


def _per_axis(fn: Callable[[Any, Any], Any], axes: Any, tree: Any) -> Any:
  """``fn(axis, leaf)`` over ``tree``, ``axes`` being a prefix of it."""
  return jax.tree_util.tree_map(
      lambda axis, sub: jax.tree_util.tree_map(lambda x: fn(axis, x), sub),
      axes, tree)


def split_iterations(axes: Any, tree: Any, n: int, reverse: bool):
  """``(the first iteration's slice, the other iterations)`` of ``tree``;
  leaves whose axis is ``broadcast`` go whole to both."""
  index = n - 1 if reverse else 0
  lo, hi = (0, n - 1) if reverse else (1, n)

  def first(axis, x):
    return x if axis is broadcast else lax.index_in_dim(x, index, axis, False)

  def rest(axis, x):
    return x if axis is broadcast else lax.slice_in_dim(x, lo, hi, axis=axis)

  return _per_axis(first, axes, tree), _per_axis(rest, axes, tree)


def join_iterations(axes: Any, first: Any, rest: Any | None, reverse: bool):
  """The inverse of ``split_iterations`` on outputs: ``first`` stacked with
  ``rest`` (None: there were no other iterations) along ``axes``. A
  ``broadcast`` output is the same for every iteration; the loop's is
  kept."""
  def join(axis, one, others):
    if axis is broadcast:
      return one if others is None else others
    one = jnp.expand_dims(one, axis)
    if others is None:
      return one
    parts = (others, one) if reverse else (one, others)
    return jnp.concatenate(parts, axis=axis)

  if rest is None:
    return _per_axis(lambda axis, x: join(axis, x, None), axes, first)
  return jax.tree_util.tree_map(
      lambda axis, a, b: jax.tree_util.tree_map(
          lambda x, y: join(axis, x, y), a, b),
      axes, first, rest)


def peel(run_first: Callable[..., Any], run_rest: Callable[..., Any],
         in_axes: Any, out_axes: Any, n: int, reverse: bool,
         broadcast_in: Any, init: Any, *xs: Any):
  """Iteration 0 by ``run_first``, the others by the loop ``run_rest``.

  Both take and return what ``scan_with_broadcast``'s loop does:
  ``(broadcast_in, carry, *xs) -> (broadcast_out, carry, ys)``, ``xs``
  sliced along ``in_axes`` and ``ys`` stacked along ``out_axes``;
  ``run_first`` sees one slice, ``run_rest(length, ...)`` the ``n - 1``
  others.
  """
  first_xs, rest_xs = split_iterations(in_axes, xs, n, reverse)
  b_out, carry, ys = run_first(broadcast_in, init, *first_xs)
  if n == 1:
    return b_out, carry, join_iterations(out_axes, ys, None, reverse)
  b_out, carry, rest_ys = run_rest(n - 1, b_out, carry, *rest_xs)
  return b_out, carry, join_iterations(out_axes, ys, rest_ys, reverse)
