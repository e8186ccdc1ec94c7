"""Every docstring example in the package, run as a doctest.

One collector walks ``liftmods`` and runs the examples of every module that
has any, so a module's examples cannot be forgotten by a hand-kept list.
Modules whose examples need several devices (``DEVICES``) run in a process
of their own with that many simulated CPU devices.
"""
import doctest
import importlib
import os
import pkgutil
import subprocess
import sys

import jax
import pytest

import liftmods

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Examples that lay a pipeline's stages over a mesh of several devices.
DEVICES = {'liftmods.pipeline': 8}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _module_names():
  names = ['liftmods']
  for info in pkgutil.walk_packages(liftmods.__path__, 'liftmods.'):
    names.append(info.name)
  return sorted(names)


def _examples(module):
  finder = doctest.DocTestFinder(exclude_empty=True)
  tests = finder.find(module, module.__name__, globs=vars(module).copy())
  # Names re-exported from other modules are found through their own.
  return [t for t in tests if t.examples and _defined_in(t, module)]


def _defined_in(test, module) -> bool:
  owner = test.name.split('.')
  obj = module
  for part in owner[len(module.__name__.split('.')):]:
    obj = getattr(obj, part, None)
    if obj is None:
      return True
  inner = getattr(obj, '__func__', obj)
  home = getattr(inner, '__module__', module.__name__)
  return home in (None, module.__name__)


MODULES = [n for n in _module_names()
           if _examples(importlib.import_module(n))]


def test_collector_finds_the_modules_with_examples():
  """Modules known to carry examples are collected (a walk that silently
  found nothing would pass every parametrized case)."""
  for name in ('liftmods.module', 'liftmods.core.scope', 'liftmods.pipeline',
               'liftmods.serialization', 'liftmods.stack',
               'liftmods.layers.linear'):
    assert name in MODULES, name
  assert len(MODULES) >= 40, len(MODULES)


def run_examples(name: str):
  """``(failed, attempted)`` for the examples of module ``name``."""
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=OPTIONS)
  for test in _examples(module):
    runner.run(test)
  return runner.summarize(verbose=False)


def _run_on_devices(name: str, count: int):
  flags = os.environ.get('XLA_FLAGS', '')
  env = {**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': f'{flags} --xla_force_host_platform_device_count={count}'}
  code = ('import sys; sys.path.insert(0, "tests/docs"); '
          'from test_doctests import run_examples; '
          f'r = run_examples({name!r}); print(r.failed, r.attempted)')
  proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600,
                        check=False)
  print(proc.stdout[-8000:], proc.stderr[-4000:])
  assert proc.returncode == 0, proc.stderr[-4000:]
  failed, attempted = map(int, proc.stdout.split()[-2:])
  return doctest.TestResults(failed, attempted)


@pytest.mark.parametrize('name', MODULES)
def test_module_examples(name):
  if name in DEVICES:
    result = _run_on_devices(name, DEVICES[name])
  else:
    result = run_examples(name)
    jax.clear_caches()
  assert result.attempted > 0, name
  assert result.failed == 0, (
      f'{result.failed} of {result.attempted} examples failed in {name}; '
      'see the captured output above')
