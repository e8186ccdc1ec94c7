"""Source hygiene: no runs of more than two blank lines in the package."""
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / 'liftmods'


def test_no_runs_of_blank_lines():
  found = []
  for path in sorted(PACKAGE.rglob('*.py')):
    text = path.read_text()
    for match in re.finditer(r'\n\n\n\n+', text):
      line = text.count('\n', 0, match.start()) + 2
      found.append(f'{path.relative_to(PACKAGE.parent)}:{line}')
  assert not found, 'more than two blank lines at ' + ', '.join(found)
