"""Runs every ```python block of docs/**/*.md and README.md.

Each block is one test (id ``<file>:<n>``, ``n`` counting the file's python
blocks from 1) and runs with ``exec`` in a fresh namespace, so a block must
be self-contained: its own imports, no names from earlier blocks. A block
whose first line is ``# doctest: skip`` is reported as skipped, not run. A
block with a line ``# printed figures: jax X`` prints compiler figures (memory
sizes) measured on that JAX: on another version it runs, its assertions
hold, and its printed output is not compared.
Tracebacks point at the markdown file and its line numbers.

A block fails if it lets any warning escape (a block that means to show a
warning catches it itself). When a ```text block follows a python block,
with nothing between them but blank lines and at most one line of prose
(e.g. "which prints"), it states the block's output: what the block prints
must equal it, line by line, ignoring trailing spaces.
"""
import contextlib
import io
import pathlib
import re
import warnings

import jax
import pytest
from treecheck import fast_compiles

# Doc blocks are small programs compiled once; the memory table below turns
# the optimizations back on.
pytestmark = pytest.mark.usefixtures('fast_compiles')

ROOT = pathlib.Path(__file__).resolve().parents[2]
SKIP_MARKER = '# doctest: skip'
# Blocks run by `make test-integration` instead of `make test`, found by a
# line they contain (so the markdown stays clean).
INTEGRATION_BLOCKS = (
    # stacks.md's memory table: ten gradient compiles, 16 CPU-s
    'def temp_bytes(length, batch, policy):',
)

# A fence line: ``` plus an optional language. Blocks run from an opening
# fence to the next bare ``` line; only python/py blocks are collected.
_FENCE = re.compile(r'^(?P<indent>[ \t]*)```(?P<lang>[A-Za-z0-9_+-]*)[ \t]*$')


def _doc_files():
  files = sorted((ROOT / 'docs').rglob('*.md'))
  readme = ROOT / 'README.md'
  if readme.exists():
    files.append(readme)
  return files


def _fenced(lines):
  """``[(lang, first_line_index, end_index, body_lines)]`` of every fence."""
  out = []
  i = 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:  # outside any block, every fence opens one
      i += 1
      continue
    indent, lang = m.group('indent'), m.group('lang').lower()
    start = i + 1
    j = start
    while j < len(lines) and lines[j].strip() != '```':
      j += 1
    body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
            for ln in lines[start:j]]
    out.append((lang, start, j, body))
    i = j + 1
  return out


def extract_blocks(text: str, with_output: bool = False):
  """``[(first_code_line, code)]`` for the python blocks of ``text``;
  ``first_code_line`` is 1-based. Block indentation is removed. With
  ``with_output``, triples whose last item is the stated output (or None)."""
  lines = text.splitlines()
  fences = _fenced(lines)
  blocks = []
  for k, (lang, start, end, body) in enumerate(fences):
    if lang not in ('python', 'py'):
      continue
    stated = None
    if k + 1 < len(fences) and fences[k + 1][0] == 'text':
      between = [ln for ln in lines[end + 1:fences[k + 1][1] - 1]
                 if ln.strip()]
      if len(between) <= 1:
        stated = '\n'.join(fences[k + 1][3])
    code = '\n'.join(body) + '\n'
    blocks.append((start + 1, code, stated) if with_output
                  else (start + 1, code))
  return blocks


def _label(rel: pathlib.Path) -> str:
  """``transforms.md``, ``api/core.md``, ``README.md``: the path under
  docs/, or the file name."""
  if rel.parts[0] == 'docs':
    return rel.relative_to('docs').as_posix()
  return rel.name


def _is_integration(code):
  return any(line_ in code for line_ in INTEGRATION_BLOCKS)


def _collect():
  params = []
  for path in _doc_files():
    rel = path.relative_to(ROOT)
    for n, (line, code, stated) in enumerate(
        extract_blocks(path.read_text(encoding='utf-8'), with_output=True),
        start=1):
      first = code.lstrip().splitlines()[0].strip() if code.strip() else ''
      marks = ()
      if first == SKIP_MARKER:
        marks = (pytest.mark.skip(reason=f'{rel}:{n} is marked '
                                  f'"{SKIP_MARKER}"'),)
      elif _is_integration(code):
        marks = (pytest.mark.integration,)
      params.append(pytest.param(str(rel), line, code, stated, marks=marks,
                                 id=f'{_label(rel)}:{n}'))
  return params


BLOCKS = _collect()


def test_docs_have_python_blocks():
  assert any(p.values[0].startswith('docs') for p in BLOCKS), (
      'no ```python blocks found under docs/')


@pytest.mark.parametrize('line', INTEGRATION_BLOCKS)
def test_integration_blocks_exist(line):
  """Each entry still selects exactly one block (an edited block would
  otherwise quietly move back to make test, or out of both runs' view)."""
  assert sum(line in p.values[2] for p in BLOCKS) == 1, line


def _lines(text):
  return [ln.rstrip() for ln in text.strip('\n').splitlines()]


@pytest.mark.parametrize('path,line,code,stated', BLOCKS)
def test_doc_block(path, line, code, stated):
  # Pad with blank lines so that tracebacks show the markdown line numbers.
  compiled = compile('\n' * (line - 1) + code, str(ROOT / path), 'exec')
  namespace = {'__name__': '__main__', '__file__': str(ROOT / path)}
  printed = io.StringIO()
  # The integration blocks report memory figures of optimized programs.
  with warnings.catch_warnings(record=True) as caught, \
      contextlib.redirect_stdout(printed), \
      fast_compiles(enabled=not _is_integration(code)):
    warnings.simplefilter('always')
    exec(compiled, namespace)  # pylint: disable=exec-used
  escaped = [f'{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})'
             for w in caught]
  assert not escaped, f'{path}:{line} printed warnings:\n' + '\n'.join(
      escaped)
  pinned = re.search(r'^# printed figures: jax (\S+)$', code, re.M)
  if pinned and pinned.group(1) != jax.__version__:
    stated = None  # the compiler's own figures, stated for another JAX
  if stated is not None:
    assert _lines(printed.getvalue()) == _lines(stated), (
        f'{path}:{line}: printed output differs from the page')


def test_count_of_executed_blocks():
  """Every block runs unless marked; the count is the figure reported."""
  skipped = [p for p in BLOCKS if p.marks]
  assert len(BLOCKS) - len(skipped) >= 100, len(BLOCKS)


def test_api_reference_fences_doctest_examples():
  pytest.importorskip('griffe')  # the docs extra
  import sys
  sys.path.insert(0, str(ROOT / 'tools'))
  try:
    from griffe_doctest_fences import fence_doctests
  finally:
    sys.path.pop(0)
  text = ('Adds.\n\n>>> f(1)\n2\n>>> v["a"]["b"]\n\nMore.\n\n'
          '```python\n>>> untouched\n```')
  assert fence_doctests(text) == (
      'Adds.\n\n```pycon\n>>> f(1)\n2\n>>> v["a"]["b"]\n```\n\nMore.\n\n'
      '```python\n>>> untouched\n```')
