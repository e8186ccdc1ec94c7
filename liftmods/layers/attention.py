"""Multi-head dot-product attention layers.

``MultiHeadDotProductAttention`` projects queries, keys and values to
``num_heads`` heads with ``DenseGeneral`` layers named ``query``, ``key`` and
``value``, attends with ``attention_fn`` and projects back with ``out``. With
``decode=True`` it keeps an autoregressive cache (``cached_key``,
``cached_value``, ``cache_index``) in the ``'cache'`` collection.

>>> import jax, jax.numpy as jnp
>>> from liftmods.layers.attention import MultiHeadDotProductAttention
>>> layer = MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
>>> x = jnp.ones((1, 3, 4))
>>> variables = layer.init(jax.random.key(0), x)
>>> jax.tree_util.tree_map(jnp.shape, variables['params']['query'])
{'bias': (2, 4), 'kernel': (4, 2, 4)}
>>> layer.apply(variables, x).shape
(1, 3, 4)
"""
from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from liftmods import errors, initializers
from liftmods.core import explicit
from liftmods.attention_fns import combine_masks, dot_product_attention
from liftmods.layers.linear import DenseGeneral, default_kernel_init
from liftmods.layers.normalization import LayerNorm
from liftmods.module import Module, compact, merge_param, nowrap

__all__ = ['MultiHeadDotProductAttention', 'MultiHeadAttention',
           'SelfAttention']

Array = Any
Dtype = Any
PRNGKey = Any
PrecisionLike = Any
Initializer = Any
DotGeneralT = Any

_KV_DEPRECATION = (
    'inputs_kv is deprecated; pass the same array as inputs_k (and leave '
    'inputs_v as None) instead.')
_MASK_HINT = (
    'inputs_v has shape {shape}, whose last two axes are equal: if it is an '
    'attention mask, pass it as mask=... (the call signature is '
    '(inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None, '
    'deterministic=None, dropout_rng=None, sow_weights=False)).')


class AttentionConfigError(errors.LiftmodsError, ValueError):
  """An attention layer got attributes or inputs it cannot work with."""


def _decode_cache_missing(path: str) -> errors.ScopeCollectionNotFound:
  """``decode=True`` was applied without a cache to read or create."""
  return errors.ScopeCollectionNotFound(
      'cache', 'cached_key', path,
      hint=f'At {path}: decode=True needs the autoregressive cache '
      '(collection "cache": cached_key, cached_value, cache_index), '
      'expected it in the variables or a mutable "cache" collection, got '
      'neither. Create it with init() (or apply(..., mutable=["cache"]) on '
      'full-length inputs), then apply each step with mutable=["cache"].')


def _resolve_inputs(inputs_q, inputs_k, inputs_v, inputs_kv):
  """Fills in keys/values: k defaults to q, v defaults to k."""
  if inputs_kv is not None:
    if inputs_k is not None or inputs_v is not None:
      raise ValueError(
          'If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must '
          'be None. If `inputs_kv` is not None, both `inputs_k` and '
          '`inputs_v` must be None. We recommend using `inputs_k` and '
          '`inputs_v` args, since `inputs_kv` will be deprecated soon. See '
          'https://github.com/google/flax/discussions/3389 for more '
          'information. (Pass either inputs_kv or inputs_k/inputs_v, not '
          f'both: got inputs_k={_shape_or_none(inputs_k)}, '
          f'inputs_v={_shape_or_none(inputs_v)} together with inputs_kv.)')
    warnings.warn(_KV_DEPRECATION, DeprecationWarning)
    return inputs_kv, inputs_kv
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError(
          '`inputs_k` cannot be None if `inputs_v` is not None. To have both '
          '`inputs_k` and `inputs_v` be the same value, pass in the value to '
          '`inputs_k` and leave `inputs_v` as None.')
    inputs_k = inputs_q
  if inputs_v is None:
    return inputs_k, inputs_k
  if inputs_v.shape[-1] == inputs_v.shape[-2]:
    warnings.warn(_MASK_HINT.format(shape=inputs_v.shape), DeprecationWarning)
  return inputs_k, inputs_v


def _shape_or_none(x):
  return None if x is None else tuple(x.shape)


def _accepted_kwargs(fn: Callable, kwargs: dict) -> dict:
  """The entries of ``kwargs`` that ``fn`` names in its signature."""
  names = inspect.signature(fn).parameters
  return {k: v for k, v in kwargs.items() if k in names}


def _make(factory):
  return factory() if factory else None


class MultiHeadDotProductAttention(Module):
  """Multi-head dot-product attention (query/key/value/out projections).

  Attributes:
    num_heads: number of heads; ``qkv_features`` must be divisible by it.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    qkv_features: size of the projected queries, keys and values (default: the
      feature size of ``inputs_q``).
    out_features: size of the output (default: the feature size of
      ``inputs_q``).
    broadcast_dropout: share one attention-dropout mask over the batch and head
      axes.
    dropout_rate: attention-weight dropout probability.
    deterministic: disables dropout; may instead be given at call time.
    precision: precision of the projections and the attention einsums.
    kernel_init: initializer of the projection kernels.
    out_kernel_init: initializer of the ``out`` projection kernel (None:
      ``kernel_init``).
    bias_init: initializer of the projection biases.
    out_bias_init: initializer of the ``out`` projection bias (None:
      ``bias_init``).
    use_bias: whether the projections have biases.
    attention_fn: function ``(query, key, value, **kwargs)`` computing the
      attention; only the keyword arguments it declares are passed.
    decode: keep and use an autoregressive key/value cache (the ``cache``
      collection): each call writes its positions (one, or a whole prompt)
      after those already cached, and attends causally.
    normalize_qk: apply bias-free LayerNorms ``query_ln``/``key_ln`` to the
      projected queries and keys.
    force_fp32_for_softmax: compute the softmax in float32.
    qkv_dot_general: ``dot_general`` of the query/key/value ``DenseGeneral``
      projections.
    out_dot_general: ``dot_general`` of the ``out`` projection.
    qkv_dot_general_cls: ``dot_general_cls`` of the query/key/value
      projections.
    out_dot_general_cls: ``dot_general_cls`` of the ``out`` projection.
    qk_attn_weights_einsum_cls: factory of the einsum computing the attention
      weights, given to ``attention_fn``.
    attn_weights_value_einsum_cls: factory of the einsum applying the weights
      to the values, given to ``attention_fn``.

  >>> import jax, jax.numpy as jnp
  >>> layer = MultiHeadDotProductAttention(num_heads=2, out_features=3)
  >>> q, kv = jnp.ones((2, 5, 4)), jnp.ones((2, 6, 4))
  >>> variables = layer.init(jax.random.key(0), q, kv)
  >>> layer.apply(variables, q, kv).shape
  (2, 5, 3)
  """

  num_heads: int
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  qkv_features: int | None = None
  out_features: int | None = None
  broadcast_dropout: bool = True
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  out_kernel_init: Initializer | None = None
  bias_init: Initializer = initializers.zeros_init()
  out_bias_init: Initializer | None = None
  use_bias: bool = True
  attention_fn: Callable[..., Array] = dot_product_attention
  decode: bool = False
  normalize_qk: bool = False
  force_fp32_for_softmax: bool = False
  qkv_dot_general: DotGeneralT | None = None
  out_dot_general: DotGeneralT | None = None
  qkv_dot_general_cls: Any = None
  out_dot_general_cls: Any = None
  qk_attn_weights_einsum_cls: Callable[..., Callable[..., Array]] | None = None
  attn_weights_value_einsum_cls: Callable[..., Callable[..., Array]] | None = (
      None)

  @compact
  def __call__(self, inputs_q: Array, inputs_k: Array | None = None,
               inputs_v: Array | None = None, *,
               inputs_kv: Array | None = None, mask: Array | None = None,
               deterministic: bool | None = None,
               dropout_rng: PRNGKey | None = None,
               sow_weights: bool = False):
    """Attends from ``inputs_q`` to ``inputs_k``/``inputs_v``.

    Args:
      inputs_q: ``[batch..., q_length, features]``.
      inputs_k: ``[batch..., kv_length, features]``; defaults to ``inputs_q``.
      inputs_v: like ``inputs_k``, which it defaults to.
      inputs_kv: deprecated single argument for keys and values.
      mask: broadcastable to ``[batch..., num_heads, q_length, kv_length]``;
        positions where it is False are not attended to.
      deterministic: disables dropout (merged with the attribute).
      dropout_rng: key for attention dropout (default: the 'dropout' rng).
      sow_weights: store the attention weights in 'intermediates'.

    Returns:
      ``[batch..., q_length, out_features]``.
    """
    inputs_k, inputs_v = _resolve_inputs(inputs_q, inputs_k, inputs_v,
                                         inputs_kv)
    self._check_kv(inputs_k, inputs_v)
    features = self.out_features or inputs_q.shape[-1]
    head_dim = self._head_dim(inputs_q.shape[-1])
    query, key, value = self._project_qkv(inputs_q, inputs_k, inputs_v,
                                          head_dim)
    if self.normalize_qk:
      query, key = self._normalize_qk(query, key)
    if self.decode:
      key, value, mask = self._decode_step(query, key, value, mask)
    deterministic, dropout_rng = self._dropout_args(deterministic, dropout_rng)
    x = self._attend(query, key, value, mask, deterministic, dropout_rng,
                     sow_weights)
    return self._project_out(x, features)

  # -- pieces of __call__ (nowrap: they run inside the compact call) ----------

  @nowrap
  def _where(self) -> str:
    return f'{type(self).__name__} at {self.scope.path_text}'

  @nowrap
  def _check_kv(self, inputs_k, inputs_v):
    if inputs_k.shape[:-1] != inputs_v.shape[:-1]:
      raise AttentionConfigError(
          f'{self._where()}: keys and values must have the same batch and '
          f'length axes, expected inputs_v.shape[:-1] == '
          f'{tuple(inputs_k.shape[:-1])}, got {tuple(inputs_v.shape[:-1])}.')

  @nowrap
  def _head_dim(self, in_features: int) -> int:
    qkv_features = self.qkv_features or in_features
    if qkv_features % self.num_heads:
      raise AttentionConfigError(
          f'{self._where()}: qkv_features must be divisible by num_heads, '
          f'expected a multiple of {self.num_heads}, got {qkv_features}.')
    return qkv_features // self.num_heads

  @nowrap
  def _project_qkv(self, inputs_q, inputs_k, inputs_v, head_dim):
    """Projects the inputs to ``[batch..., length, num_heads, head_dim]``."""

    def proj(name):
      return DenseGeneral(
          features=(self.num_heads, head_dim), axis=-1, dtype=self.dtype,
          param_dtype=self.param_dtype, kernel_init=self.kernel_init,
          bias_init=self.bias_init, use_bias=self.use_bias,
          precision=self.precision, dot_general=self.qkv_dot_general,
          dot_general_cls=self.qkv_dot_general_cls, name=name)

    return (proj('query')(inputs_q), proj('key')(inputs_k),
            proj('value')(inputs_v))

  @nowrap
  def _normalize_qk(self, query, key):

    def norm(name):
      return LayerNorm(use_bias=False, dtype=self.dtype,
                       param_dtype=self.param_dtype, name=name)

    return norm('query_ln')(query), norm('key_ln')(key)

  @nowrap
  def _decode_step(self, query, key, value, mask):
    """Writes this step's key/value into the cache and masks the future.

    On the call that creates the cache (init) the inputs pass through.
    """
    primed = self.has_variable('cache', 'cached_key')
    if not primed and not self.is_mutable_collection('cache'):
      raise _decode_cache_missing(self.scope.path_text)
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, key.shape,
                               key.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros,
                                 value.shape, value.dtype)
    cache_index = self.variable('cache', 'cache_index',
                                lambda: jnp.array(0, dtype=jnp.int32))
    if not primed:
      return key, value, mask
    *batch, max_length, heads, depth = cached_key.value.shape
    steps = query.shape[-3] if query.ndim == len(batch) + 3 else 1
    expected = tuple(batch) + (steps, heads, depth)
    if tuple(query.shape) != expected or not 1 <= steps <= max_length:
      raise AttentionConfigError(
          'Autoregressive cache shape error, expected query shape '
          f'{tuple(batch) + (1, heads, depth)} instead got '
          f'{tuple(query.shape)}. ({self._where()}: decode=True feeds one '
          'position per call, or a prompt of at most the cache length '
          f'{max_length} in one call; the other dimensions come from the '
          'cache.)')
    position = cache_index.value
    zero = jnp.array(0, dtype=position.dtype)
    start = (zero,) * len(batch) + (position, zero, zero)
    key = lax.dynamic_update_slice(
        cached_key.value, explicit.layout_as(key, cached_key.value), start)
    value = lax.dynamic_update_slice(
        cached_value.value, explicit.layout_as(value, cached_value.value),
        start)
    cached_key.value, cached_value.value = key, value
    cache_index.value = cache_index.value + steps
    if steps == 1:
      filled = jnp.broadcast_to(jnp.arange(max_length) <= position,
                                tuple(batch) + (1, 1, max_length))
    else:  # a prompt: each of its positions sees the cache up to itself
      seen = position + jnp.arange(steps, dtype=position.dtype)[:, None]
      filled = jnp.broadcast_to(jnp.arange(max_length)[None, :] <= seen,
                                tuple(batch) + (1, steps, max_length))
    return key, value, combine_masks(mask, filled)

  @nowrap
  def _dropout_args(self, deterministic, dropout_rng):
    """``deterministic`` is only required when dropout is configured."""
    if self.dropout_rate <= 0.0:
      return True, dropout_rng
    deterministic = merge_param('deterministic', self.deterministic,
                                deterministic)
    if not deterministic and dropout_rng is None:
      dropout_rng = self.make_rng('dropout')
    return deterministic, dropout_rng

  @nowrap
  def _attend(self, query, key, value, mask, deterministic, dropout_rng,
              sow_weights):
    kwargs = _accepted_kwargs(self.attention_fn, dict(
        mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout, deterministic=deterministic,
        dtype=self.dtype, precision=self.precision,
        force_fp32_for_softmax=self.force_fp32_for_softmax,
        qk_attn_weights_einsum=_make(self.qk_attn_weights_einsum_cls),
        attn_weights_value_einsum=_make(self.attn_weights_value_einsum_cls)))
    if sow_weights:
      kwargs['module'] = self
    return self.attention_fn(query, key, value, **kwargs)

  @nowrap
  def _project_out(self, x, features):
    return DenseGeneral(
        features=features, axis=(-2, -1),
        kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init,
        use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, precision=self.precision,
        dot_general=self.out_dot_general,
        dot_general_cls=self.out_dot_general_cls, name='out')(x)


class MultiHeadAttention(MultiHeadDotProductAttention):
  """Same layer as :class:`MultiHeadDotProductAttention` under another name.

  Only the automatic name differs (``MultiHeadAttention_0``), which changes
  the variable paths and therefore the initial parameter values.

  Attributes:
    num_heads: number of heads; ``qkv_features`` must be divisible by it.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    qkv_features: size of the projected queries, keys and values (default: the
      feature size of ``inputs_q``).
    out_features: size of the output (default: the feature size of
      ``inputs_q``).
    broadcast_dropout: share one attention-dropout mask over the batch and head
      axes.
    dropout_rate: attention-weight dropout probability.
    deterministic: disables dropout; may instead be given at call time.
    precision: precision of the projections and the attention einsums.
    kernel_init: initializer of the projection kernels.
    out_kernel_init: initializer of the ``out`` projection kernel (None:
      ``kernel_init``).
    bias_init: initializer of the projection biases.
    out_bias_init: initializer of the ``out`` projection bias (None:
      ``bias_init``).
    use_bias: whether the projections have biases.
    attention_fn: function ``(query, key, value, **kwargs)`` computing the
      attention; only the keyword arguments it declares are passed.
    decode: keep and use an autoregressive key/value cache (the ``cache``
      collection): each call writes its positions (one, or a whole prompt)
      after those already cached, and attends causally.
    normalize_qk: apply bias-free LayerNorms ``query_ln``/``key_ln`` to the
      projected queries and keys.
    force_fp32_for_softmax: compute the softmax in float32.
    qkv_dot_general: ``dot_general`` of the query/key/value ``DenseGeneral``
      projections.
    out_dot_general: ``dot_general`` of the ``out`` projection.
    qkv_dot_general_cls: ``dot_general_cls`` of the query/key/value
      projections.
    out_dot_general_cls: ``dot_general_cls`` of the ``out`` projection.
    qk_attn_weights_einsum_cls: factory of the einsum computing the attention
      weights, given to ``attention_fn``.
    attn_weights_value_einsum_cls: factory of the einsum applying the weights
      to the values, given to ``attention_fn``.

  >>> import jax, jax.numpy as jnp
  >>> layer = MultiHeadAttention(num_heads=1)
  >>> x = jnp.ones((2, 3))
  >>> layer.apply(layer.init(jax.random.key(0), x), x).shape
  (2, 3)
  """


class SelfAttention(MultiHeadDotProductAttention):
  """Deprecated self-attention layer: attends ``inputs_q`` to itself.

  Prefer ``MultiHeadDotProductAttention()(x)``, which does the same.

  Attributes:
    num_heads: number of heads; ``qkv_features`` must be divisible by it.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    qkv_features: size of the projected queries, keys and values (default: the
      feature size of ``inputs_q``).
    out_features: size of the output (default: the feature size of
      ``inputs_q``).
    broadcast_dropout: share one attention-dropout mask over the batch and head
      axes.
    dropout_rate: attention-weight dropout probability.
    deterministic: disables dropout; may instead be given at call time.
    precision: precision of the projections and the attention einsums.
    kernel_init: initializer of the projection kernels.
    out_kernel_init: initializer of the ``out`` projection kernel (None:
      ``kernel_init``).
    bias_init: initializer of the projection biases.
    out_bias_init: initializer of the ``out`` projection bias (None:
      ``bias_init``).
    use_bias: whether the projections have biases.
    attention_fn: function ``(query, key, value, **kwargs)`` computing the
      attention; only the keyword arguments it declares are passed.
    decode: keep and use an autoregressive key/value cache (the ``cache``
      collection): each call writes its positions (one, or a whole prompt)
      after those already cached, and attends causally.
    normalize_qk: apply bias-free LayerNorms ``query_ln``/``key_ln`` to the
      projected queries and keys.
    force_fp32_for_softmax: compute the softmax in float32.
    qkv_dot_general: ``dot_general`` of the query/key/value ``DenseGeneral``
      projections.
    out_dot_general: ``dot_general`` of the ``out`` projection.
    qkv_dot_general_cls: ``dot_general_cls`` of the query/key/value
      projections.
    out_dot_general_cls: ``dot_general_cls`` of the ``out`` projection.
    qk_attn_weights_einsum_cls: factory of the einsum computing the attention
      weights, given to ``attention_fn``.
    attn_weights_value_einsum_cls: factory of the einsum applying the weights
      to the values, given to ``attention_fn``.

  >>> import warnings, jax, jax.numpy as jnp
  >>> warnings.simplefilter('ignore', DeprecationWarning)
  >>> layer = SelfAttention(num_heads=2)
  >>> x = jnp.ones((1, 3, 4))
  >>> layer.apply(layer.init(jax.random.key(0), x), x).shape
  (1, 3, 4)
  """

  @compact
  def __call__(self, inputs_q: Array, mask: Array | None = None,
               deterministic: bool | None = None,
               dropout_rng: PRNGKey | None = None,
               sow_weights: bool = False):
    """Self-attention over ``inputs_q``; see the parent class."""
    warnings.warn(
        'SelfAttention is deprecated; call MultiHeadDotProductAttention on '
        'inputs_q alone instead.', DeprecationWarning)
    return super().__call__(inputs_q, mask=mask, deterministic=deterministic,
                            dropout_rng=dropout_rng, sow_weights=sow_weights)
