"""Run code written for ``flax.linen`` on liftmods without editing it.

After :func:`install`, every ``import flax.linen`` (and ``flax.linen.<sub>``,
``from flax import linen``, ``from flax.linen.attention import ...``) gets
liftmods and its matching submodule. The rest of flax stays flax's own:
``flax.core``, ``flax.struct``, ``flax.traverse_util``, ``flax.serialization``
and ``flax.training`` are data structures and utilities that third-party code
mixes with Linen freely, and they work with liftmods' variable trees.

Three ways in:

- ``liftmods.compat.install()`` / ``uninstall()`` (the round trip is exact:
  ``sys.modules`` and the ``flax.linen`` attribute are restored as before);
- ``with liftmods.compat.flax_linen_as_liftmods(): import thirdparty``;
- ``python -m liftmods.compat script.py [args]`` (or ``-m package.module``)
  runs a script you cannot edit with the switch installed. Setting
  ``LIFTMODS_AS_FLAX_LINEN=0`` runs the same command on the real flax.linen,
  so one command line serves both sides of a comparison.
  :func:`install_if_requested` installs the switch when that variable is
  ``1``, for entry points of your own.

A module that imported ``flax.linen`` *before* the switch keeps the objects
it already holds (the real Linen); :func:`install` warns when modules outside
flax hold such references. flax itself imports ``flax.linen`` from its
``__init__``; that copy is left alone and does not trigger the warning.

A name or submodule of ``flax.linen`` that liftmods does not provide fails at
import time with an ``ImportError`` naming it and liftmods' version.

>>> import sys
>>> import liftmods
>>> from liftmods import compat
>>> with compat.flax_linen_as_liftmods():
...   import flax.linen as linen
...   from flax.linen import partitioning
...   print(linen.Dense is liftmods.Dense, partitioning.remat is
...         liftmods.partitioning.remat)
True True
>>> compat.is_installed()
False
"""
import contextlib
import importlib
import importlib.abc
import os
import runpy
import sys
import types
import warnings
from collections.abc import Iterator

__all__ = ['install', 'uninstall', 'is_installed', 'flax_linen_as_liftmods',
           'install_if_requested', 'ENV_VAR', 'SwitchWarning']

ENV_VAR = 'LIFTMODS_AS_FLAX_LINEN'
_PREFIX = 'flax.linen'
_MISSING = object()


class SwitchWarning(UserWarning):
  """Modules imported before the switch keep the real ``flax.linen``."""


class _State:
  saved_modules = None   # {name: module} entries replaced at install
  saved_attr = _MISSING  # flax.linen attribute of the flax package
  finder = None


def _liftmods_version():
  import liftmods  # pylint: disable=import-outside-toplevel
  return liftmods.__version__


def _missing_message(what):
  return (f'{what} is not provided by liftmods {_liftmods_version()}, '
          f'which stands in for flax.linen while liftmods.compat is '
          f'installed (call liftmods.compat.uninstall() or run without the '
          f'switch to use the real flax.linen).')


def _why_missing(real, name):
  """The reason ``real`` gives for not having ``name`` (a Linen name that
  means nothing in liftmods), as text to append to a message, or ''."""
  try:
    getattr(real, name)
  except AttributeError as e:
    why = str(e)
    if why != f'module {real.__name__!r} has no attribute {name!r}':
      return f' {why}'
  return ''


def _target_name(fullname):
  """``flax.linen.attention`` -> ``liftmods.attention``."""
  return 'liftmods' + fullname[len(_PREFIX):]


def _make_alias(fullname, real):
  """A module named ``fullname`` holding the same objects as ``real``.

  It is a package (``__path__``) so that ``from flax.linen.x import name``
  for a name liftmods lacks goes through the finder, which raises the clear
  error instead of Python's generic one.
  """
  alias = types.ModuleType(fullname, real.__doc__)
  alias.__dict__.update(real.__dict__)
  alias.__name__ = fullname
  alias.__path__ = []
  alias.__package__ = fullname
  alias.__liftmods_module__ = real

  def __getattr__(name):  # pylint: disable=invalid-name
    try:
      return getattr(real, name)
    except AttributeError:
      raise AttributeError(
          _missing_message(f"'{fullname}.{name}'") +
          _why_missing(real, name)) from None

  alias.__getattr__ = __getattr__
  alias.__dir__ = lambda: sorted(set(dir(real)))
  return alias


class _Loader(importlib.abc.Loader):

  def __init__(self, real):
    self.real = real

  def create_module(self, spec):
    return _make_alias(spec.name, self.real)

  def exec_module(self, module):
    pass


class _Finder(importlib.abc.MetaPathFinder):
  """Resolves ``flax.linen`` and ``flax.linen.*`` to liftmods."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname != _PREFIX and not fullname.startswith(_PREFIX + '.'):
      return None
    target = _target_name(fullname)
    try:
      real = importlib.import_module(target)
    except ModuleNotFoundError as e:
      if e.name != target:
        raise
      parent, _, leaf = fullname.rpartition('.')
      parent_real = sys.modules.get(_target_name(parent))
      if parent_real is not None and parent != _PREFIX and hasattr(
          parent_real, leaf):
        raise ImportError(_missing_message(
            f"'{fullname}' (liftmods has the attribute {parent}.{leaf} but "
            f"it is not a module)"), name=fullname) from None
      kind = 'the name or submodule' if parent else 'the module'
      why = (_why_missing(parent_real, leaf) if parent_real is not None
             else '')
      raise ImportError(_missing_message(f"{kind} '{fullname}'") + why,
                        name=fullname) from None
    return importlib.util.spec_from_loader(fullname, _Loader(real),
                                           is_package=True)


def _holders_of_real_linen():
  """Names of non-flax modules whose globals reference the real Linen."""
  holders = []
  for name, module in list(sys.modules.items()):
    if module is None or name == 'flax' or name.startswith('flax.'):
      continue
    if name == 'liftmods' or name.startswith('liftmods.') or name == __name__:
      continue
    try:
      values = list(vars(module).values())
    except TypeError:
      continue
    if any(_is_real_linen(value) for value in values):
      holders.append(name)
  return holders


def _is_real_linen(value):
  """Whether ``value`` is the real Linen or one of its objects."""
  try:
    owner = (value.__name__ if isinstance(value, types.ModuleType)
             else getattr(value, '__module__', None))
    return (isinstance(owner, str) and (owner == _PREFIX
                                        or owner.startswith(_PREFIX + '.'))
            and getattr(value, '__liftmods_module__', None) is None)
  except Exception:  # pylint: disable=broad-except
    # Some libraries keep stand-ins that raise on every attribute (trimesh,
    # which brax imports, for an optional dependency that is missing).
    return False


def is_installed() -> bool:
  """Whether the switch is currently installed.

  Returns:
    True while ``flax.linen`` imports resolve to liftmods.
  """
  return _State.finder is not None


def install(warn: bool = True) -> None:
  """Makes later imports of ``flax.linen`` and its submodules get liftmods.

  Idempotent. Modules that already imported the real ``flax.linen`` keep
  it.

  Args:
    warn: issue a :class:`SwitchWarning` listing the modules that keep the
      real ``flax.linen``.
  """
  if is_installed():
    return
  import liftmods  # pylint: disable=import-outside-toplevel,unused-import
  if warn:
    holders = _holders_of_real_linen()
    if holders:
      shown = ', '.join(sorted(holders)[:8])
      more = f' and {len(holders) - 8} more' if len(holders) > 8 else ''
      warnings.warn(
          f'liftmods.compat.install(): modules imported before the switch '
          f'keep the real flax.linen: {shown}{more}. Install the switch '
          f'before importing them.', SwitchWarning, stacklevel=2)
  _State.saved_modules = {
      name: module for name, module in sys.modules.items()
      if name == _PREFIX or name.startswith(_PREFIX + '.')}
  flax = sys.modules.get('flax')
  _State.saved_attr = (getattr(flax, 'linen', _MISSING)
                       if flax is not None else _MISSING)
  for name in _State.saved_modules:
    del sys.modules[name]
  _State.finder = _Finder()
  sys.meta_path.insert(0, _State.finder)
  if flax is not None:
    flax.linen = importlib.import_module(_PREFIX)


def uninstall() -> None:
  """Undoes :func:`install` exactly; a no-op when it is not installed."""
  if not is_installed():
    return
  sys.meta_path.remove(_State.finder)
  _State.finder = None
  for name in [n for n in sys.modules
               if n == _PREFIX or n.startswith(_PREFIX + '.')]:
    del sys.modules[name]
  sys.modules.update(_State.saved_modules)
  flax = sys.modules.get('flax')
  if flax is not None:
    if _State.saved_attr is _MISSING:
      if 'linen' in vars(flax):
        del flax.linen
    else:
      flax.linen = _State.saved_attr
  _State.saved_modules, _State.saved_attr = None, _MISSING


@contextlib.contextmanager
def flax_linen_as_liftmods(warn: bool = True) -> Iterator[None]:
  """Context manager form of :func:`install` / :func:`uninstall`.

  Objects imported inside the block keep referring to liftmods after it.
  A switch installed before the block stays installed after it.

  Args:
    warn: as for :func:`install`.

  Yields:
    None, with the switch installed.
  """
  was_installed = is_installed()
  install(warn=warn)
  try:
    yield
  finally:
    if not was_installed:
      uninstall()


def install_if_requested() -> bool:
  """Installs the switch when the environment sets ``LIFTMODS_AS_FLAX_LINEN=1``.

  Returns:
    Whether it was installed.
  """
  if os.environ.get(ENV_VAR, '0') == '1':
    install()
    return True
  return False


_USAGE = f"""usage: python -m liftmods.compat script.py [args...]
       python -m liftmods.compat -m package.module [args...]

Runs the script or module with flax.linen resolved to liftmods.
{ENV_VAR}=0 runs it on the real flax.linen instead."""


def main(argv):
  """Entry point of ``python -m liftmods.compat``."""
  if not argv or argv[0] in ('-h', '--help') or (argv[0] == '-m'
                                                 and len(argv) < 2):
    print(_USAGE, file=sys.stderr)
    return 2
  if os.environ.get(ENV_VAR, '1') != '0':
    install()
  if argv[0] == '-m':
    sys.argv = argv[1:]
    runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
  else:
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name='__main__')
  return 0


if __name__ == '__main__':
  # Run the imported copy so that liftmods.compat.is_installed() sees the
  # switch from inside the script.
  from liftmods import compat as _compat  # pylint: disable=import-self
  sys.exit(_compat.main(sys.argv[1:]))
