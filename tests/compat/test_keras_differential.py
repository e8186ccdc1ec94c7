"""keras 3's ``FlaxLayer``, unmodified, on liftmods.

Each side runs in its own process (``tests/compat/keras_side.py``): one with
the real ``flax.linen``, one with :mod:`liftmods.compat` installed before
keras is imported. keras wraps the Linen module in ``FlaxLayer``, which
passes flax's own ``flax.core.scope.DenyList(['params'])`` as ``mutable``
(flax.core stays flax's under the switch). Both sides initialise through
keras' seeded rng, predict, call in training mode (dropout, batch
statistics), ``fit`` and predict again, and use ``method=`` with given
``variables``. Every saved array must be equal bit for bit; one test per
case and part.
"""
import importlib.util

import numpy as np
import pytest

from tests.compat import differential
from tests.compat.keras_side import PARTS

if importlib.util.find_spec('keras') is None:
  pytest.skip('keras is not installed (pip install -e .[compat-extra])',
              allow_module_level=True)
pytestmark = pytest.mark.integration


@pytest.fixture(scope='module')
def sides(tmp_path_factory):
  return differential.run_sides(tmp_path_factory.mktemp('keras'),
                                'tests.compat.keras_side', list(PARTS))


test_case_saved_its_parts, test_bit_identical = differential.part_tests(PARTS)


def _weights(side, part):
  return [side[k] for k in differential.keys_of(side, f'cnn/{part}')]


def test_training_moved_the_weights(sides):
  """The training-mode call updated the batch statistics (non-trainable
  weights) and fit every weight; dropout made training differ from predict."""
  ref = sides['flax']
  init, called, fitted = (_weights(ref, p) for p in
                          ('init', 'after_training_call', 'fit'))
  assert any((a != b).any() for a, b in zip(init, called))
  assert all((a != b).any() for a, b in zip(called, fitted))
  assert not np.allclose(ref['cnn/training_call'], ref['cnn/predict'][:4])
  assert (ref['cnn/predict'] != ref['cnn/predict_after_fit']).any()
  loss = ref['cnn/fit_loss']
  assert loss.shape == (2,) and loss[1] < loss[0]
