"""Functional attention: dot_product_attention and
multi_head_dot_product_attention over a scope, with causal, padding and
segmentation masks and an autoregressive cache (``flax.core.nn``'s
parameters and arithmetic).

>>> import jax, jax.numpy as jnp
>>> from liftmods import core
>>> from liftmods.core.nn.attention import multi_head_dot_product_attention
>>> x = jnp.ones((2, 5, 8))
>>> y, v = core.init(multi_head_dot_product_attention)(
...     jax.random.key(0), x, None, num_heads=2, causal_mask=True)
>>> y.shape, sorted(v['params'])
((2, 5, 8), ['key', 'out', 'query', 'value'])
"""
import dataclasses
import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from liftmods import initializers
from liftmods.core.nn.linear import default_kernel_init, dense_general

__all__ = ['dot_product_attention', 'multi_head_dot_product_attention',
           'CacheEntry', 'make_padding_mask']

_AXIS_ERROR = ('Attention axis must be between the batch axis and the '
               'last-two axes.')


def _check_axes(ndim, axes):
  for ax in axes:
    if not (ndim >= 3 and 1 <= ax < ndim - 2):
      raise ValueError(_AXIS_ERROR)


def _child(scope, fn, name=None):
  """``fn`` with a child scope bound first (named ``{fn}_{i}`` by default),
  rewound on each call so repeated calls reuse its variables."""
  if name is None:
    name = scope.default_name(getattr(fn, '__name__', '') + '_')
  child = scope.push(name)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    with jax.named_scope(name):
      return fn(child.rewound(), *args, **kwargs)

  return call


def _invert_perm(perm):
  inverse = [0] * len(perm)
  for i, j in enumerate(perm):
    inverse[j] = i
  return tuple(inverse)


def dot_product_attention(scope, query, key, value, dtype=jnp.float32,
                          bias=None, axis=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0,
                          deterministic=False, precision=None):
  """Softmax attention of ``query`` over ``key``/``value`` along ``axis``
  (all axes between the batch axis and the ``(heads, depth)`` axes by
  default)."""
  assert key.shape[:-1] == value.shape[:-1]
  assert (query.shape[0:1] == key.shape[0:1]
          and query.shape[-1] == key.shape[-1])
  if axis is None:
    axis = tuple(range(1, key.ndim - 2))
  if not isinstance(axis, Iterable):
    axis = (axis,)
  assert key.ndim == query.ndim == value.ndim
  _check_axes(query.ndim, axis)
  n = key.ndim
  depth = query.shape[-1]
  batch_dims = tuple(np.delete(range(n), axis + (n - 1,)))
  qk_perm = batch_dims + axis + (n - 1,)
  key = key.transpose(qk_perm)
  query = query.transpose(qk_perm) / jnp.sqrt(depth).astype(dtype)
  value = value.transpose(batch_dims + (n - 1,) + axis)
  batch = tuple(range(len(batch_dims)))
  weights = lax.dot_general(query, key, (((n - 1,), (n - 1,)), (batch, batch)),
                            precision=precision)
  if bias is not None:
    weights = weights + bias
  norm_dims = tuple(range(weights.ndim - len(axis), weights.ndim))
  weights = lax.exp(weights - jax.scipy.special.logsumexp(
      weights, axis=norm_dims, keepdims=True)).astype(dtype)
  if not deterministic and dropout_rate > 0.0:
    if dropout_rng is None:
      dropout_rng = scope.make_rng('dropout')
    keep_prob = 1.0 - dropout_rate
    if broadcast_dropout:
      shape = (1,) * len(batch) + weights.shape[-(2 * len(axis)):]
    else:
      shape = weights.shape
    keep = random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * (keep.astype(weights.dtype) /
                         jnp.asarray(keep_prob, dtype=dtype))
  contract = (norm_dims, range(value.ndim - len(axis), value.ndim))
  y = lax.dot_general(weights, value, (contract, (batch, batch)),
                      precision=precision)
  return y.transpose(_invert_perm(qk_perm))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheEntry:
  """Decoding cache: the keys and values so far and the next index."""

  key: np.ndarray
  value: np.ndarray
  i: np.ndarray

  def replace(self, **updates) -> 'CacheEntry':
    """A copy with ``updates`` applied."""
    return dataclasses.replace(self, **updates)


def _cache_step(scope, inputs_q, key, value, attention_axis):
  """Writes this step's key/value into the cache; returns the full key,
  value, the new entry and the key padding mask."""
  entry = scope.get_variable('cache', 'entry')
  if not isinstance(entry, CacheEntry):
    raise ValueError('Cache is not initialized.')
  expected = list(entry.key.shape[:-2])
  for ax in attention_axis:
    expected[ax] = 1
  expected = tuple(expected) + inputs_q.shape[-1:]
  if expected != inputs_q.shape:
    raise ValueError(f'Invalid shape provided, expected shape {expected} '
                     f'instead got {inputs_q.shape}.')
  cshape = entry.key.shape
  indices = [0] * len(cshape)
  i = entry.i
  size = np.prod(np.take(cshape, attention_axis))
  for ax in attention_axis:
    size //= cshape[ax]
    indices[ax] = i // size
    i = i % size
  key = lax.dynamic_update_slice(entry.key, key, indices)
  value = lax.dynamic_update_slice(entry.value, value, indices)
  entry = entry.replace(i=entry.i + jnp.array(1, jnp.uint32), key=key,
                        value=value)
  key_mask = jnp.broadcast_to(jnp.arange(cshape[1]) < entry.i, cshape[:2])
  return key, value, entry, key_mask.astype(jnp.float32)[..., None]


def _cache_initializer(key):
  """What the cache variable holds before the first decoding step: a
  function of ``(shape, dtype)`` that builds the empty entry."""
  ndim, tail = key.ndim, key.shape[-2:]

  def init_fn(shape, dtype=jnp.float32):
    full = shape + tail
    if len(full) != ndim:
      raise ValueError('Shape should be a tuple with the shape of the batch'
                       'and attention dims.')
    return CacheEntry(key=jnp.zeros(full, dtype),
                      value=jnp.zeros(full, dtype),
                      i=jnp.zeros((), jnp.uint32))

  return init_fn


def multi_head_dot_product_attention(
    scope, inputs_q, inputs_kv, num_heads, dtype=jnp.float32,
    qkv_features=None, out_features=None, attention_axis=None,
    causal_mask=False, padding_mask=None, key_padding_mask=None,
    segmentation=None, key_segmentation=None, cache=False,
    broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
    deterministic=False, precision=None, kernel_init=default_kernel_init,
    bias_init=initializers.zeros_init(), bias=True,
    attention_fn=dot_product_attention):
  """Projects to ``num_heads`` query/key/value heads (children ``query``,
  ``key``, ``value``), attends with ``attention_fn`` under the combined
  mask, and projects back (``out``). With ``cache`` (causal only) the
  ``cache`` collection holds the keys/values of previous decoding steps."""
  assert causal_mask or not cache, (
      'Caching is only support for causal attention.')
  if inputs_kv is None:
    inputs_kv = inputs_q
  if attention_axis is None:
    attention_axis = tuple(range(1, inputs_q.ndim - 1))
  features = out_features or inputs_q.shape[-1]
  qkv_features = qkv_features or inputs_q.shape[-1]
  assert qkv_features % num_heads == 0, (
      'Memory dimension must be divisible by number of heads.')
  project = functools.partial(
      dense_general, axis=-1, dtype=dtype,
      features=(num_heads, qkv_features // num_heads),
      kernel_init=kernel_init, bias_init=bias_init, bias=bias,
      precision=precision)
  query = _child(scope, project, 'query')(inputs_q)
  key = _child(scope, project, 'key')(inputs_kv)
  value = _child(scope, project, 'value')(inputs_kv)
  entry = None
  if cache:
    if scope.has_variable('cache', 'entry'):
      key, value, entry, key_padding_mask = _cache_step(
          scope, inputs_q, key, value, attention_axis)
      scope.put_variable('cache', 'entry', entry)
    else:
      scope.put_variable('cache', 'entry', _cache_initializer(key))
  masks = []
  if causal_mask:
    if entry is not None:
      attn_shape = tuple(np.take(key.shape, attention_axis))
      steps = jnp.arange(np.prod(attn_shape), dtype=jnp.uint32)
      masks.append((steps < entry.i).reshape(
          (1,) * (key.ndim - 1) + attn_shape))
    else:
      masks.append(_make_causal_mask(key, attention_axis))
  for query_mask, key_mask, is_segmentation in (
      (padding_mask, key_padding_mask, False),
      (segmentation, key_segmentation, True)):
    if query_mask is not None:
      masks.append(make_padding_mask(
          padding_mask_query=query_mask,
          padding_mask_key=query_mask if key_mask is None else key_mask,
          query_shape=query.shape, key_shape=key.shape,
          attention_axis=attention_axis, segmentation_mask=is_segmentation))
  attention_bias = None
  if masks:
    mask = functools.reduce(jnp.logical_and, masks)
    attention_bias = lax.select(
        mask > 0, jnp.full(mask.shape, 0.0).astype(dtype),
        jnp.full(mask.shape, -1e10).astype(dtype))
  x = _child(scope, attention_fn)(
      query, key, value, dtype=dtype, axis=attention_axis,
      bias=attention_bias, precision=precision, dropout_rng=dropout_rng,
      dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout,
      deterministic=deterministic)
  return _child(scope, dense_general, 'out')(
      x, features=features, axis=(-2, -1), kernel_init=kernel_init,
      bias_init=bias_init, bias=bias, dtype=dtype, precision=precision)


def make_padding_mask(padding_mask_query, padding_mask_key, query_shape,
                      key_shape, attention_axis=None,
                      segmentation_mask=False):
  """A ``(batch, 1, *q_attn, *k_attn)`` float mask: the product of the query
  and key padding masks (or, for segmentation ids, their equality)."""
  assert query_shape[0] == key_shape[0]
  assert len(query_shape) == len(key_shape)
  ndim = len(key_shape)
  if attention_axis is None:
    attention_axis = tuple(range(1, ndim - 2))
  assert isinstance(attention_axis, tuple)
  _check_axes(ndim, attention_axis)
  final_shape = ((query_shape[0], 1)
                 + tuple(query_shape[ax] for ax in attention_axis)
                 + tuple(key_shape[ax] for ax in attention_axis))
  q = padding_mask_query[..., None]
  k = padding_mask_key[..., None]
  perm = (0,) + tuple(np.flip(np.arange(k.ndim)))[:-1]
  combine = jnp.equal if segmentation_mask else jnp.multiply
  mask = combine(q, k.transpose(perm)).reshape(final_shape)
  return lax.convert_element_type(mask, jnp.float32)


def _make_causal_mask(key, attention_axis=None, self_mask=False):
  """Lower-triangular mask over the flattened attention axes."""
  if attention_axis is None:
    attention_axis = tuple(range(1, key.ndim - 2))
  assert isinstance(attention_axis, tuple)
  _check_axes(key.ndim, attention_axis)
  lead = (1,) * (key.ndim - len(attention_axis) - 1)
  attn = tuple(key.shape[ax] for ax in attention_axis)
  size = int(np.prod(attn))
  rows = jnp.arange(size, dtype=jnp.int32)
  cols = jnp.arange(size, dtype=jnp.int32)
  offset = -1 if self_mask else 0
  mask = lax.ge(lax.broadcast_in_dim(rows, (size, size), (0,)) + offset,
                lax.broadcast(cols, [size]))
  return mask.reshape(lead + attn + attn)
