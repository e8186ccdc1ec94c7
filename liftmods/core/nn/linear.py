"""Functional linear layers: dense, dense_general, conv, conv_transpose,
embedding. Parameters and arithmetic are ``flax.core.nn``'s.

>>> import jax, jax.numpy as jnp
>>> from liftmods import core
>>> from liftmods.core.nn.linear import dense_general
>>> y, v = core.init(dense_general)(jax.random.key(0), jnp.ones((2, 3, 4)),
...                                 features=(5, 6), axis=(1, 2))
>>> y.shape, v['params']['kernel'].shape
((2, 5, 6), (3, 4, 5, 6))
"""
import dataclasses
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from liftmods import initializers

__all__ = ['dense_general', 'dense', 'conv', 'conv_transpose', 'Embedding',
           'embedding', 'default_kernel_init', 'default_embed_init']

default_kernel_init = initializers.lecun_normal()
default_embed_init = initializers.variance_scaling(1.0, 'fan_in', 'normal',
                                                   out_axis=0)


def _as_tuple(x) -> tuple:
  return tuple(x) if isinstance(x, Iterable) else (x,)


def _positive(axes, ndim) -> tuple:
  return tuple(a if a >= 0 else ndim + a for a in axes)


def _per_batch_init(init_fn, n_batch: int, flat_tail):
  """An initializer that draws ``init_fn`` once per batch entry (all with
  the same key) on the flattened ``flat_tail(shape)`` and concatenates."""

  def init(rng, shape, dtype=jnp.float32):
    copies = int(np.prod(shape[:n_batch], dtype=np.int32))
    parts = [init_fn(rng, flat_tail(shape), dtype) for _ in range(copies)]
    return jnp.reshape(jnp.concatenate(parts, axis=0), shape)

  return init


def _add_bias(y, scope, features, bias_init, dtype):
  bias = jnp.asarray(scope.param('bias', bias_init, (features,)), dtype)
  return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def dense_general(scope, inputs, features, axis=-1, batch_dims=(),
                  bias=True, dtype=jnp.float32,
                  kernel_init=default_kernel_init,
                  bias_init=initializers.zeros_init(), precision=None):
  """Contracts ``axis`` of ``inputs`` with a kernel of shape
  ``batch + contracted + features``; ``batch_dims`` (leading, consecutive
  axes) get one kernel each."""
  inputs = jnp.asarray(inputs, dtype)
  features, axis = _as_tuple(features), _as_tuple(axis)
  batch_dims = _as_tuple(batch_dims)
  if batch_dims and set(batch_dims) != set(range(max(batch_dims) + 1)):
    raise ValueError(f'batch_dims {batch_dims} must be consecutive leading '
                     'dimensions starting from 0.')
  ndim = inputs.ndim
  axis, batch_dims = _positive(axis, ndim), _positive(batch_dims, ndim)
  n_batch, n_axis, n_features = len(batch_dims), len(axis), len(features)
  batch_shape = tuple(inputs.shape[a] for a in batch_dims)
  kernel_flat = lambda s: (np.prod(s[n_batch:n_batch + n_axis]),
                           np.prod(s[-n_features:]))
  kernel = scope.param(
      'kernel', _per_batch_init(kernel_init, n_batch, kernel_flat),
      batch_shape + tuple(inputs.shape[a] for a in axis) + features)
  kernel = jnp.asarray(kernel, dtype)
  contract = tuple(range(n_batch, n_batch + n_axis))
  out = lax.dot_general(inputs, kernel,
                        ((axis, contract), (batch_dims, tuple(range(n_batch)))),
                        precision=precision)
  if not bias:
    return out
  bias_flat = lambda s: (np.prod(s[-n_features:]),)
  b = scope.param('bias', _per_batch_init(bias_init, n_batch, bias_flat),
                  batch_shape + features)
  for a in sorted(set(range(ndim)) - set(axis) - set(batch_dims)):
    b = jnp.expand_dims(b, a)
  return out + jnp.asarray(b, dtype)


def dense(scope, inputs, features, bias=True, dtype=jnp.float32,
          precision=None, kernel_init=default_kernel_init,
          bias_init=initializers.zeros_init()):
  """``inputs @ kernel + bias`` over the last axis."""
  inputs = jnp.asarray(inputs, dtype)
  kernel = scope.param('kernel', kernel_init, (inputs.shape[-1], features))
  kernel = jnp.asarray(kernel, dtype)
  y = lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                      precision=precision)
  return _add_bias(y, scope, features, bias_init, dtype) if bias else y


def _conv_dimension_numbers(input_shape):
  """NHWC inputs, HWIO kernels."""
  ndim = len(input_shape)
  lhs = (0, ndim - 1) + tuple(range(1, ndim - 1))
  rhs = (ndim - 1, ndim - 2) + tuple(range(0, ndim - 2))
  return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def conv(scope, inputs, features, kernel_size, strides=None, padding='SAME',
         input_dilation=None, kernel_dilation=None, feature_group_count=1,
         bias=True, dtype=jnp.float32, precision=None,
         kernel_init=default_kernel_init,
         bias_init=initializers.zeros_init()):
  """N-d convolution of channels-last ``inputs`` (batch axis first)."""
  inputs = jnp.asarray(inputs, dtype)
  if strides is None:
    strides = (1,) * (inputs.ndim - 2)
  in_features = inputs.shape[-1]
  assert in_features % feature_group_count == 0
  kernel = scope.param(
      'kernel', kernel_init,
      kernel_size + (in_features // feature_group_count, features))
  y = lax.conv_general_dilated(
      inputs, jnp.asarray(kernel, dtype), strides, padding,
      lhs_dilation=input_dilation, rhs_dilation=kernel_dilation,
      dimension_numbers=_conv_dimension_numbers(inputs.shape),
      feature_group_count=feature_group_count, precision=precision)
  return _add_bias(y, scope, features, bias_init, dtype) if bias else y


def conv_transpose(scope, inputs, features, kernel_size, strides=None,
                   padding='SAME', kernel_dilation=None, bias=True,
                   dtype=jnp.float32, precision=None,
                   kernel_init=default_kernel_init,
                   bias_init=initializers.zeros_init()):
  """Transposed convolution (``lax.conv_transpose``)."""
  inputs = jnp.asarray(inputs, dtype)
  strides = strides or (1,) * (inputs.ndim - 2)
  kernel = scope.param('kernel', kernel_init,
                       kernel_size + (inputs.shape[-1], features))
  y = lax.conv_transpose(inputs, jnp.asarray(kernel, dtype), strides,
                         padding, rhs_dilation=kernel_dilation,
                         precision=precision)
  return _add_bias(y, scope, features, bias_init, dtype) if bias else y


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Embedding:
  """An embedding table with ``lookup`` (rows by integer index) and
  ``attend`` (dot products of queries with every row)."""

  table: np.ndarray

  def replace(self, **updates) -> 'Embedding':
    """A copy with ``updates`` applied."""
    return dataclasses.replace(self, **updates)

  def lookup(self, indices):
    """Rows of the table at ``indices`` (an integer array)."""
    if indices.dtype not in (jnp.int32, jnp.int64, jnp.uint32, jnp.uint64):
      raise ValueError('Input type must be an integer or unsigned integer.')
    return self.table[indices]

  def attend(self, query):
    """``query @ table.T``."""
    return jnp.dot(query, self.table.T)


def embedding(scope, num_embeddings: int, features: int,
              init_fn=default_embed_init) -> Embedding:
  """Declares the ``table`` parameter and returns it as an
  :class:`Embedding`."""
  return Embedding(scope.param('table', init_fn, (num_embeddings, features)))
