r"""This Python environment against liftmods' support window.

Prints Python, jax, jaxlib and flax with the range pyproject.toml declares
for each, JAX's default backend and its devices, and the packages that
``--need`` asks for and this environment lacks. Exits 1 when one is
missing; a version outside the window is a warning (an existing environment,
such as a GPU image's, is used as it is: the results record its versions).

  python -m tools.check_env --need=test     # what make test needs
  python -m tools.check_env --need=bench    # what make bench-accel needs
"""
import argparse
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
WINDOW = ('jax', 'jaxlib', 'flax')
# Import names of what each need runs on (the distribution's name where it
# differs is given after a colon).
NEEDS = {
    'core': ['jax', 'jaxlib', 'numpy', 'msgpack'],
    'bench': ['flax', 'absl:absl-py', 'optax'],
    'test': ['flax', 'absl:absl-py', 'optax', 'pytest', 'xdist:pytest-xdist',
             'hypothesis', 'chex', 'orbax.checkpoint:orbax-checkpoint'],
}


def version_tuple(text: str) -> tuple:
  return tuple(int(re.match(r'\d*', part).group() or 0)
               for part in text.split('.')[:3])


def declared() -> dict:
  """``{package: [(op, version), ...]}`` of pyproject's window."""
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  specs = {'python': project['requires-python']}
  for req in project['dependencies'] + project['optional-dependencies']['test']:
    name = re.match(r'[A-Za-z0-9_.-]+', req).group()
    if name in WINDOW:
      specs[name] = req[len(name):]
  return {name: re.findall(r'(>=|<=|==|<|>)\s*([0-9][0-9.]*)', spec)
          for name, spec in specs.items()}


def inside(version: str, spec: list) -> bool:
  ops = {'>=': tuple.__ge__, '<=': tuple.__le__, '==': tuple.__eq__,
         '<': tuple.__lt__, '>': tuple.__gt__}
  have = version_tuple(version)
  return all(ops[op](have, version_tuple(bound)) for op, bound in spec)


def installed(dist: str):
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def backend() -> str:
  """JAX's default backend and devices, read in a child process (so that
  this one never holds accelerator memory)."""
  code = ('import jax; d = jax.devices(); '
          'print(jax.default_backend(), len(d), d[0].device_kind)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, timeout=300, check=False)
  if out.returncode:
    return 'none (JAX failed to start: ' + out.stderr.strip()[-300:] + ')'
  name, count, kind = out.stdout.split(maxsplit=2)
  return f'{name}: {count} x {kind.strip()}'


def missing(need: str) -> list:
  out = []
  for entry in NEEDS['core'] + NEEDS.get(need, []):
    module, _, dist = entry.partition(':')
    try:
      __import__(module)
    except ImportError:
      out.append(dist or module)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--need', choices=sorted(NEEDS), default='core')
  parser.add_argument('--no-backend', action='store_true',
                      help='do not start JAX to name its backend')
  args = parser.parse_args(argv)
  window = declared()
  have = {'python': '.'.join(map(str, sys.version_info[:3]))}
  have.update({name: installed(name) for name in WINDOW})
  outside = []
  print(f'liftmods environment check ({sys.executable})')
  for name, version in have.items():
    spec = ','.join(op + v for op, v in window.get(name, []))
    ok = version is not None and inside(version, window.get(name, []))
    if version is not None and not ok:
      outside.append(name)
    print(f'  {name:7} {version or "not installed":12} supported {spec}'
          + ('' if ok or version is None else '   <- outside the window'))
  if not args.no_backend and have['jax']:
    print(f'  backend {backend()}')
  lacking = missing(args.need)
  if outside:
    print(f'warning: {", ".join(outside)} outside the tested window; '
          'results will record the versions used')
  if lacking:
    print(f'missing for {args.need}: {" ".join(lacking)} '
          "(pip install -e '.[test,bench]', or carry wheels to a machine "
          'without network: docs/benchmarks.md)')
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
