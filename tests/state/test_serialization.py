"""Variables survive msgpack bytes and orbax checkpoints bit for bit.

``liftmods.serialization`` is differential against ``flax.serialization``:
the same state dicts and the same bytes, in both directions, for every dtype
Linen can encode; typed PRNG keys (which Linen cannot encode) round-trip as
typed keys. Orbax save/restore keeps dtypes, values, ``Partitioned`` boxes
and ``FrozenDict``s.
"""
import collections

from flax import serialization as flax_serialization
import flax.core
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import liftmods as nn
from liftmods import serialization
from liftmods.core import FrozenDict, freeze
import treecheck

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint32,
          jnp.bool_, jnp.complex64)


def _array(dtype, shape=(2, 3)):
  x = jax.random.normal(jax.random.key(0), shape) * 50
  if dtype == jnp.complex64:
    return (x + 1j * jnp.cos(x)).astype(dtype)
  if dtype == jnp.bool_:
    return x > 0
  return x.astype(dtype)


def _variables():
  """A variable tree holding every dtype, a scalar and an empty dict."""
  return {'params': {f'w_{jnp.dtype(d).name}': _array(d) for d in DTYPES},
          'batch_stats': {'count': jnp.array(3, jnp.int32), 'empty': {}}}


def _same(a, b):
  """The shared bit-exact check with container types, and typed keys of one
  implementation on both sides."""
  treecheck.assert_identical(a, b, same_containers=True)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert jax.random.key_impl(x) == jax.random.key_impl(y)


@pytest.mark.parametrize('dtype', DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_bytes_identical_to_flax_per_dtype(dtype):
  tree = {'x': _array(dtype), 'scalar': _array(dtype, ())}
  data = serialization.to_bytes(tree)
  assert data == flax_serialization.to_bytes(tree)
  _same(serialization.from_bytes(tree, data), tree)
  _same(flax_serialization.from_bytes(tree, data), tree)


def test_variable_tree_round_trip_and_cross_library():
  variables = _variables()
  data = serialization.to_bytes(variables)
  assert data == flax_serialization.to_bytes(variables)
  _same(serialization.from_bytes(variables, data), variables)
  assert serialization.msgpack_restore(data).keys() == variables.keys()


def test_frozen_dict_round_trip():
  frozen = freeze(_variables())
  data = serialization.to_bytes(frozen)
  assert data == flax_serialization.to_bytes(flax.core.freeze(_variables()))
  restored = serialization.from_bytes(frozen, data)
  assert isinstance(restored, FrozenDict)
  assert isinstance(restored['params'], FrozenDict)
  _same(restored, frozen)


def test_partitioned_round_trip():
  boxed = {'params': {'w': nn.Partitioned(_array(jnp.bfloat16), ('a', 'b'))}}
  state = serialization.to_state_dict(boxed)
  assert set(state['params']['w']) == {'value'}
  restored = serialization.from_bytes(boxed, serialization.to_bytes(boxed))
  assert restored['params']['w'].names == ('a', 'b')
  _same(restored, boxed)
  flax_boxed = {'params': {'w': flax.core.meta.Partitioned(
      _array(jnp.bfloat16), ('a', 'b'))}}
  assert serialization.to_bytes(boxed) == flax_serialization.to_bytes(
      flax_boxed)


def test_typed_prng_keys_round_trip():
  tree = {'rng': jax.random.key(7), 'keys': jax.random.split(
      jax.random.key(1), 3), 'raw': jax.random.PRNGKey(2)}
  restored = serialization.from_bytes(tree, serialization.to_bytes(tree))
  _same(restored, tree)
  with pytest.raises(TypeError):  # Linen cannot encode typed keys at all
    flax_serialization.to_bytes(tree)


def test_state_dict_containers_match_flax():
  Pair = collections.namedtuple('Pair', 'a b')
  tree = {'list': [jnp.ones(2), 3], 'tuple': (1.5, 'x'), 'nt': Pair(1, [2]),
          1: {'nested': None}, 'c': 2 + 3j}
  ours = serialization.to_state_dict(tree)
  assert ours == flax_serialization.to_state_dict(tree) or str(ours) == str(
      flax_serialization.to_state_dict(tree))
  for in_place in (False, True):  # sorted keys, or the state dict's order
    assert serialization.msgpack_serialize(ours, in_place) == (
        flax_serialization.msgpack_serialize(dict(ours), in_place))
  back = serialization.from_state_dict(tree, ours)
  assert isinstance(back['nt'], Pair) and isinstance(back['tuple'], tuple)
  assert back['c'] == 2 + 3j


def test_from_state_dict_mismatch_is_reported():
  with pytest.raises(ValueError, match='lacks keys'):
    serialization.from_state_dict({'a': 1, 'b': 2}, {'a': 1})
  with pytest.raises(ValueError, match='entries'):
    serialization.from_state_dict([1, 2], {'0': 1})


def test_serialization_does_not_mutate_its_input():
  variables = _variables()
  before = jax.tree_util.tree_map(lambda x: x, variables)
  serialization.msgpack_serialize(variables, in_place=True)
  serialization.to_bytes(variables)
  assert jax.tree_util.tree_structure(variables) == (
      jax.tree_util.tree_structure(before))
  for a, b in zip(jax.tree_util.tree_leaves(variables),
                  jax.tree_util.tree_leaves(before)):
    assert a is b


def test_model_variables_round_trip_through_bytes():
  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(3, param_dtype=jnp.bfloat16)(x)
      return nn.BatchNorm(use_running_average=False)(x)

  x = jnp.ones((2, 4))
  variables = Model().init(jax.random.key(0), x)
  restored = serialization.from_bytes(variables,
                                      serialization.to_bytes(variables))
  _same(restored, variables)
  y0, _ = Model().apply(variables, x, mutable=['batch_stats'])
  y1, _ = Model().apply(restored, x, mutable=['batch_stats'])
  assert np.array_equal(y0, y1)


def test_orbax_checkpoint_round_trip(tmp_path):
  tree = {**_variables(),
          'rngs': {'key': jax.random.key(3)},
          'boxed': {'w': nn.Partitioned(_array(jnp.float16), ('x', None))},
          'frozen': freeze({'v': _array(jnp.int8)})}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / 'ckpt', tree)
  checkpointer.wait_until_finished()
  target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
  restored = checkpointer.restore(tmp_path / 'ckpt', target)
  assert isinstance(restored['boxed']['w'], nn.Partitioned)
  assert restored['boxed']['w'].names == ('x', None)
  assert isinstance(restored['frozen'], FrozenDict)
  _same(restored, tree)
