"""brax's training networks, unmodified, on liftmods.

Each side runs in its own process (``tests/compat/brax_side.py``): one with
the real ``flax.linen``, one with :mod:`liftmods.compat` installed before
brax is imported. brax reaches Linen through its submodules as well as
through ``flax.linen`` (its activation table reads ``nn.activation.*``,
``compact`` included, when ``brax.training.networks`` is imported). Both
sides build PPO's policy and value networks (tanh-normal and learned-std
normal policies, MLP and distributional critics, observations normalized by
brax's running statistics), SAC's policy and twin-Q networks, the vision
networks (CNN + MLP, spatial-softmax pooling, per-channel LayerNorm) and the
spectral-norm MLP with its ``sing_vec`` rng and mutable collection, with the
same keys. Every saved array must be equal bit for bit; one test per case
and part.
"""
import importlib.util

import pytest

from tests.compat import differential
from tests.compat.brax_side import PARTS

# Looked up, not imported: brax imports mujoco and trimesh, which the test
# process itself does not need (each side imports brax in its own process).
if importlib.util.find_spec('brax') is None:
  pytest.skip('brax is not installed', allow_module_level=True)
pytestmark = pytest.mark.integration


@pytest.fixture(scope='module')
def sides(tmp_path_factory):
  return differential.run_sides(tmp_path_factory.mktemp('brax'),
                                'tests.compat.brax_side', list(PARTS))


test_case_saved_its_parts, test_bit_identical = differential.part_tests(PARTS)


def test_power_iteration_moved(sides):
  """The spectral-norm steps update the carried singular vector (the
  mutable collection is really written and read back)."""
  ref = sides['flax']
  u0 = "['hidden_0']['u0']"
  first = ref[f"spectral_norm/steps[0][1]{u0}"]
  third = ref[f"spectral_norm/steps[2][1]{u0}"]
  assert (first != ref[f"spectral_norm/init['sing_vec']{u0}"]).any()
  assert (first != third).any()
