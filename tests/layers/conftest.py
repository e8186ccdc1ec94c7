"""Fixtures of the layer tests."""
import jax
import pytest


@pytest.fixture(scope='module', autouse=True)
def unoptimized_compiles():
  """Layers are compared with flax.linen compiled under the same flags, so
  skipping most XLA optimizations (for both alike) changes nothing compared
  and saves compile time. Restored after."""
  old = jax.config.read('jax_disable_most_optimizations')
  jax.config.update('jax_disable_most_optimizations', True)
  yield
  jax.config.update('jax_disable_most_optimizations', old)
