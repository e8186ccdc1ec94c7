"""Runs another library's pytest suite on flax.linen and on liftmods.

    python tools/compare_suites.py [--workdir DIR] -- PYTEST_ARGS...

runs ``pytest PYTEST_ARGS`` twice through ``python -m liftmods.compat``:
once with ``LIFTMODS_AS_FLAX_LINEN=0`` (the real flax.linen) and once with
the switch on, each writing a JUnit report, then prints the pass counts of
both sides and every test whose outcome differs. ``tools/`` is put on the
path and the ``no_tensorflow`` plugin loaded, so suites whose modules import
TensorFlow only for logging or datasets still collect. Exit status 1 when a
test passes on flax.linen but not on liftmods.

docs/quantization.md gives the commands for qwix's and AQT's suites.
"""
import argparse
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

TOOLS = pathlib.Path(__file__).resolve().parent
SIDES = (('flax.linen', '0'), ('liftmods', '1'))


def outcomes(report: pathlib.Path) -> dict:
  """``{test id: 'passed' | 'failed' | 'skipped'}`` from a JUnit report."""
  result = {}
  for case in ET.parse(report).getroot().iter('testcase'):
    where = case.get('file') or case.get('classname')
    name = f"{where}::{case.get('name')}"
    if case.find('skipped') is not None:
      result[name] = 'skipped'
    elif case.find('failure') is not None or case.find('error') is not None:
      result[name] = 'failed'
    else:
      result[name] = 'passed'
  return result


def run_side(flag: str, report: pathlib.Path, pytest_args, workdir) -> None:
  env = {**os.environ, 'LIFTMODS_AS_FLAX_LINEN': flag,
         'PYTHONPATH': os.pathsep.join(
             p for p in (str(TOOLS), os.environ.get('PYTHONPATH')) if p)}
  subprocess.run([sys.executable, '-m', 'liftmods.compat', '-m', 'pytest',
                  '-q', '-p', 'no:cacheprovider', '-p', 'no_tensorflow',
                  '-o', 'junit_family=xunit1', f'--junitxml={report}',
                  *pytest_args],
                 env=env, cwd=workdir, check=False)


def summary(results: dict) -> str:
  passed = sum(v == 'passed' for v in results.values())
  return f'{passed}/{len(results)} passed'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', default='.', help='where pytest runs')
  parser.add_argument('pytest_args', nargs='+')
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir).resolve()
  results = {}
  for side, flag in SIDES:
    report = workdir / f'.compare-{flag}.xml'
    run_side(flag, report, args.pytest_args, workdir)
    results[side] = outcomes(report)
    report.unlink()
  flax_side, ours = results['flax.linen'], results['liftmods']
  print(f'flax.linen: {summary(flax_side)}; liftmods: {summary(ours)}')
  for test in sorted(set(flax_side) | set(ours)):
    a, b = flax_side.get(test, 'missing'), ours.get(test, 'missing')
    if a != b:
      print(f'  differs: {test}: flax.linen {a}, liftmods {b}')
  failing = sorted(t for t, v in flax_side.items() if v == 'failed')
  if failing:
    print(f'failing under flax.linen itself ({len(failing)}):')
    for test in failing:
      print(f'  {test}')
  regressions = [t for t, v in flax_side.items()
                 if v == 'passed' and ours.get(t) != 'passed']
  return 1 if regressions else 0


if __name__ == '__main__':
  sys.exit(main())
