"""Bit-for-bit comparison of variable trees, shared by differential tests."""
import jax
import numpy as np


def plain(tree):
  """``tree`` as nested dicts of numpy arrays (FrozenDicts and
  ``flax.core.nn`` embeddings, which carry a ``table``, included)."""
  if hasattr(tree, 'items'):
    return {k: plain(v) for k, v in tree.items()}
  if hasattr(tree, 'table'):
    return {'table': np.asarray(tree.table)}
  return jax.tree_util.tree_map(np.asarray, tree)


def assert_identical(expected, actual):
  """Same paths, dtypes, shapes and values, leaf by leaf."""
  e = jax.tree_util.tree_flatten_with_path(plain(expected))[0]
  a = jax.tree_util.tree_flatten_with_path(plain(actual))[0]
  assert [p for p, _ in e] == [p for p, _ in a]
  for (path, x), (_, y) in zip(e, a):
    assert x.dtype == y.dtype and x.shape == y.shape, path
    np.testing.assert_array_equal(x, y, err_msg=str(path))
