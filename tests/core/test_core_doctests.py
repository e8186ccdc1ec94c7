"""Runs the docstring examples of the functional core as doctests."""
import doctest
import importlib

import pytest

MODULES = [
    'liftmods.core',
    'liftmods.core.scope',
    'liftmods.core.caching',
    'liftmods.core.rng_counters',
    'liftmods.core.lift',
    'liftmods.core.filters',
    'liftmods.core.rngs',
    'liftmods.core.frozen_dict',
    'liftmods.core.meta',
    'liftmods.core.partial_eval',
    'liftmods.core.spmd',
    'liftmods.errors',
    'liftmods.spmd',
    'liftmods.partitioning',
    'liftmods.sharded_init',
]


@pytest.mark.parametrize('module_name', MODULES)
def test_doctests(module_name):
  module = importlib.import_module(module_name)
  result = doctest.testmod(
      module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
      verbose=False, report=True)
  assert result.attempted > 0, f'{module_name} has no doctest examples'
  assert result.failed == 0, (
      f'{result.failed} of {result.attempted} doctest examples failed in '
      f'{module_name}; see the captured output above')
