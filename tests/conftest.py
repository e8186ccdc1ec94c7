"""Shared by every test folder.

The test files live in one folder per package area (``tests/core``,
``tests/layers``, ``tests/transforms``, ...). This file makes the repository
root and ``tests/`` importable from all of them, whatever the import mode, so
that a test file can use ``benchmarks``, ``examples`` and the comparison
helpers in ``tests/treecheck.py`` (bit-exact tree equality, allclose with
stated tolerances, and the flax-oracle runner); they live in a module of
their own because ``import conftest`` is ambiguous once a test folder has a
``conftest.py`` of its own. It also sets XLA flags that make compiles
cheaper and gives every run a throw-away persistent XLA compilation cache
(below).
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

# Two XLA CPU settings that only change how fast programs compile: the
# legacy elemental emitters instead of the fusion emitters, and one LLVM
# module per program instead of several compiled in parallel (the two
# xdist workers already use both cores). Most of the suite's time is XLA
# compiling small programs; with these the suite takes about a quarter less
# time (make test 555 -> 427 s on the 2-core machine, jaxlib 0.10). Every
# program of a run is compiled alike, so what a test compares does not
# change. XLA stops the process on a flag it does not know, and jaxlib 0.11
# dropped the first, so each flag is probed (``xla_flags.usable``, in a
# child process, once per run: the xdist workers and the subprocesses tests
# start inherit the result through XLA_FLAGS and LIFTMODS_TEST_XLA_PROBED).
# ``LIFTMODS_TEST_XLA_FLAGS=0`` leaves XLA_FLAGS alone.
FAST_COMPILE_FLAGS = ('--xla_cpu_use_fusion_emitters=false',
                      '--xla_cpu_parallel_codegen_split_count=1')
if (os.environ.get('LIFTMODS_TEST_XLA_FLAGS') != '0'
    and not os.environ.get('LIFTMODS_TEST_XLA_PROBED')):
  import xla_flags  # pylint: disable=wrong-import-position
  os.environ['XLA_FLAGS'] = ' '.join(filter(None, (
      os.environ.get('XLA_FLAGS'), *xla_flags.usable(FAST_COMPILE_FLAGS))))
  os.environ['LIFTMODS_TEST_XLA_PROBED'] = '1'

# Importable once tests/ is on sys.path (above); imports no backend.
import treecheck  # pylint: disable=wrong-import-position


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
  """``treecheck.fast_compiles`` for a whole test module (``pytestmark =
  pytest.mark.usefixtures('fast_compiles')``)."""
  with treecheck.fast_compiles():
    yield


def pytest_collection_modifyitems(items):
  """Tests marked ``long`` run first. xdist's work stealing takes tests from
  the back of a worker's queue, so a minutes-long test collected late can
  leave the other worker idle at the end; started first, it overlaps with
  everything else. The sort is stable, so every worker collects the same
  order (xdist requires it)."""
  items.sort(key=lambda item: item.get_closest_marker('long') is None)
