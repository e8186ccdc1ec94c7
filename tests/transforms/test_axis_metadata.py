"""Partitioned axis metadata through scan and vmap, nn.add_metadata_axis.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import flax.linen as fnn
import jax
import pytest

from lifted_check import BACKENDS, check
import liftmods as lnn

pytestmark = pytest.mark.usefixtures('fast_compiles')


def _partitioned_block(nn):
  class PBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      k = nn.with_partitioning(nn.initializers.lecun_normal(),
                               ('embed', 'mlp'))
      y = nn.Dense(3, kernel_init=k, use_bias=False)(x)
      w = self.param('w', nn.with_partitioning(nn.initializers.ones_init(),
                                               ('mlp',)), (3,))
      return x + nn.tanh(y * w), None
  return PBlock


def _check_names(r, expected):
  names = {}
  for nn in BACKENDS:
    boxes = [b for b in jax.tree_util.tree_leaves(
        r['vars'][nn], is_leaf=lambda x: isinstance(x, nn.Partitioned))]
    names[nn] = [tuple(b.names) for b in boxes]
    specs = nn.get_partition_spec(r['vars'][nn])
    names[nn, 'spec'] = [tuple(s) for s in jax.tree_util.tree_leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))]
  assert names[lnn] == names[fnn] == expected
  assert names[lnn, 'spec'] == names[fnn, 'spec']


def test_partitioned_through_scan():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = nn.scan(_partitioned_block(nn), variable_axes={'params': 0},
                       split_rngs={'params': True}, length=2,
                       metadata_params={nn.meta.PARTITION_NAME: 'layers'})(
                           name='scan')(x, None)
        return x
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  _check_names(r, [('layers', 'embed', 'mlp'), ('layers', 'mlp')])


def test_partitioned_through_scan_unnamed_axis():
  """metadata_params={PARTITION_NAME: None}: the stacked axis is unsharded."""
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = nn.scan(_partitioned_block(nn), variable_axes={'params': 0},
                       split_rngs={'params': True}, length=2,
                       metadata_params={nn.meta.PARTITION_NAME: None})(
                           name='scan')(x, None)
        return x
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,), grads=False)
  _check_names(r, [(None, 'embed', 'mlp'), (None, 'mlp')])


def test_partitioned_through_vmap_axis1():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return _partitioned_block(nn)()(x, None)[0]
        return nn.vmap(f, variable_axes={'params': 1},
                       split_rngs={'params': True},
                       metadata_params={nn.meta.PARTITION_NAME: 'batch'})(
                           self, x)
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  _check_names(r, [('embed', 'batch', 'mlp'), ('mlp', 'batch')])


def test_add_metadata_axis():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        Tagged = nn.add_metadata_axis(
            _partitioned_block(nn), variable_axes={'params': 0},
            metadata_params={nn.meta.PARTITION_NAME: 'stage'})
        return Tagged()(x, None)[0]
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  _check_names(r, [('stage', 'embed', 'mlp'), ('stage', 'mlp')])


def test_partitioned_scan_of_vmap_names():
  def build(nn):
    Inner = nn.vmap(_partitioned_block(nn), variable_axes={'params': 0},
                    split_rngs={'params': True}, in_axes=(0, None),
                    metadata_params={nn.meta.PARTITION_NAME: 'heads'})
    Outer = nn.scan(Inner, variable_axes={'params': 0},
                    split_rngs={'params': True}, length=2,
                    in_axes=(nn.broadcast,),
                    metadata_params={nn.meta.PARTITION_NAME: 'layers'})

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Outer(name='stack')(x, None)
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  # out: carry (2, 3) is vmapped over heads=2 too
  r = check(build, (x,))
  _check_names(r, [('layers', 'heads', 'embed', 'mlp'),
                   ('layers', 'heads', 'mlp')])
