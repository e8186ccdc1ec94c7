"""Fixtures of the lifted-transform tests."""
import jax
import pytest


_CACHE_FLAGS = ('jax_compilation_cache_dir',
                'jax_persistent_cache_min_compile_time_secs',
                'jax_persistent_cache_min_entry_size_bytes',
                'jax_disable_most_optimizations')


@pytest.fixture(scope='module')
def fast_compiles(tmp_path_factory):
  """Many tiny programs are compiled, most of them twice with identical HLO
  (flax and liftmods, seed 0 and seed 1): skip most XLA optimizations (for
  both libraries alike) and let a throw-away persistent compilation cache
  serve the repeats. Neither changes what is compared. Restored after."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  old = {k: (jax.config.read(k) if k == 'jax_disable_most_optimizations'
              else getattr(jax.config, k)) for k in _CACHE_FLAGS}
  jax.config.update('jax_compilation_cache_dir',
                    str(tmp_path_factory.mktemp('xla_cache')))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  jax.config.update('jax_disable_most_optimizations', True)
  cc.reset_cache()
  yield
  for k, v in old.items():
    jax.config.update(k, v)
  cc.reset_cache()
