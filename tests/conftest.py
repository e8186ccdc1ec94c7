"""Shared by every test folder.

The test files live in one folder per package area (``tests/core``,
``tests/layers``, ``tests/transforms``, ...). This file makes the repository
root and ``tests/`` importable from all of them, whatever the import mode, so
that a test file can use ``benchmarks``, ``examples`` and the comparison
helpers in ``tests/treecheck.py`` (bit-exact tree equality, allclose with
stated tolerances, and the flax-oracle runner). The helpers live in a module
of their own rather than here because ``import conftest`` is ambiguous once a
test folder has a ``conftest.py`` of its own.
"""
import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent

for _path in (str(TESTS), str(ROOT)):
  if _path not in sys.path:
    sys.path.insert(0, _path)
