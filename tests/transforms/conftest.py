"""Fixtures of the lifted-transform tests."""
import jax
import pytest


@pytest.fixture(scope='module')
def fast_compiles():
  """Many tiny programs are compiled, most of them twice with identical HLO
  (flax and liftmods, seed 0 and seed 1): skip most XLA optimizations (for
  both libraries alike); the run's persistent compilation cache (the root
  conftest) serves the repeats. Neither changes what is compared. Restored
  after."""
  old = jax.config.read('jax_disable_most_optimizations')
  jax.config.update('jax_disable_most_optimizations', True)
  yield
  jax.config.update('jax_disable_most_optimizations', old)
