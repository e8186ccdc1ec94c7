"""Every cache and memo table of liftmods is in ``core/caching``'s registry,
and the caches table of docs/architecture.md shows that registry.

The sources are scanned for what makes a table: a call of ``BoundedCache``,
``WeakKeyDictionary``, ``WeakValueDictionary`` or ``WeakSet`` (whatever it
is assigned to), an ``lru_cache`` / ``cache`` decorator (the decorated
function), and a dict or set literal at module or class level that some
function of the module fills (``x[k] = v``, ``x.add``, ``x.setdefault``,
...). Per-object memos (``functools.cached_property``, a scope's attributes)
live and die with their object and are not tables.
"""
import ast
import functools
import importlib
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import liftmods as nn
from liftmods import precision
from liftmods.core import caching, init_shapes, lift, lifted_jit

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / 'liftmods'

CONSTRUCTORS = frozenset(('BoundedCache', 'WeakKeyDictionary',
                          'WeakValueDictionary', 'WeakSet'))
DECORATORS = frozenset(('lru_cache', 'cache'))
FILLERS = frozenset(('add', 'setdefault', 'update', 'append', '__setitem__'))

# Tables the scan finds that are not caches, and why.
NOT_CACHES = {
    'serialization._REGISTRY': 'state-dict handlers that users register',
    'core.caching._TABLES': 'the registry itself',
    'core.caching._CLEARERS': 'the registry itself',
    'core.caching._LIVE': 'the registry itself (every live BoundedCache)',
}


def _name_of(node: ast.expr) -> str | None:
  """The last name of ``f`` or ``a.b.f`` (a decorator may be called)."""
  if isinstance(node, ast.Call):
    node = node.func
  if isinstance(node, ast.Attribute):
    return node.attr
  if isinstance(node, ast.Name):
    return node.id
  return None


def _is_empty_literal(node: ast.expr | None) -> bool:
  if isinstance(node, ast.Dict) and not node.keys:
    return True
  return (isinstance(node, ast.Call) and _name_of(node) in (
      'dict', 'set', 'OrderedDict', 'defaultdict') and not node.args[1:])


class _Scanner(ast.NodeVisitor):
  """Collects ``{qualified name: line}`` of the tables in one module."""

  def __init__(self, module: str):
    self.module = module
    self.stack: list[str] = []
    self.found: dict[str, int] = {}
    self.claimed: set[int] = set()  # constructor calls given a name
    self.calls: list[ast.Call] = []
    self.literals: dict[str, tuple[str, int]] = {}  # bare name -> table
    self.filled: set[str] = set()
    self.depth = 0  # functions entered

  def qualify(self, *names: str) -> str:
    return '.'.join((self.module, *self.stack, *names))

  def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
    if any(_name_of(d) in DECORATORS for d in node.decorator_list):
      self.found[self.qualify(node.name)] = node.lineno
    self.stack.append(node.name)
    self.depth += 1
    self.generic_visit(node)
    self.depth -= 1
    self.stack.pop()

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_ClassDef(self, node: ast.ClassDef) -> None:
    self.stack.append(node.name)
    self.generic_visit(node)
    self.stack.pop()

  def visit_Call(self, node: ast.Call) -> None:
    if _name_of(node) in CONSTRUCTORS:
      self.calls.append(node)
    if isinstance(node.func, ast.Attribute) and node.func.attr in FILLERS:
      self.filled.add(_name_of(node.func.value) or '')
    self.generic_visit(node)

  def visit_Assign(self, node: ast.Assign) -> None:
    self._assigned(node.targets, node.value, node.lineno)
    self.generic_visit(node)

  def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
    self._assigned([node.target], node.value, node.lineno)
    self.generic_visit(node)

  def _assigned(self, targets: list, value, line: int) -> None:
    for target in targets:
      if isinstance(target, ast.Subscript):
        self.filled.add(_name_of(target.value) or '')
    if isinstance(value, ast.Call) and _name_of(value) in CONSTRUCTORS:
      self.claimed.add(id(value))
      # ``local = _table[key] = Weak...()`` makes an entry of ``_table``.
      inner = [t for t in targets if isinstance(t, ast.Subscript)]
      for target in inner or targets:
        self.found[self._target_name(target)] = line
    elif _is_empty_literal(value) and not self.depth:
      # A literal at module or class level (not inside a function).
      for target in targets:
        if isinstance(target, ast.Name):
          self.literals[target.id] = (self.qualify(target.id), line)

  def _target_name(self, target: ast.expr) -> str:
    if isinstance(target, ast.Subscript):  # cache = _table[key] = ...
      return f'{self.module}.{_name_of(target.value)}'
    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
        and target.value.id in ('self', 'cls') and len(self.stack) >= 2):
      return '.'.join((self.module, *self.stack[:-1], target.attr))
    return self.qualify(_name_of(target) or '?')

  def tables(self) -> dict[str, int]:
    """The tables found, after the whole module was visited."""
    out = dict(self.found)
    for name, (qualified, line) in self.literals.items():
      if name in self.filled:
        out[qualified] = line
    for call in self.calls:
      if id(call) not in self.claimed:  # made but not assigned: say where
        out[f'{self.module}:<unassigned at line {call.lineno}>'] = call.lineno
    return out


def scan_source(source: str, module: str) -> dict[str, int]:
  """``{qualified name: line}`` of the tables ``source`` makes."""
  scanner = _Scanner(module)
  scanner.visit(ast.parse(source))
  return scanner.tables()


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE).with_suffix('').parts
  if parts[-1] == '__init__':
    parts = parts[:-1]
  return '.'.join(parts)


@functools.lru_cache(maxsize=None)
def scanned() -> dict[str, str]:
  """``{qualified name: file:line}`` for every table of the package."""
  out = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    module = module_name(path)
    for name, line in scan_source(path.read_text(), module).items():
      out[name] = f'{path.relative_to(ROOT)}:{line}'
  return out


def full_registry() -> dict[str, caching.CacheInfo]:
  """The registry once every module with a table is imported."""
  for name in scanned():
    module = name.split(':')[0]
    while module:
      try:
        importlib.import_module(f'liftmods.{module}')
        break
      except ModuleNotFoundError:
        module = module.rpartition('.')[0]
  return {info.name: info for info in caching.registry()}


def test_scanner_finds_every_kind_of_table():
  source = '''
import functools, weakref
from liftmods.core.caching import BoundedCache
A = BoundedCache(8)
_B: dict = {}
_C = set()
_UNUSED = {}
class K:
  shared = BoundedCache(4)
  def __init__(self):
    self.own = weakref.WeakKeyDictionary()
def fill(k):
  _B[k] = 1
  _C.add(k)
  local = {}
  local[k] = 2
  outer = _D[k] = weakref.WeakValueDictionary()
  @functools.lru_cache(maxsize=None)
  def inner(i):
    return i
  return [BoundedCache(2)]
@functools.cache
def memo():
  pass
'''
  found = scan_source(source, 'm')
  assert set(found) == {
      'm.A', 'm._B', 'm._C', 'm.K.shared', 'm.K.own', 'm._D',
      'm.fill.inner', 'm.memo', 'm:<unassigned at line 21>'}, found


def test_every_table_of_the_package_is_registered():
  registered = full_registry()
  missing = {name: where for name, where in scanned().items()
             if name not in registered and name not in NOT_CACHES}
  assert not missing, (
      'register these tables with liftmods.core.caching.register (or name '
      f'the BoundedCache): {missing}')


def test_every_registered_table_exists():
  found = scanned()
  stale = []
  for name in full_registry():
    if name in found:
      continue
    module, _, attr = name.rpartition('.')
    try:
      getattr(importlib.import_module(f'liftmods.{module}'), attr)
    except (ImportError, AttributeError):
      stale.append(name)
  assert not stale, f'registered, but nothing by that name: {stale}'
  assert not set(NOT_CACHES) - set(found), 'NOT_CACHES lists a gone table'


def docs_rows() -> dict[str, list[str]]:
  text = (ROOT / 'docs' / 'architecture.md').read_text()
  section = re.search(r'\n## Caches and memo tables\n(.*?)\n## ', text,
                      re.S).group(1)
  lines = [line for line in section.splitlines() if line.startswith('|')]
  rows = [line.strip().strip('|').split('|') for line in lines[2:]]
  return {cells[0].strip().strip('`'): [c.strip() for c in cells[1:]]
          for cells in rows}


def registry_row(info: caching.CacheInfo) -> list[str]:
  policy = info.policy
  return [policy.holds, policy.keyed_on, policy.bound, policy.cleared,
          'yes' if info.clearable else 'no']


def test_docs_caches_table_shows_the_registry():
  rows = docs_rows()
  registered = full_registry()
  assert sorted(rows) == sorted(registered), (
      'docs/architecture.md lists tables the registry lacks: '
      f'{sorted(set(rows) - set(registered))}; and lacks: '
      f'{sorted(set(registered) - set(rows))}')
  for name, info in registered.items():
    assert rows[name] == registry_row(info), name


def test_bounded_cache_registration_is_checked():
  policy = caching.Policy(holds='x', keyed_on='x', bound='x', cleared='x')
  with pytest.raises(ValueError, match='with a policy a name'):
    caching.BoundedCache(2, policy=policy)
  # A name alone is refused even when the name is registered: every
  # named cache carries its policy.
  for name in ('nowhere.table', 'core.init_shapes._SHAPE_CACHE'):
    with pytest.raises(ValueError, match='with a name needs a policy'):
      caching.BoundedCache(2, name=name)
  with pytest.raises(ValueError, match='another policy'):
    caching.register('core.init_shapes._SHAPE_CACHE', policy)
  assert 'nowhere.table' not in {c.name for c in caching.registry()}


def test_clear_caches_empties_memos_and_results_stay():
  cache = caching.BoundedCache(2)
  cache['a'] = 1

  def model(scope, x):
    return x @ scope.param('kernel', jax.nn.initializers.lecun_normal(),
                           (x.shape[-1], 3))

  x = jnp.ones((2, 4))
  y, variables = nn.core.init(model)(jax.random.key(0), x)
  nn.core.apply(model)(variables, x)  # a stored parameter's shape check
  assert len(init_shapes._SHAPE_CACHE) > 0
  key_numbers = dict(precision._KEY_NUMBERS)
  caching.clear_caches()
  assert len(cache) == 0
  assert len(init_shapes._SHAPE_CACHE) == 0
  assert precision._KEY_NUMBERS == key_numbers  # meaningful: never cleared
  assert (nn.core.apply(model)(variables, x) == y).all()
  _, again = nn.core.init(model)(jax.random.key(0), x)
  assert (again['params']['kernel'] == variables['params']['kernel']).all()


def test_cleared_says_only_when_entries_leave_by_themselves():
  # Emptying by clear_caches() is the clearable flag's business.
  for info in full_registry().values():
    assert 'clear_caches' not in info.policy.cleared, info.name


def test_clear_caches_empties_the_caches_made_per_jitted_function():
  info = full_registry()['core.lifted_jit.jit.cache']
  assert info.clearable and info.policy is lifted_jit.JIT_CACHE_POLICY
  traces = []

  def body(scope, hash_key, x):
    del scope, hash_key
    traces.append(None)
    return x * 2

  jitted = lift.jit(body)
  run = nn.core.apply(lambda scope, x: jitted(scope, 'key', x))
  x = jnp.ones(3)
  for _ in range(2):
    assert (run({}, x) == 2).all()
  assert len(traces) == 1
  caching.clear_caches()
  assert (run({}, x) == 2).all()
  assert len(traces) == 2  # a new entry, traced again
