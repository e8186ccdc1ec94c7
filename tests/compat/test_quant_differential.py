"""qwix and AQT, unmodified, on liftmods.

Each library side runs in its own process (``tests/compat/quant_side.py``):
one with the real ``flax.linen``, one with :mod:`liftmods.compat` installed
before qwix and aqt are imported. Both quantize the same small models with
the same keys: qwix QAT (int8 weights and activations, dynamic and static
activation scales), PTQ (``quantize_params`` and the quantized forward),
LoRA and QLoRA (init, forward, gradient, Adam steps); AQT's MNIST example
end to end and a Transformer block built from ``AqtDotGeneral`` and
``AqtEinsum`` (init, forward, gradient). Every saved array must be equal
bit for bit; one test per case and part.

As in the Hugging Face test (``differential.run_sides``), the flax side runs
first and the liftmods side loads the executables it compiled from a shared
persistent cache wherever the two lower to the same program (all of them,
when this was written). XLA skips most optimizations on both sides: the
time of these programs goes to compiling them, and what is compared is the
two libraries' programs, which are compiled alike.
"""
import pytest

from tests.compat import differential
from tests.compat.quant_side import PARTS

pytest.importorskip('qwix')
pytest.importorskip('aqt')
pytestmark = pytest.mark.integration


@pytest.fixture(scope='module')
def sides(tmp_path_factory):
  return differential.run_sides(tmp_path_factory.mktemp('quant'),
                                'tests.compat.quant_side', list(PARTS),
                                fast_compiles=True)


test_case_saved_its_parts, test_bit_identical = differential.part_tests(PARTS)


def test_training_moved(sides):
  """The compared training runs change what they train (no trivial
  zero-gradient run)."""
  ref = sides['flax']
  for case in ('qwix_lora', 'qwix_qlora'):
    losses = [float(ref[f'{case}/steps[2][{i}]']) for i in range(3)]
    assert losses[2] < losses[0], (case, losses)
  kernel = "['params']['Dense_1']['kernel']"
  assert (ref['aqt_mnist/init' + kernel] != ref[
      'aqt_mnist/train[0]' + kernel]).any()
