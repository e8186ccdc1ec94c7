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


def _under(fast, fn):
  with fast_compiles(enabled=fast):
    return fn()


def _skip_if_same(optimized, unoptimized):
  # Unoptimized, the eager draw differs from the optimized one in the last
  # bit for some keys; a jaxlib where it does not leaves nothing to show.
  if not (optimized != unoptimized).any():
    pytest.skip('this jaxlib draws the same bits unoptimized')


@pytest.mark.parametrize('fast_first', [True, False],
                         ids=['fast-then-optimized', 'optimized-then-fast'])
def test_a_setting_never_runs_the_other_settings_executables(fast_first):
  earlier = _under(fast_first, _eager)  # compiled and cached first
  eager, scanned = _under(not fast_first, lambda: (_eager(), _scanned()))
  np.testing.assert_array_equal(eager, scanned)
  _skip_if_same(earlier, eager)


def test_optimizations_back_on_inside_a_fast_block():
  # test_docs' memory table: optimized programs inside a fast module.
  optimized = _eager()
  with fast_compiles():
    unoptimized = _eager()
    with fast_compiles(enabled=False):
      np.testing.assert_array_equal(_eager(), optimized)
    np.testing.assert_array_equal(_eager(), unoptimized)
  _skip_if_same(optimized, unoptimized)
