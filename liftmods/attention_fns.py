"""Functional dot-product attention and attention-mask helpers.

Shapes follow Linen: queries/keys/values are ``[batch..., length, heads,
depth]``, attention weights and masks are ``[batch..., heads, q_len, kv_len]``.
Masks are ``True``/nonzero where attending is allowed.

>>> import jax, jax.numpy as jnp
>>> from liftmods.attention_fns import dot_product_attention, make_causal_mask
>>> q = k = v = jnp.ones((1, 3, 2, 4))
>>> mask = make_causal_mask(jnp.ones((1, 3)))
>>> mask[0, 0]
Array([[1., 0., 0.],
       [1., 1., 0.],
       [1., 1., 1.]], dtype=float32)
>>> dot_product_attention(q, k, v, mask=mask).shape
(1, 3, 2, 4)
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import random

from liftmods.dtypes import promote_dtype

Array = Any
Dtype = Any
PRNGKey = Any
PrecisionLike = Any


def _default_einsum(precision, einsum_dot_general):
  """``jnp.einsum`` bound to the given precision and dot_general."""
  return functools.partial(
      jnp.einsum,
      precision=precision,
      _dot_general=einsum_dot_general or jax.lax.dot_general,
  )


def _check_qk(query, key):
  assert query.ndim == key.ndim, 'q, k must have same rank.'
  assert query.shape[:-3] == key.shape[:-3], 'q, k batch dims must match.'
  assert query.shape[-2] == key.shape[-2], 'q, k num_heads must match.'
  assert query.shape[-1] == key.shape[-1], 'q, k depths must match.'


def _check_qkv(query, key, value):
  assert query.ndim == key.ndim == value.ndim, 'q, k, v must have same rank.'
  assert query.shape[:-3] == key.shape[:-3] == value.shape[:-3], (
      'q, k, v batch dims must match.'
  )
  assert query.shape[-2] == key.shape[-2] == value.shape[-2], (
      'q, k, v num_heads must match.'
  )
  assert key.shape[-3] == value.shape[-3], 'k, v lengths must match.'


def _softmax(logits, dtype, force_fp32_for_softmax):
  """Softmax over the last axis, optionally kept in float32."""
  if force_fp32_for_softmax and dtype != jnp.float32:
    return jax.nn.softmax(logits.astype(jnp.float32))
  return jax.nn.softmax(logits).astype(dtype)


def _attention_dropout(weights, rng, rate, broadcast, key_ndim, dtype):
  """Inverted dropout; with ``broadcast`` one mask is shared by batch/heads."""
  keep_prob = 1.0 - rate
  if broadcast:
    shape = (1,) * (key_ndim - 2) + weights.shape[-2:]
  else:
    shape = weights.shape
  keep = random.bernoulli(rng, keep_prob, shape)
  return weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))


def dot_product_attention_weights(
    query: Array,
    key: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: PRNGKey | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Dtype | None = None,
    precision: PrecisionLike = None,
    module: Any | None = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    einsum: Callable[..., Array] | None = None,
) -> Array:
  """Softmax attention weights of ``query`` against ``key``.

  Args:
    query: ``[batch..., q_length, num_heads, depth]``.
    key: ``[batch..., kv_length, num_heads, depth]``.
    bias: added to the logits; broadcastable to
      ``[batch..., num_heads, q_length, kv_length]``.
    mask: same broadcasting as ``bias``; logits where it is ``False`` are
      replaced by the most negative finite value of the dtype.
    broadcast_dropout: share one dropout mask across batch and head axes.
    dropout_rng: PRNG key for dropout.
    dropout_rate: probability of dropping a weight.
    deterministic: when true, no dropout is applied.
    dtype: computation dtype; inferred from ``query``/``key`` when None.
    precision: ``jax.lax.Precision`` for the einsum.
    module: optional module; when given, the (pre-dropout) weights are sown
      into its ``'intermediates'`` collection as ``'attention_weights'``.
    force_fp32_for_softmax: compute (and return) the softmax in float32 when
      the computation dtype is something else.
    einsum_dot_general: ``dot_general`` used by the default einsum.
    einsum: replacement einsum; exclusive with ``precision`` and
      ``einsum_dot_general``.

  Returns:
    Weights shaped ``[batch..., num_heads, q_length, kv_length]``.

  Raises:
    ValueError: ``einsum`` is given with ``precision`` or
      ``einsum_dot_general``.
  """
  if (precision or einsum_dot_general) and einsum:
    raise ValueError(
        'precision/einsum_dot_general and einsum are mutually exclusive. '
        'Please specify only one of them.'
    )
  einsum = einsum or _default_einsum(precision, einsum_dot_general)
  query, key = promote_dtype(query, key, dtype=dtype)
  dtype = query.dtype
  _check_qk(query, key)
  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  logits = einsum('...qhd,...khd->...hqk', query, key)
  if bias is not None:
    logits = logits + bias
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(dtype).min)
  weights = _softmax(logits, dtype, force_fp32_for_softmax)
  if module:
    module.sow('intermediates', 'attention_weights', weights)
  if not deterministic and dropout_rate > 0.0:
    weights = _attention_dropout(
        weights, dropout_rng, dropout_rate, broadcast_dropout, key.ndim, dtype
    )
  return weights


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: PRNGKey | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Dtype | None = None,
    precision: PrecisionLike = None,
    module: Any | None = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
) -> Array:
  """Scaled dot-product attention (Vaswani et al., 2017).

  ``query``, ``key`` and ``value`` may have any number of batch axes,
  including none.

  Args:
    query: ``[batch..., q_length, num_heads, qk_depth]``.
    key: ``[batch..., kv_length, num_heads, qk_depth]``.
    value: ``[batch..., kv_length, num_heads, v_depth]``.
    bias: added to the logits; broadcastable to
      ``[batch..., num_heads, q_length, kv_length]``.
    mask: same broadcasting as ``bias``; where it is ``False`` the query
      does not attend to the key.
    broadcast_dropout: share one dropout mask across batch and head axes.
    dropout_rng: PRNG key for dropout.
    dropout_rate: probability of dropping a weight.
    deterministic: when true, no dropout is applied.
    dtype: computation dtype; inferred from the inputs when None.
    precision: ``jax.lax.Precision`` for the einsums.
    module: optional module into whose ``'intermediates'`` the weights are
      sown (see :func:`dot_product_attention_weights`).
    force_fp32_for_softmax: compute the softmax in float32.
    einsum_dot_general: ``dot_general`` used by the default einsums.
    qk_attn_weights_einsum: einsum for the query-key product.
    attn_weights_value_einsum: einsum for the weights-value product. The two
      einsums must be given together, and not with ``precision`` or
      ``einsum_dot_general``.

  Returns:
    ``[batch..., q_length, num_heads, v_depth]``.

  Raises:
    ValueError: only one of the two einsums is given, or they are given with
      ``precision`` or ``einsum_dot_general``.
  """
  if bool(qk_attn_weights_einsum) != bool(attn_weights_value_einsum):
    raise ValueError(
        'qk_attn_weights_einsum and attn_weights_value_einsum must be '
        'specified together.'
    )
  if (precision or einsum_dot_general) and qk_attn_weights_einsum:
    raise ValueError(
        'precision/einsum_dot_general and '
        'qk_attn_weights_einsum/attn_weights_value_einsum are mutually '
        'exclusive. Please specify only one of them.'
    )
  query, key, value = promote_dtype(query, key, value, dtype=dtype)
  dtype = query.dtype
  _check_qkv(query, key, value)
  weights = dot_product_attention_weights(
      query, key, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
      deterministic, dtype, precision, module, force_fp32_for_softmax,
      einsum_dot_general=einsum_dot_general, einsum=qk_attn_weights_einsum,
  )
  einsum = attn_weights_value_einsum or _default_einsum(
      precision, einsum_dot_general
  )
  return einsum('...hqk,...khd->...qhd', weights, value)


def make_attention_mask(
    query_input: Array,
    key_input: Array,
    pairwise_fn: Callable[..., Any] = jnp.multiply,
    extra_batch_dims: int = 0,
    dtype: Dtype = jnp.float32,
) -> Array:
  """Pairwise mask between a query sequence and a key sequence.

  Args:
    query_input: ``[batch..., len_q]``.
    key_input: ``[batch..., len_kv]``.
    pairwise_fn: broadcasting elementwise function of (query, key) values.
    extra_batch_dims: number of leading singleton axes to add.
    dtype: dtype of the returned mask.

  Returns:
    ``[batch..., 1, len_q, len_kv]`` (a head axis of size one is inserted).
  """
  mask = pairwise_fn(jnp.expand_dims(query_input, axis=-1),
                     jnp.expand_dims(key_input, axis=-2))
  mask = jnp.expand_dims(mask, axis=-3)
  mask = jnp.expand_dims(mask, axis=tuple(range(extra_batch_dims)))
  return mask.astype(dtype)


def make_causal_mask(
    x: Array, extra_batch_dims: int = 0, dtype: Dtype = jnp.float32
) -> Array:
  """Lower-triangular self-attention mask for ``x`` of shape ``[batch..., len]``.

  Only the shape of ``x`` is used.

  Args:
    x: ``[batch..., len]``.
    extra_batch_dims: number of leading singleton axes to add.
    dtype: dtype of the returned mask.

  Returns:
    ``[batch..., 1, len, len]``, where position ``i`` may attend to
      positions ``j <= i``.
  """
  positions = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32),
                               x.shape)
  return make_attention_mask(positions, positions, jnp.greater_equal,
                             extra_batch_dims=extra_batch_dims, dtype=dtype)


def combine_masks(
    *masks: Array | None, dtype: Dtype = jnp.float32
) -> Array | None:
  """Logical AND of the given masks, ignoring ``None`` entries.

  Args:
    *masks: masks of one rank, or None.
    dtype: dtype of the returned mask.

  Returns:
    The combined mask cast to ``dtype``, or None when every mask is None.
  """
  present = [m for m in masks if m is not None]
  if not present:
    return None
  ranks = tuple(m.ndim for m in present)
  assert len(set(ranks)) == 1, f'masks must have same rank: {ranks}'
  combined = present[0]
  for other in present[1:]:
    combined = jnp.logical_and(combined, other)
  return combined.astype(dtype)
