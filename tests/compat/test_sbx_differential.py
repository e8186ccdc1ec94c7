"""sbx (Stable Baselines Jax), unmodified, on liftmods.

Each side runs in its own process (``tests/compat/sbx_side.py``): one with
the real ``flax.linen``, one with :mod:`liftmods.compat` installed before
sbx is imported (its BatchRenorm imports Linen's private normalization
helpers at import time). PPO, DQN, SAC, TQC and CrossQ are created with the
same seed: their initial train states, deterministic predictions, the train
states after ``learn(64)`` and the predictions after must be equal bit for
bit; one test per case and part.
"""
import importlib.util

import pytest

from tests.compat import differential
from tests.compat.sbx_side import PARTS

# Looked up, not imported: sbx imports stable-baselines3 and torch, which the
# test process itself does not need.
if importlib.util.find_spec('sbx') is None:
  pytest.skip('sbx is not installed (pip install -e .[compat-extra])',
              allow_module_level=True)
pytestmark = pytest.mark.integration


@pytest.fixture(scope='module')
def sides(tmp_path_factory):
  return differential.run_sides(tmp_path_factory.mktemp('sbx'),
                                'tests.compat.sbx_side', list(PARTS))


test_case_saved_its_parts, test_bit_identical = differential.part_tests(PARTS)


@pytest.mark.parametrize('case', PARTS)
def test_learn_moved_the_parameters(sides, case):
  """learn(64) really trained: most of the parameters changed."""
  ref = sides['flax']
  init = differential.keys_of(ref, f'{case}/init')
  params = [k for k in init if '.params[' in k or "_state'].params" in k]
  assert params
  moved = [k for k in params
           if (ref[k] != ref[k.replace('/init', '/learn', 1)]).any()]
  assert len(moved) >= len(params) // 2, (case, len(moved), len(params))
