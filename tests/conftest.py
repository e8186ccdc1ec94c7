"""Shared by every test folder.

The test files live in one folder per package area (``tests/core``,
``tests/layers``, ``tests/transforms``, ...). This file makes the repository
root and ``tests/`` importable from all of them, whatever the import mode, so
that a test file can use ``benchmarks``, ``examples`` and the comparison
helpers in ``tests/treecheck.py`` (bit-exact tree equality, allclose with
stated tolerances, and the flax-oracle runner); they live in a module of
their own because ``import conftest`` is ambiguous once a test folder has a
``conftest.py`` of its own. It also gives every run a throw-away persistent
XLA compilation cache (below).
"""
import os
import pathlib
import sys

import jax
import pytest

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent

for _path in (str(TESTS), str(ROOT)):
  if _path not in sys.path:
    sys.path.insert(0, _path)


@pytest.fixture(scope='session', autouse=True)
def xla_compilation_cache(tmp_path_factory):
  """A persistent compilation cache that lives for one run (one per xdist
  worker): most differential tests compile the same program twice, once
  traced by flax.linen and once by liftmods, and when the two lowered
  modules are the same (the cache key leaves out source locations) the
  second compile is a cache hit. The executable is the one the second
  compile would have built, so nothing compared changes; the suite spends
  about a third less CPU on those tests. Not shared between workers: the
  cache key includes the directory, and a shared one needs jax's file lock,
  whose size accounting (a scan of the directory on every write) left the
  workers idle a third of the time in a trial.
  ``LIFTMODS_TEST_XLA_CACHE=0`` turns it off."""
  if os.environ.get('LIFTMODS_TEST_XLA_CACHE') == '0':
    yield
    return
  from jax.experimental.compilation_cache import compilation_cache as cc
  flags = {'jax_compilation_cache_dir':
               str(tmp_path_factory.mktemp('xla_cache')),
           'jax_persistent_cache_min_compile_time_secs': 0.0,
           'jax_persistent_cache_min_entry_size_bytes': 0}
  before = {k: getattr(jax.config, k) for k in flags}
  for k, v in flags.items():
    jax.config.update(k, v)
  cc.reset_cache()
  yield
  for k, v in before.items():
    jax.config.update(k, v)
  cc.reset_cache()


@pytest.fixture(scope='module')
def fast_compiles():
  """For a test module whose time goes to compiling many small programs
  rather than running them: XLA skips most optimizations while it runs
  (restored after). Programs compared with each other are compiled alike,
  so what a test compares does not change; the modules that use it save
  15-30% of their CPU. Not for tests that compare liftmods' optimized
  programs bit for bit with hand-written ones (the stack tests: an unrolled
  stack differs from a scan in the last bit without the optimizations)."""
  old = jax.config.read('jax_disable_most_optimizations')
  jax.config.update('jax_disable_most_optimizations', True)
  yield
  jax.config.update('jax_disable_most_optimizations', old)


def pytest_collection_modifyitems(items):
  """Tests marked ``long`` run first. xdist's work stealing takes tests from
  the back of a worker's queue, so a minutes-long test collected late can
  leave the other worker idle at the end; started first, it overlaps with
  everything else. The sort is stable, so every worker collects the same
  order (xdist requires it)."""
  items.sort(key=lambda item: item.get_closest_marker('long') is None)
