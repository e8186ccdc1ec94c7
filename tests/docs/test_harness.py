"""The test run's own settings (tests/conftest.py, tests/treecheck.py) keep
what the tests compare unchanged."""
import jax
import numpy as np
import pytest

from treecheck import fast_compiles

INIT = jax.nn.initializers.normal(1.0)
KEYS = jax.random.split(jax.random.key(3), 64)


def _eager():
  return np.stack([np.asarray(INIT(k, (4,))) for k in KEYS])


def _scanned():
  body = lambda carry, key: (carry, INIT(key, (4,)))
  return np.asarray(jax.jit(lambda ks: jax.lax.scan(body, 0, ks)[1])(KEYS))


def test_fast_compiles_leaves_no_unoptimized_executable_behind():
  # Unoptimized, the eager draw differs from the optimized one in the last
  # bit for some keys; after the block, eager and scanned agree again.
  with fast_compiles():
    unoptimized = _eager()
  eager, scanned = _eager(), _scanned()
  np.testing.assert_array_equal(eager, scanned)
  if not (unoptimized != eager).any():
    pytest.skip('this jaxlib draws the same bits unoptimized: nothing shown')


def test_fast_compiles_builds_its_own_executables():
  # An optimized eager draw compiled before the block does not serve the
  # block, where eager and scanned are both unoptimized and agree.
  optimized = _eager()
  with fast_compiles():
    eager, scanned = _eager(), _scanned()
  np.testing.assert_array_equal(eager, scanned)
  if not (optimized != eager).any():
    pytest.skip('this jaxlib draws the same bits unoptimized: nothing shown')


def test_optimizations_back_on_inside_a_fast_block():
  # test_docs' memory table: optimized programs inside a fast module.
  optimized = _eager()
  with fast_compiles():
    unoptimized = _eager()
    with fast_compiles(enabled=False):
      np.testing.assert_array_equal(_eager(), optimized)
    np.testing.assert_array_equal(_eager(), unoptimized)
  if not (optimized != unoptimized).any():
    pytest.skip('this jaxlib draws the same bits unoptimized: nothing shown')
