"""nn.vmap: variable axes, in/out axes, axis names, methods.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lifted_check import ATOL, RTOL
from lifted_check import BACKENDS, X4, autoencoder, mlp, check, shapes
import liftmods as lnn
from treecheck import assert_close

pytestmark = pytest.mark.usefixtures('fast_compiles')


@pytest.mark.parametrize('axis', [0, 1])
def test_vmap_params_stacked_split(axis):
  def build(nn):
    return nn.vmap(mlp(nn), variable_axes={'params': axis},
                   split_rngs={'params': True}, in_axes=0, out_axes=0)(2)

  r = check(build, (X4,))
  k = np.asarray(r['vars'][fnn]['params']['Dense_0']['kernel'])
  assert k.shape == ((4, 3, 4) if axis == 0 else (3, 4, 4))
  k0, k1 = np.take(k, 0, axis), np.take(k, 1, axis)
  assert not np.array_equal(k0, k1)


def test_vmap_params_stacked_no_split():
  def build(nn):
    return nn.vmap(mlp(nn), variable_axes={'params': 0},
                   split_rngs={'params': False})(2)

  r = check(build, (X4,))
  k = np.asarray(r['vars'][lnn]['params']['out']['kernel'])
  assert k.shape == (4, 4, 2)
  for i in range(1, 4):
    np.testing.assert_array_equal(k[i], k[0])


def test_vmap_params_shared():
  def build(nn):
    return nn.vmap(mlp(nn), variable_axes={'params': None},
                   split_rngs={'params': False})(2)

  r = check(build, (X4,), jit_later_seeds=True, eager_apply=True)
  assert shapes(r['vars'][fnn])['params']['Dense_0']['kernel'] == (3, 4)


def test_vmap_in_out_axes_trees():
  a = jax.random.normal(jax.random.key(1), (4, 2))
  b = jax.random.normal(jax.random.key(2), (2, 4))
  ctx = jnp.float32(1.5)
  d = {'u': jax.random.normal(jax.random.key(3), (4, 5)),
       'v': jax.random.normal(jax.random.key(4), (3, 4))}

  def build(nn):
    class Two(nn.Module):
      @nn.compact
      def __call__(self, pair, ctx, d):
        a, b = pair
        h = nn.Dense(3)(a) + nn.Dense(3)(b) * ctx
        h = h + nn.Dense(3)(d['u']) - d['v'].sum()
        return h, (jnp.sum(h), ctx * 2)

    return nn.vmap(Two, variable_axes={'params': None},
                   split_rngs={'params': False},
                   in_axes=((0, 1), None, {'u': 0, 'v': 1}),
                   out_axes=(1, (0, None)))()

  r = check(build, ((a, b), ctx, d))
  h, (s, c) = r['out'][lnn]
  assert h.shape == (3, 4) and s.shape == (4,) and c.shape == ()


def test_vmap_axis_size_without_mapped_inputs():
  def build(nn):
    return nn.vmap(mlp(nn), variable_axes={'params': 0},
                   split_rngs={'params': True}, in_axes=None, out_axes=0,
                   axis_size=3)(2)

  x = jax.random.normal(jax.random.key(5), (3,))
  r = check(build, (x,))
  assert r['out'][lnn].shape == (3, 2)
  assert shapes(r['vars'][lnn])['params']['out']['kernel'] == (3, 4, 2)


def test_vmap_axis_name_batchnorm():
  def build(nn):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(3)(x)
        x = nn.BatchNorm(use_running_average=False, axis_name='batch',
                         momentum=0.8)(x)
        return nn.relu(x)

    return nn.vmap(Net, variable_axes={'params': None, 'batch_stats': None},
                   split_rngs={'params': False}, in_axes=0, out_axes=0,
                   axis_name='batch')()

  x = jax.random.normal(jax.random.key(9), (5, 3))
  r = check(build, (x,), mutable=['batch_stats'])
  y, upd = r['out'][lnn]
  stats = upd['batch_stats']['BatchNorm_0']
  # the per-example stats are averaged over the vmapped axis
  assert stats['mean'].shape == (3,)
  assert_close(upd, r['out'][fnn][1], rtol=RTOL, atol=ATOL,
               what='updated batch_stats')
  assert not np.allclose(stats['mean'], 0.0)


def test_vmap_methods_list():
  def build(nn):
    VAE = nn.vmap(autoencoder(nn), variable_axes={'params': 0},
                  split_rngs={'params': True}, methods=['encode', 'decode'])

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        ae = VAE()
        z = ae.encode(x)
        return ae.decode(z), z
    return Outer()

  r = check(build, (X4,))
  p = shapes(r['vars'][lnn]['params'])
  assert p['VmapAE_0']['enc']['kernel'] == (4, 3, 2)
  assert p['VmapAE_0']['dec']['kernel'] == (4, 2, 3)


def test_vmap_methods_dict():
  def build(nn):
    VAE = nn.vmap(autoencoder(nn), methods={
        'encode': dict(variable_axes={'params': 0},
                       split_rngs={'params': True}, in_axes=0, out_axes=1),
        'decode': dict(variable_axes={'params': 0},
                       split_rngs={'params': True}, in_axes=1, out_axes=0),
    })

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        ae = VAE()
        z = ae.encode(x)
        return ae.decode(z), z
    return Outer()

  r = check(build, (X4,))
  y, z = r['out'][lnn]
  assert z.shape == (2, 4) and y.shape == (4, 3)


def test_vmap_init_via_method():
  def build(nn):
    return nn.vmap(autoencoder(nn), variable_axes={'params': 0},
                   split_rngs={'params': True},
                   methods=['encode', 'decode', '__call__'])()

  r = check(build, (X4,))
  # apply a single method of the vmapped class
  zs = {nn: build(nn).apply(r['vars'][nn], X4, method='encode')
        for nn in BACKENDS}
  assert_close(zs[lnn], zs[fnn], rtol=RTOL, atol=ATOL, what='encode')
