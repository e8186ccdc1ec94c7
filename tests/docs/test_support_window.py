"""The support window: pyproject.toml's ranges, the "Supported versions"
table of docs/getting-started.md and ``tools/check_env.py`` agree, and this
run's environment lies inside the window."""
import pathlib
import re
import subprocess
import sys

import flax
import jax
import jaxlib

from tools import check_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _table():
  text = (ROOT / 'docs' / 'getting-started.md').read_text()
  section = text.split('## Supported versions', 1)[1].split('\n## ', 1)[0]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip('|').split('|')]
    if len(cells) == 3 and cells[0] and not set(cells[0]) <= {'-'}:
      rows[cells[0].split(' (')[0]] = cells[1:]
  return rows, section


def test_pyproject_declares_each_window():
  window = check_env.declared()
  assert window['python'] == [('>=', '3.11')]
  for name in ('jax', 'jaxlib'):
    assert window[name] == [('>=', '0.10.2'), ('<', '0.13')], name
  assert window['flax'] == [('>=', '0.12.8'), ('<', '0.13')]


def test_the_docs_table_names_the_lowest_ends():
  rows, section = _table()
  window = check_env.declared()
  assert rows['Python'][0] == window['python'][0][1]
  assert rows['jax, jaxlib'][0] == window['jax'][0][1]
  assert rows['flax'][0] == window['flax'][0][1]
  for name, spec in window.items():
    for op, bound in spec:
      if op == '<':
        assert f'< {bound}' in section, (name, bound)


def test_this_environment_is_inside_the_window():
  window = check_env.declared()
  have = {'python': '.'.join(map(str, sys.version_info[:3])),
          'jax': jax.__version__, 'jaxlib': jaxlib.__version__,
          'flax': flax.__version__}
  for name, version in have.items():
    assert check_env.inside(version, window[name]), (name, version)


def test_inside_compares_release_numbers():
  spec = [('>=', '0.10.2'), ('<', '0.13')]
  assert check_env.inside('0.10.2', spec)
  assert check_env.inside('0.12.0.1', spec)
  assert not check_env.inside('0.10.1', spec)
  assert not check_env.inside('0.13.0', spec)
  assert check_env.version_tuple('0.13.0rc1') == (0, 13, 0)


def test_check_env_passes_here_and_names_what_is_missing():
  result = subprocess.run(
      [sys.executable, '-m', 'tools.check_env', '--need=test',
       '--no-backend'], cwd=ROOT, capture_output=True, text=True,
      check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  assert re.search(r'jax\s+' + re.escape(jax.__version__), result.stdout)
  # A Python with none of the packages: each is named, exit status 1.
  bare = subprocess.run(
      [sys.executable, '-S', '-m', 'tools.check_env', '--need=bench',
       '--no-backend'], cwd=ROOT, capture_output=True, text=True,
      check=False)
  assert bare.returncode == 1, bare.stdout + bare.stderr
  assert 'missing for bench: jax jaxlib numpy msgpack flax absl-py optax' in (
      bare.stdout)


def test_make_runs_in_an_existing_environment_with_an_empty_venv():
  """``VENV=`` (a GPU image's own Python): make installs nothing and runs
  the interpreter given as PY; here the test's own, which has everything."""
  dry = subprocess.run(
      ['make', '-n', 'bench-accel', 'VENV=', f'PY={sys.executable}',
       'ACCEL_REQUIRE=gpu'], cwd=ROOT, capture_output=True, text=True,
      check=True).stdout
  assert '-m venv' not in dry and 'pip install' not in dry, dry
  assert (f'{sys.executable} -m benchmarks.accelerator '
          '--out_dir=bench-out/accel \\\n  --require_backend=gpu') in dry, dry
  result = subprocess.run(
      ['make', '--no-print-directory', 'env-check', 'VENV=',
       f'PY={sys.executable}'], cwd=ROOT, capture_output=True, text=True,
      check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f'liftmods environment check ({sys.executable})' in result.stdout
