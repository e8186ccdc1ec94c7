"""Runs a file of test cases in a fresh process with N simulated CPU devices.

The device count is fixed when JAX starts, and the rest of the suite shares
its (xdist worker) processes with one device, so multi-device cases get a
process of their own with ``--xla_force_host_platform_device_count=N``.
"""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def simulate(devices: int = 8) -> None:
  """Asks for ``devices`` simulated CPU devices: a cases file calls it
  before anything starts a JAX backend (JAX reads XLA_FLAGS then)."""
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={devices}')


def require(devices: int = 8) -> None:
  """Skips the calling cases file when JAX started with fewer devices (it
  was imported in a process that had a backend already)."""
  import jax  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  if jax.device_count() < devices:
    pytest.skip(f'needs {devices} devices: JAX was started before XLA_FLAGS '
                'was set (run this file in its own process)',
                allow_module_level=True)


def assert_cases_pass(cases: pathlib.Path, devices: int = 8,
                      marks: str = ''):
  """Runs pytest on ``cases`` (only those ``marks`` selects, a ``-m``
  expression, when given); fails with its output unless all pass."""
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      f' --xla_force_host_platform_device_count={devices}')
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(
      [str(ROOT)] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep)
                     if p])
  env.pop('PYTEST_XDIST_WORKER', None)
  proc = subprocess.run(
      [sys.executable, '-m', 'pytest', str(cases), '-o', 'addopts=', '-q',
       '-p', 'no:cacheprovider', '-p', 'no:xdist', '-rs'] +
      (['-m', marks] if marks else []),
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-6000:]
  assert 'passed' in output and 'skipped' not in output, output[-3000:]
