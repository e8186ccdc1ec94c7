"""Functional normalization layers: batch_norm, layer_norm, group_norm
(``flax.core.nn``'s parameters, statistics and arithmetic).

>>> import jax, jax.numpy as jnp
>>> from liftmods import core
>>> from liftmods.core.nn.normalization import batch_norm
>>> x = jnp.arange(6.).reshape(3, 2)
>>> y, v = core.init(batch_norm)(jax.random.key(0), x)
>>> sorted(v), v['batch_stats']['mean'].shape
(['batch_stats', 'params'], (2,))
"""
import jax.numpy as jnp
from jax import lax

from liftmods import initializers

__all__ = ['batch_norm', 'layer_norm', 'group_norm']


def _absolute_dims(ndim, dims):
  return tuple(ndim + d if d < 0 else d for d in dims)


def batch_norm(scope, x, use_running_average=False, axis=-1, momentum=0.99,
               epsilon=1e-5, dtype=jnp.float32, bias=True, scale=True,
               bias_init=initializers.zeros_init(),
               scale_init=initializers.ones_init(), axis_name=None,
               axis_index_groups=None, kind='batch_stats'):
  """Normalizes over every axis but ``axis`` with batch statistics (or the
  running averages in ``kind``, updated with ``momentum`` after the first
  call)."""
  x = jnp.asarray(x, jnp.float32)
  axis = _absolute_dims(x.ndim, axis if isinstance(axis, tuple) else (axis,))
  reduced = tuple(i for i in range(x.ndim) if i not in axis)

  def mean_over_batch(v):
    m = jnp.mean(v, reduced, keepdims=True)
    if axis_name is not None:
      m = lax.pmean(m, axis_name=axis_name,
                    axis_index_groups=axis_index_groups)
    return m

  mean = mean_over_batch(x)
  var = mean_over_batch(jnp.square(x)) - jnp.square(mean)
  stats_shape = jnp.squeeze(mean).shape
  first_call = not scope.has_variable(kind, 'mean')
  running_mean = scope.variable(kind, 'mean', jnp.zeros, stats_shape)
  running_var = scope.variable(kind, 'var', jnp.ones, stats_shape)
  if use_running_average:
    mean = jnp.reshape(running_mean.value, mean.shape)
    var = jnp.reshape(running_var.value, var.shape)
  elif not first_call:
    step = 1.0 - momentum
    running_mean.value += step * (jnp.squeeze(mean) - running_mean.value)
    running_var.value += step * (jnp.squeeze(var) - running_var.value)
  mul = lax.rsqrt(var + epsilon)
  if scale:
    mul = mul * scope.param('scale', scale_init,
                            stats_shape).reshape(mean.shape)
  y = (x - mean) * mul
  if bias:
    y = y + scope.param('bias', bias_init, stats_shape).reshape(mean.shape)
  return jnp.asarray(y, dtype)


def layer_norm(scope, x, epsilon=1e-6, dtype=jnp.float32, bias=True,
               scale=True, bias_init=initializers.zeros_init(),
               scale_init=initializers.ones_init()):
  """Normalizes over the last axis, with a learned ``scale`` and ``bias``
  per feature."""
  features = x.shape[-1]
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(lax.square(x), axis=-1, keepdims=True) - lax.square(mean)
  mul = lax.rsqrt(var + epsilon)
  if scale:
    mul = mul * jnp.asarray(scope.param('scale', scale_init, (features,)),
                            dtype)
  y = (x - mean) * mul
  if bias:
    y = y + jnp.asarray(scope.param('bias', bias_init, (features,)), dtype)
  return y


def group_norm(scope, x, num_groups=32, group_size=None, epsilon=1e-6,
               dtype=jnp.float32, bias=True, scale=True,
               bias_init=initializers.zeros_init(),
               scale_init=initializers.ones_init()):
  """Normalizes over the spatial axes and the channels of each of
  ``num_groups`` channel groups (or groups of ``group_size`` channels)."""
  x = jnp.asarray(x, jnp.float32)
  if (num_groups is None) == (group_size is None):
    raise ValueError('Either `num_groups` or `group_size` should be '
                     'specified, but not both of them.')
  if group_size is not None:
    channels = x.shape[-1]
    if channels % group_size != 0:
      raise ValueError(f'Number of channels ({channels}) is not multiple of '
                       f'the group size ({group_size}).')
    num_groups = channels // group_size
  shape = x.shape
  x = x.reshape(shape[:-1] + (num_groups, shape[-1] // num_groups))
  axes = list(range(1, x.ndim - 2)) + [x.ndim - 1]
  mean = jnp.mean(x, axis=axes, keepdims=True)
  var = jnp.mean(jnp.square(x), axis=axes, keepdims=True) - jnp.square(mean)
  x = ((x - mean) * lax.rsqrt(var + epsilon)).reshape(shape)
  feature_shape = (1,) * (len(shape) - 1) + (shape[-1],)
  if scale:
    x = x * scope.param('scale', scale_init, feature_shape)
  if bias:
    x = x + scope.param('bias', bias_init, feature_shape)
  return x.astype(dtype)
