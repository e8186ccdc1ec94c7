"""A griffe extension for the API reference: fences doctest examples.

liftmods docstrings carry runnable ``>>>`` examples in plain text (they run
under doctest). Markdown would read them as block quotes, and text such as
``v['params']['kernel']`` as reference links; this wraps each example (the
``>>>``/``...`` lines and their output, up to a blank line) in a ``pycon``
code fence so it renders as code.
"""
import griffe

FENCE = '```'


def fence_doctests(text: str) -> str:
  out, lines, i = [], text.splitlines(), 0
  in_fence = False
  while i < len(lines):
    line = lines[i]
    if line.lstrip().startswith(FENCE):
      in_fence = not in_fence
    if in_fence or not line.lstrip().startswith('>>>'):
      out.append(line)
      i += 1
      continue
    indent = line[:len(line) - len(line.lstrip())]
    out.append(f'{indent}{FENCE}pycon')
    while i < len(lines) and lines[i].strip():
      out.append(lines[i])
      i += 1
    out.append(f'{indent}{FENCE}')
  return '\n'.join(out)


class DoctestFences(griffe.Extension):
  """Fences the ``>>>`` examples of every docstring."""

  def on_object(self, *, obj, **kwargs):
    if obj.docstring is not None and '>>>' in obj.docstring.value:
      obj.docstring.value = fence_doctests(obj.docstring.value)
