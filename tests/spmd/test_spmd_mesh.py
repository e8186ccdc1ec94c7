"""Runs the 8-device cases (tests/spmd/spmd_mesh_cases.py) in a fresh process.

The number of simulated CPU devices is fixed when JAX starts, and the rest
of the suite shares its (xdist worker) processes with one device, so the
cases get a process of their own with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_spmd_cases_pass_on_eight_devices():
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      ' --xla_force_host_platform_device_count=8')
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(
      [str(ROOT)] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep)
                     if p])
  env.pop('PYTEST_XDIST_WORKER', None)
  proc = subprocess.run(
      [sys.executable, '-m', 'pytest', str(ROOT / 'tests' / 'spmd' / 'spmd_mesh_cases.py'),
       '-o', 'addopts=', '-q', '-p', 'no:cacheprovider', '-p', 'no:xdist',
       '-rs'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-6000:]
  assert 'passed' in output and 'skipped' not in output, output[-3000:]
