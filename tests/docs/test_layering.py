"""The layer map of docs/architecture.md, checked against liftmods' imports.

The map is the fenced block under "## The map" in docs/architecture.md:
one line per rank, bottom first, ``RANK  name name dir/ ...``, where a name
is a module of the package (``module`` is ``liftmods/module.py``) and
``dir/`` stands for everything under that folder (the longest match wins, so
``core/nn/`` can sit above ``core/``). A module may import from its own rank
and the ranks below. The tests here fail on

* a module of the package that the map does not place,
* an import (at the top of a file or inside a function) that climbs to a
  higher rank, unless it is one of the commented ``UPWARD`` exceptions,
* any use of another module's private name: ``from liftmods.x import _y`` or
  ``x._y`` on an imported liftmods module.
"""
import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / 'liftmods'

# Imports that climb the map on purpose. Each is done inside a function, at
# call time, and says why.
UPWARD = {
    # Module.tabulate is Linen's API on the class; the table itself is built
    # by the reporting layer, imported when the method is called.
    ('liftmods.module', 'liftmods.summary'),
}


def read_map():
  text = (ROOT / 'docs' / 'architecture.md').read_text()
  block = re.search(r'## The map\n.*?```text\n(.*?)```', text, re.S).group(1)
  ranks = {}
  for line in block.splitlines():
    match = re.match(r'\s*(\d+)\s+(.*)', line)
    if match:
      for word in match.group(2).split():
        ranks[word] = int(match.group(1))
  return ranks


def module_names():
  for path in sorted(PACKAGE.rglob('*.py')):
    parts = path.relative_to(ROOT).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    yield '.'.join(parts), path


def rank_of(module, ranks):
  """The rank of a dotted module name, or None when the map leaves it out."""
  rel = module.split('.')[1:]
  if not rel:
    return ranks.get('__init__')
  best, best_len = None, -1
  for word, rank in ranks.items():
    if word.endswith('/'):
      prefix = word[:-1].split('/')
      if rel[:len(prefix)] == prefix and len(prefix) > best_len:
        best, best_len = rank, len(prefix)
    elif word.split('/') == rel and len(rel) > best_len:
      best, best_len = rank, len(rel)
  return best


def is_module(dotted):
  path = ROOT.joinpath(*dotted.split('.'))
  return path.with_suffix('.py').exists() or path.is_dir()


@functools.lru_cache(maxsize=None)
def parse(path):
  return ast.parse(path.read_text())


def imports(path):
  """(target module, imported name or None, line) for every liftmods import,
  plus the liftmods modules bound to local names (for ``x._y`` checks)."""
  found, bound = [], {}
  for node in ast.walk(parse(path)):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (
        node.module or '').split('.')[0] == 'liftmods':
      for alias in node.names:
        full = f'{node.module}.{alias.name}'
        if is_module(full):
          found.append((full, None, node.lineno))
          bound[alias.asname or alias.name] = full
        else:
          found.append((node.module, alias.name, node.lineno))
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split('.')[0] == 'liftmods':
          found.append((alias.name, None, node.lineno))
          if alias.asname:
            bound[alias.asname] = alias.name
  return found, bound


def test_every_module_is_on_the_map():
  ranks = read_map()
  missing = [name for name, _ in module_names() if rank_of(name, ranks) is None]
  assert not missing, f'place these in docs/architecture.md: {missing}'


def test_no_import_climbs_the_map():
  ranks = read_map()
  climbs = []
  for name, path in module_names():
    own = rank_of(name, ranks)
    for target, _, line in imports(path)[0]:
      if target == name or (name, target) in UPWARD:
        continue
      if rank_of(target, ranks) > own:
        climbs.append(f'{path.relative_to(ROOT)}:{line} ({name}, rank {own})'
                      f' imports {target} (rank {rank_of(target, ranks)})')
  assert not climbs, '\n'.join(climbs)


def test_upward_exceptions_are_still_needed():
  used = set()
  for name, path in module_names():
    used.update((name, target) for target, _, _ in imports(path)[0])
  assert UPWARD <= used, UPWARD - used


def test_no_private_name_crosses_modules():
  crossings = []
  for name, path in module_names():
    found, bound = imports(path)
    for target, imported, line in found:
      if imported and imported.startswith('_') and target != name:
        crossings.append(f'{path.relative_to(ROOT)}:{line} imports '
                         f'{imported} from {target}')
    for node in ast.walk(parse(path)):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in bound and node.attr.startswith('_')
          and not node.attr.startswith('__')):
        crossings.append(f'{path.relative_to(ROOT)}:{node.lineno} uses '
                         f'{bound[node.value.id]}.{node.attr}')
  assert not crossings, '\n'.join(crossings)


def test_rank_of_reads_folders_and_longest_match():
  ranks = {'core/': 1, 'core/nn/': 4, 'module': 2, '__init__': 7}
  assert rank_of('liftmods.core.scope', ranks) == 1
  assert rank_of('liftmods.core.nn.linear', ranks) == 4
  assert rank_of('liftmods.module', ranks) == 2
  assert rank_of('liftmods', ranks) == 7
  assert rank_of('liftmods.stack', ranks) is None


def test_the_core_holds_no_text_of_the_classes_above_it():
  """A loop's caller words its errors (layer_scan.Explain); the core's code
  and messages never name nn.Stack or the pipeline."""
  found = []
  for path in sorted((PACKAGE / 'core').rglob('*.py')):
    for number, line in enumerate(path.read_text().splitlines(), 1):
      if re.search(r'\bStack\b|\bPipeline\b|stack\.scan', line):
        found.append(f'{path.relative_to(ROOT)}:{number}: {line.strip()}')
  assert not found, '\n'.join(found)
