"""flax.nnx.bridge both ways, on liftmods and on flax.linen.

Each side runs in its own process (``tests/compat/nnx_bridge_side.py``): one
with the real ``flax.linen``, one with :mod:`liftmods.compat` installed
before ``flax.nnx`` is imported, so that the bridge's ``ToLinen`` is a
liftmods Module and ``ToNNX`` wraps liftmods models. NNX layers inside Linen
models (``ToLinen``, ``to_linen``, ``to_linen_class``; with a mutable
collection, call-time rngs, inside ``nn.scan`` and ``nn.remat``; logical
partitioning metadata) and a Linen model inside an NNX module (``ToNNX``,
``lazy_init``, ``nnx.split``, ``nnx.grad``) give the same arrays bit for bit
and the same partition specs. The in-process tests below use
``import liftmods as nn`` with the bridge imported under the switch.
"""
import pytest

from tests.compat import differential
from tests.compat.nnx_bridge_side import PARTS


@pytest.fixture(scope='module')
def sides(tmp_path_factory):
  return differential.run_sides(tmp_path_factory.mktemp('nnx_bridge'),
                                'tests.compat.nnx_bridge_side', list(PARTS),
                                fast_compiles=True)


test_case_saved_its_parts, test_bit_identical = differential.part_tests(PARTS)


def test_the_nnx_state_moved(sides):
  """The BatchStat counter and BatchNorm statistics were really updated
  (the mutable collections are written through the bridge both ways)."""
  ours = sides['liftmods']
  assert ours["to_linen/state['batch_stats']['nnx']['calls']"] == 1
  assert ours["to_linen/init['batch_stats']['nnx']['calls']"] == 0
  assert ours["scan/y[1]['batch_stats']['layers']['nnx']['calls']"].tolist(
  ) == [1, 1, 1]
  assert ours["scan/remat_y[1]['batch_stats']['block']['nnx']['calls']"] == 2
  split = ours["to_nnx/split['mlp']['bn']['mean']"]
  after = ours["to_nnx/state['mlp']['bn']['mean']"]
  assert (split != after).any()


def test_partition_specs_survive_the_bridge(sides):
  for side in ('flax', 'liftmods'):
    spec = sides[side]["partitioning/specs['params']['nnx']['linear']"
                       "['kernel']"]
    assert str(spec) == "P('embed', 'mlp')", side
