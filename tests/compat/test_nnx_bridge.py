"""flax.nnx.bridge both ways, on liftmods and on flax.linen.

Each side runs in its own process (``tests/compat/nnx_bridge_side.py``): one
with the real ``flax.linen``, one with :mod:`liftmods.compat` installed
before ``flax.nnx`` is imported, so that the bridge's ``ToLinen`` is a
liftmods Module and ``ToNNX`` wraps liftmods models. NNX layers inside Linen
models (``ToLinen``, ``to_linen``, ``to_linen_class``; with a mutable
collection, call-time rngs, inside ``nn.scan`` and ``nn.remat``; logical
partitioning metadata) and a Linen model inside an NNX module (``ToNNX``,
``lazy_init``, ``nnx.split``, ``nnx.grad``) give the same arrays bit for bit
and the same partition specs (marked ``integration``). The in-process tests
at the end use ``import liftmods as nn`` next to the real bridge.
"""
import flax.errors
import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest

import liftmods as lnn
from tests.compat import differential
from tests.compat.nnx_bridge_side import PARTS, X, to_nnx_model
from treecheck import assert_identical


@pytest.fixture(scope='module')
def sides(tmp_path_factory):
  return differential.run_sides(tmp_path_factory.mktemp('nnx_bridge'),
                                'tests.compat.nnx_bridge_side', list(PARTS),
                                fast_compiles=True)


# The two-process comparison is end-to-end (about 20 CPU-s): run by `make
# test-integration`, like the other side-script suites; the in-process tests
# at the end run in `make test`.
test_case_saved_its_parts, test_bit_identical = (
    pytest.mark.integration(test) for test in differential.part_tests(PARTS))


@pytest.mark.integration
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


@pytest.mark.integration
def test_partition_specs_survive_the_bridge(sides):
  """NNX sharding metadata reaches Linen's partition specs; a Linen
  ``Partitioned`` box made by ``bridge.with_partitioning`` gains the layer
  axis under ``nn.scan`` with ``metadata_params``."""
  kernel = "['params']['nnx']['linear']['kernel']"
  scanned = "['params']['layers']['nnx']['linear']['kernel']"
  for side in ('flax', 'liftmods'):
    assert str(sides[side]['partitioning/specs' + kernel]) == (
        "P('embed', 'mlp')"), side
    assert str(sides[side]['partitioning/scan_specs' + scanned]) == (
        "P('layers', 'embed', 'mlp')"), side
    assert sides[side]['partitioning/scan_init' + scanned].shape == (2, 3, 3)


def _to_nnx_outer(nn):
  return to_nnx_model(nn)[0]


def _key_data(tree):
  return jax.tree.map(
      lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(
          a.dtype, jax.dtypes.prng_key) else a, tree)


def test_to_nnx_takes_a_liftmods_model_without_the_switch():
  """``import liftmods as nn`` in the same process as the real bridge:
  ToNNX only calls the model's init/apply, so a liftmods model works as it
  is, with the same state, output, updated statistics and gradients as the
  flax.linen model."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  def run(nn):
    model = _to_nnx_outer(nn)
    _, split = nnx.split(model)
    y = model(X)
    grads = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(model)
    return _key_data((nnx.to_pure_dict(split), y,
                      nnx.to_pure_dict(nnx.state(model)),
                      nnx.to_pure_dict(grads)))

  ours, theirs = run(lnn), run(fnn)
  assert set(ours[0]['mlp']) == {'bn', 'hid', 'out', 'to_nnx__rngs'}
  assert_identical(ours, theirs)


def test_to_linen_of_the_real_bridge_needs_the_switch():
  """Without the switch, flax's ToLinen is a flax.linen Module: it cannot
  bind inside a liftmods model (the docs say to install the switch before
  flax.nnx is imported)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel

  class Model(lnn.Module):
    @lnn.compact
    def __call__(self, x):
      return bridge.ToLinen(nnx.Linear, args=(3, 2))(x)

  assert not issubclass(bridge.ToLinen, lnn.Module)
  with pytest.raises(flax.errors.CallCompactUnboundModuleError):
    Model().init(jax.random.key(0), X)
