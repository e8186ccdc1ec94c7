"""BatchApply: run a function on inputs whose leading axes are folded into
one batch axis, and unfold its outputs again.

>>> import jax.numpy as jnp
>>> from liftmods.batch_apply import BatchApply
>>> f = BatchApply(lambda x: x.sum(-1, keepdims=True))  # sees (6, 4)
>>> f(jnp.ones((2, 3, 4))).shape
(2, 3, 1)
"""
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from liftmods.typing import Array

__all__ = ['BatchApply', 'arbitrary_mergeable_leaf', 'merge_leading_dims',
           'ndim_at_least', 'split_leading_dim']


def ndim_at_least(x: Any, num_dims: int) -> bool:
  """Whether ``x`` (an array or array-like) has ``num_dims`` axes or more.

  Args:
    x: an array, or anything ``jnp.asarray`` accepts.
    num_dims: the number of axes.

  Returns:
    ``x.ndim >= num_dims``.

  >>> ndim_at_least(3.0, 1), ndim_at_least(np.ones((2, 2)), 2)
  (False, True)
  """
  if not isinstance(x, (jax.Array, np.ndarray)):
    x = jnp.asarray(x)
  return x.ndim >= num_dims


def arbitrary_mergeable_leaf(min_num_dims: int, args: Any,
                             kwargs: Any) -> Any:
  """The first leaf with at least ``min_num_dims`` axes.

  Args:
    min_num_dims: the number of axes needed.
    args: searched first (a pytree).
    kwargs: searched next (a pytree).

  Returns:
    The leaf, or None when there is none.
  """
  for tree in (args, kwargs):
    for leaf in jax.tree_util.tree_leaves(tree):
      if ndim_at_least(leaf, min_num_dims):
        return leaf
  return None


def merge_leading_dims(x: Array, num_dims: int) -> Array:
  """``x`` with its first ``num_dims`` axes folded into one.

  Args:
    x: an array.
    num_dims: how many leading axes to fold.

  Returns:
    The reshaped array, or ``x`` itself when it has fewer axes.

  >>> merge_leading_dims(np.ones((2, 3, 4)), 2).shape
  (6, 4)
  """
  if not ndim_at_least(x, num_dims):
    return x
  return x.reshape((np.prod(x.shape[:num_dims]),) + x.shape[num_dims:])


def split_leading_dim(x: Array, to_dim: tuple[int, ...]) -> Array:
  """``x`` with its first axis unfolded into the shape ``to_dim``.

  Args:
    x: an array.
    to_dim: the leading shape to unfold the first axis into.

  Returns:
    The reshaped array.

  >>> split_leading_dim(np.ones((6, 4)), (2, 3)).shape
  (2, 3, 4)
  """
  return x.reshape(to_dim + x.shape[1:])


class BatchApply:
  """Wraps ``f`` so that the first ``num_dims`` axes of every input with
  that many axes are merged before the call and split after it.

  Inputs with fewer axes pass through unchanged; the outputs are split
  with the leading shape of the first input that was merged. Calling it
  with no input of ``num_dims`` axes raises ``ValueError``.

  Args:
    f: the function to wrap; it sees the merged inputs.
    num_dims: how many leading axes to merge.
  """

  def __init__(self, f: Callable[..., Any], num_dims: int = 2):
    self._f = f
    self.num_dims = num_dims

  def __call__(self, *args, **kwargs):
    example = arbitrary_mergeable_leaf(self.num_dims, args, kwargs)
    if example is None:
      raise ValueError('BatchApply requires at least one input with ndim >= '
                       f'{self.num_dims}.')
    leading = example.shape[:self.num_dims]
    merge = lambda x: merge_leading_dims(x, self.num_dims)
    outputs = self._f(*jax.tree_util.tree_map(merge, args),
                      **jax.tree_util.tree_map(merge, kwargs))
    return jax.tree_util.tree_map(
        lambda y: split_leading_dim(y, leading), outputs)
