"""Window pooling over the spatial axes of ``(batch..., spatial..., features)``.

All pools are a single ``lax.reduce_window``. Inputs may also omit the batch
axis entirely (``(spatial..., features)``). ``padding`` is ``'SAME'``,
``'VALID'`` or one ``(low, high)`` pair per spatial axis.

>>> import jax.numpy as jnp
>>> from liftmods.pooling import avg_pool, max_pool
>>> x = jnp.arange(8.0).reshape(1, 4, 2)
>>> max_pool(x, (2,), strides=(2,))[0]
Array([[2., 3.],
       [6., 7.]], dtype=float32)
>>> avg_pool(x, (3,), padding=((1, 1),), count_include_pad=False)[0, 0]
Array([1., 2.], dtype=float32)
"""
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from liftmods.core import explicit
from liftmods.typing import Array, LaxPadding


def _explicit_padding(padding, window_shape):
  """Validate per-axis ``(low, high)`` pads and add the feature-axis pad."""
  padding = tuple(tuple(p) for p in padding)
  assert len(padding) == len(window_shape), (
      f'padding {padding} needs one (low, high) pair per window axis '
      f'of {window_shape}'
  )
  assert all(len(p) == 2 for p in padding), (
      f'every padding entry must be a (low, high) pair, got {padding}'
  )
  return padding + ((0, 0),)


def pool(inputs: Array, init: Any, reduce_fn: Callable[[Any, Any], Any],
         window_shape: Sequence[int], strides: Sequence[int] | None,
         padding: LaxPadding) -> Array:
  """Reduce every window of ``inputs`` with ``reduce_fn``.

  Pooling is in general not differentiable, even with a differentiable
  ``reduce_fn``.

  Args:
    inputs: array shaped ``(batch..., window dims..., features)``; the batch
      axes may be absent.
    init: initial value of the reduction.
    reduce_fn: binary reduction ``(T, T) -> T``.
    window_shape: window size per spatial axis.
    strides: step per spatial axis; falsy means all ones.
    padding: ``'SAME'``, ``'VALID'`` or a ``(low, high)`` pair per spatial
      axis.

  Returns:
    The reduced windows, with the batch axes of ``inputs``.
  """
  window_shape = tuple(window_shape)
  strides = tuple(strides) if strides else (1,) * len(window_shape)
  assert len(window_shape) == len(strides), (
      f'window_shape {window_shape} and strides {strides} differ in length'
  )
  n_batch = inputs.ndim - len(window_shape) - 1
  unbatched = n_batch == 0
  if unbatched:
    inputs, n_batch = inputs[None], 1
  dims = (1,) * n_batch + window_shape + (1,)
  steps = (1,) * n_batch + strides + (1,)
  assert inputs.ndim == len(dims), f'len({inputs.shape}) != len({dims})'
  if not isinstance(padding, str):
    padding = ((0, 0),) * n_batch + _explicit_padding(padding, window_shape)
  y = explicit.windowed(
      lambda x: lax.reduce_window(x, init, reduce_fn, dims, steps, padding),
      inputs)
  return jnp.squeeze(y, axis=0) if unbatched else y


def avg_pool(
    inputs: Array, window_shape: Sequence[int],
    strides: Sequence[int] | None = None, padding: LaxPadding = 'VALID',
    count_include_pad: bool = True
) -> Array:
  """Average over each window.

  Args:
    inputs: array shaped ``(batch..., window dims..., features)``.
    window_shape: window size per spatial axis.
    strides: step per spatial axis (default all ones).
    padding: ``'SAME'``, ``'VALID'`` (default) or ``(low, high)`` pairs.
    count_include_pad: divide by the full window size (``True``) or only by
      the number of non-padding elements in the window (``False``).

  Returns:
    The window averages.
  """
  total = pool(inputs, 0.0, lax.add, window_shape, strides, padding)
  if count_include_pad:
    return total / np.prod(window_shape)
  counts_shape = inputs.shape[:-1] + (1,)
  if len(counts_shape) - 2 == len(window_shape):
    counts_shape = (1,) + counts_shape[1:]
  counts = pool(jnp.ones(counts_shape), 0.0, lax.add, window_shape, strides,
                padding)
  return total / counts


def max_pool(inputs: Array, window_shape: Sequence[int],
             strides: Sequence[int] | None = None,
             padding: LaxPadding = 'VALID') -> Array:
  """Maximum over each window.

  Args:
    inputs: array shaped ``(batch..., window dims..., features)``.
    window_shape: window size per spatial axis.
    strides: step per spatial axis (default all ones).
    padding: ``'SAME'``, ``'VALID'`` (default) or ``(low, high)`` pairs;
      padding counts as ``-inf``.

  Returns:
    The window maxima.
  """
  return pool(inputs, -jnp.inf, lax.max, window_shape, strides, padding)


def min_pool(inputs: Array, window_shape: Sequence[int],
             strides: Sequence[int] | None = None,
             padding: LaxPadding = 'VALID') -> Array:
  """Minimum over each window.

  Args:
    inputs: array shaped ``(batch..., window dims..., features)``.
    window_shape: window size per spatial axis.
    strides: step per spatial axis (default all ones).
    padding: ``'SAME'``, ``'VALID'`` (default) or ``(low, high)`` pairs;
      padding counts as ``+inf``.

  Returns:
    The window minima.
  """
  return pool(inputs, jnp.inf, lax.min, window_shape, strides, padding)
