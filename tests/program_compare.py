"""Deciding whether two results may be compared bit for bit.

XLA promises the same bits from the same compiled program on the same
inputs, and nothing more: two different programs computing the same math
(an Explicit mesh and an Auto one, sharded and unsharded, pipelined and
not) may fuse, vectorize, contract multiply-adds into FMAs or reduce in
another order, and whether that moves the last bit depends on the CPU that
runs them. So a cross-program test asserts bitwise equality only where the
two optimized per-device programs are the same, and otherwise compares to
float rounding, with the tolerance's reason at the call site.

- ``optimized_hlo(fn, *args)``: the canonical text of ``fn``'s optimized,
  per-device (SPMD-partitioned) HLO for ``args``. ``fn`` is anything with
  ``.lower`` (a ``jax.jit`` function, or ``nn.init_sharded``'s function,
  whose ``lower`` returns ``(lowered, shardings)``). Call it under the same
  mesh and rules contexts as the run it describes.
- ``canonical_hlo(text)``: the text with what names or annotates a program
  rather than what it computes removed: the module's name, op metadata (op
  names, source lines, stack frames), sharding annotations (the program is
  already partitioned: its shapes and collectives say what each device
  computes) and instruction and computation names (renumbered in order of
  first use).
- ``run_compiled(fn, *args)``: ``(fn(*args), optimized_hlo(fn, *args))``
  for a ``jax.jit`` function, compiling once.
- ``same_programs(pairs)``: whether every ``(hlo_a, hlo_b)`` pair is equal.
- ``assert_match(actual, expected, pairs, *, rtol, atol, what='')``:
  ``treecheck.assert_identical`` when ``same_programs(pairs)``, else
  ``treecheck.assert_close`` with ``rtol``/``atol``; returns True when it
  compared bit for bit.

>>> canonical_hlo('HloModule jit_f, num_partitions=1\\n\\n'
...               'ENTRY %main.3 (x.1: f32[2]) -> f32[2] {\\n'
...               '  %x.1 = f32[2]{0} parameter(0), '
...               'metadata={op_name="x" source_line=3}\\n'
...               '  ROOT %neg.2 = f32[2]{0} negate(%x.1)\\n}\\n')
'HloModule num_partitions=1\\n\\nENTRY %0 (f32[2]) -> f32[2] {\\n  %1 = f32[2]{0} parameter(0)\\n  ROOT %2 = f32[2]{0} negate(%1)\\n}'
"""
import re
from collections.abc import Iterable
from typing import Any

import treecheck

# The tables of source files, functions and stack frames that newer XLA
# prints between the module line and the first computation.
_TABLE = re.compile(r'^(FileNames|FunctionNames|FileLocations|StackFrames)\n'
                    r'(?:.+\n)*', re.MULTILINE)
_METADATA = re.compile(r',? ?metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
# Annotations of a partitioned program, whose values may nest braces.
_ANNOTATION = re.compile(r', (?:sharding|allow_spmd_sharding_propagation_to_'
                         r'(?:parameters|output))=\{')
# The module line's frontend attributes declare the meshes (Shardy's).
_MODULE_ANNOTATION = re.compile(r', frontend_attributes=\{')
_MODULE_NAME = re.compile(r'^HloModule [^,\s]+,? ?', re.MULTILINE)
# ``name: type`` in a computation's parameter list.
_SIGNATURE_NAME = re.compile(r'(?<=[(,] )[\w.\-]+: |(?<=\()[\w.\-]+: ')
_NAME = re.compile(r'%[\w.\-]+')


def canonical_hlo(text: str) -> str:
  """``text`` (an HLO module as text) without names and metadata.

  Args:
    text: what ``jax.stages.Compiled.as_text()`` returns.

  Returns:
    The module with its name, the source tables, every ``metadata={...}``
    and the sharding annotations dropped, computation parameter names removed from signatures, and each
    ``%name`` replaced by ``%N``, numbered in order of first appearance (a
    bijection, so two texts are equal exactly when the programs are the same
    up to naming).
  """
  text = _TABLE.sub('', text)
  text = _METADATA.sub('', text)
  text = _drop_annotations(text, _ANNOTATION)
  module_line, _, rest = text.partition('\n')
  text = _drop_annotations(module_line, _MODULE_ANNOTATION) + '\n' + rest
  text = _MODULE_NAME.sub('HloModule ', text)
  text = _SIGNATURE_NAME.sub('', text)
  numbers: dict[str, str] = {}
  text = _NAME.sub(
      lambda m: numbers.setdefault(m.group(0), f'%{len(numbers)}'), text)
  return re.sub(r'\n{3,}', '\n\n', text).strip()


def _drop_annotations(text: str, pattern: re.Pattern[str]) -> str:
  """``text`` without the ``, name={...}`` attributes ``pattern`` finds."""
  pieces, start = [], 0
  for match in pattern.finditer(text):
    if match.start() < start:  # inside an annotation already dropped
      continue
    pieces.append(text[start:match.start()])
    depth, end = 1, match.end()
    while depth:
      depth += {'{': 1, '}': -1}.get(text[end], 0)
      end += 1
    start = end
  return ''.join(pieces) + text[start:]


def optimized_hlo(fn: Any, *args: Any, **kwargs: Any) -> str:
  """The canonical optimized per-device HLO ``fn`` runs on ``args``.

  Args:
    fn: a function with ``.lower`` (``jax.jit``'s, or ``nn.init_sharded``'s,
      whose ``lower`` also returns the shardings).
    *args: the arguments (arrays or ``jax.ShapeDtypeStruct``s).
    **kwargs: keyword arguments for ``fn``.

  Returns:
    ``canonical_hlo`` of the compiled program's text.
  """
  lowered = fn.lower(*args, **kwargs)
  if isinstance(lowered, tuple):  # init_sharded: (lowered, shardings)
    lowered = lowered[0]
  return canonical_hlo(lowered.compile().as_text())


def run_compiled(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, str]:
  """Runs jitted ``fn`` on ``args`` and returns its result and HLO text.

  Args:
    fn: a ``jax.jit`` function.
    *args: its arguments.
    **kwargs: its keyword arguments.

  Returns:
    ``(fn(*args, **kwargs), optimized_hlo(fn, *args, **kwargs))``, from one
    compile.
  """
  compiled = fn.lower(*args, **kwargs).compile()
  return compiled(*args, **kwargs), canonical_hlo(compiled.as_text())


def same_programs(pairs: Iterable[tuple[str, str]]) -> bool:
  """Whether each ``(a, b)`` pair of ``optimized_hlo`` texts is equal.

  Args:
    pairs: the programs behind two results, one pair per program run.
  """
  return all(a == b for a, b in pairs)


def assert_match(actual: Any, expected: Any,
                 pairs: Iterable[tuple[str, str]], *, rtol: float,
                 atol: float, what: str = '') -> bool:
  """Bit for bit when the programs are the same, else to ``rtol``/``atol``.

  Args:
    actual: one result tree.
    expected: the other.
    pairs: ``(hlo_a, hlo_b)`` for each program the results went through.
    rtol: relative tolerance for different programs.
    atol: absolute tolerance for different programs.
    what: names the comparison in failure messages.

  Returns:
    True when the programs were the same and the trees compared bit for bit.
  """
  if same_programs(pairs):
    treecheck.assert_identical(actual, expected, what)
    return True
  treecheck.assert_close(actual, expected, rtol=rtol, atol=atol, what=what)
  return False
