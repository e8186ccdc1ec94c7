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

:func:`fused_dot_product_attention` takes the same arguments and hands the
computation to ``jax.nn.dot_product_attention`` (XLA's or cuDNN's fused
kernel); it is opt in, through a layer's ``attention_fn``.
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import random

from liftmods import errors
from liftmods.core import caching, explicit
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
  keep = random.bernoulli(rng, keep_prob, shape,
                          out_sharding=explicit.sharding_like(weights, shape))
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
  logits = explicit.einsum('dot_product_attention_weights',
                           '...qhd,...khd->...hqk', query, key, op=einsum,
                           weight=False)
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
  return explicit.einsum('dot_product_attention', '...hqk,...khd->...qhd',
                         weights, value, op=einsum, weight=False)


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


# --- fused attention (opt in) --------------------------------------------------


class FusedAttentionError(errors.LiftmodsError, ValueError):
  """Inputs or options :func:`fused_dot_product_attention` cannot take."""

  docs_link = 'docs/attention.md#errors'


class FusedAttentionWarning(UserWarning):
  """:func:`fused_dot_product_attention` ran :func:`dot_product_attention`
  instead of ``jax.nn.dot_product_attention``; the message says why."""


def _shape_error(q: tuple, k: tuple, v: tuple) -> str | None:
  """What is wrong with the q/k/v shapes for the fused call, or None."""
  shapes = f'(query {q}, key {k}, value {v})'
  if not len(q) == len(k) == len(v):
    return f'query, key and value must have the same rank {shapes}'
  if len(q) < 3:
    return ('query, key and value must be [batch..., length, heads, depth], '
            f'of rank 3 or more {shapes}')
  if not q[:-3] == k[:-3] == v[:-3]:
    return f'query, key and value must have the same batch axes {shapes}'
  if k[-3] != v[-3]:
    return f'key and value must have the same length {shapes}'
  if k[-2] != v[-2]:
    return f'key and value must have the same number of heads {shapes}'
  if q[-1] != k[-1]:
    return f'query and key must have the same depth {shapes}'
  if q[-2] % k[-2]:
    return ('the query heads must be a multiple of the key/value heads '
            f'(grouped-query attention) {shapes}')
  return None


def _window_pair(local_window_size) -> tuple[int, int] | None:
  """``local_window_size`` as ``(left, right)``, checked."""
  if local_window_size is None:
    return None
  pair = local_window_size
  if isinstance(pair, int) and not isinstance(pair, bool):
    pair = (pair, pair)
  ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and
        all(isinstance(w, int) and not isinstance(w, bool) and w >= 0
            for w in pair))
  if not ok:
    raise FusedAttentionError(
        'fused_dot_product_attention: local_window_size must be a '
        'non-negative int or a pair (left, right) of them, got '
        f'{local_window_size!r}.')
  return tuple(pair)


def _position_mask(length: int, is_causal: bool,
                   window: tuple[int, int] | None) -> Array | None:
  """``[1, length, length]`` booleans: query ``i`` may see key ``j``; None
  when neither ``is_causal`` nor ``window`` limits it."""
  positions = jnp.arange(length)
  causal = make_causal_mask(positions, dtype=jnp.bool_) if is_causal else None
  local = None
  if window is not None:
    left, right = window
    local = make_attention_mask(
        positions, positions,
        lambda i, j: (j >= i - left) & (j <= i + right), dtype=jnp.bool_)
  return combine_masks(causal, local, dtype=jnp.bool_)


def _and_masks(mask, extra):
  """``mask`` and ``extra`` (either may be None), broadcasting."""
  if extra is None:
    return mask
  if mask is None:
    return extra
  return jnp.logical_and(mask, extra)


@functools.lru_cache(maxsize=8)
def _options_of(fn) -> frozenset:
  """The parameter names of ``fn`` (``jax.nn.dot_product_attention``),
  probed once per function."""
  return frozenset(inspect.signature(fn).parameters)


caching.register('attention_fns._options_of', caching.Policy(
    holds='the parameter names of a dot-product attention function '
          '(`jax.nn.dot_product_attention`), read by '
          '`fused_dot_product_attention`',
    keyed_on='the function',
    bound='8 entries',
    cleared='on eviction'), clear=_options_of.cache_clear)


def _fallback_reasons(dropout_rate, deterministic, precision, module,
                      einsum_dot_general, qk_attn_weights_einsum,
                      attn_weights_value_einsum, qk_depth: int,
                      v_depth: int) -> list:
  """Why the call cannot go to ``jax.nn.dot_product_attention``."""
  reasons = []
  if not deterministic and dropout_rate > 0.0:
    reasons.append(
        f'dropout (dropout_rate={dropout_rate}, deterministic=False): '
        'jax.nn.dot_product_attention has no dropout')
  if module is not None:
    reasons.append(
        'module= (sowing the attention weights): the fused kernel never '
        'forms the weights')
  if precision is not None:
    reasons.append(
        f'precision={precision!r}: jax.nn.dot_product_attention takes no '
        'precision')
  custom = [name for name, fn in (
      ('einsum_dot_general', einsum_dot_general),
      ('qk_attn_weights_einsum', qk_attn_weights_einsum),
      ('attn_weights_value_einsum', attn_weights_value_einsum)) if fn]
  if custom:
    reasons.append(
        f'{" and ".join(custom)}: jax.nn.dot_product_attention computes '
        'its own products')
  if v_depth != qk_depth:
    reasons.append(
        f'value depth {v_depth} differs from the query/key depth '
        f'{qk_depth}: jax.nn.dot_product_attention needs them equal')
  return reasons


def _as_4d(x, what: str, batch: tuple, heads: int, q_len: int, kv_len: int,
           full_lengths: bool):
  """A mask or bias broadcastable to ``batch + (heads, q_len, kv_len)`` as
  ``[1 or prod(batch), 1 or heads, q_len or 1, kv_len or 1]`` (lengths
  broadcast out when ``full_lengths``)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  full = tuple(batch) + (heads, q_len, kv_len)
  wanted = ('[batch..., heads, q_length, kv_length] = '
            f'{list(full)}')
  if x.ndim > len(full):
    raise FusedAttentionError(
        f'fused_dot_product_attention: {what} has rank {x.ndim}, more than '
        f'{wanted}; expected a shape broadcastable to it, got '
        f'{tuple(x.shape)}.')
  x = x.reshape((1,) * (len(full) - x.ndim) + tuple(x.shape))
  if any(d not in (1, f) for d, f in zip(x.shape, full)):
    raise FusedAttentionError(
        f'fused_dot_product_attention: {what} of shape {tuple(x.shape)} '
        f'does not broadcast to {wanted}.')
  nb = len(batch)
  if all(d == 1 for d in x.shape[:nb]):
    lead = 1
  else:
    x = jnp.broadcast_to(x, tuple(batch) + x.shape[nb:])
    lead = math.prod(batch)
  rest = x.shape[nb:]
  if full_lengths:
    rest = (rest[0], q_len, kv_len)
    x = jnp.broadcast_to(x, x.shape[:nb] + rest)
  return x.reshape((lead,) + tuple(rest))


def fused_dot_product_attention(
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
    *,
    implementation: str | None = None,
    is_causal: bool = False,
    local_window_size: int | tuple[int, int] | None = None,
    fallback: bool = True,
) -> Array:
  """:func:`dot_product_attention` computed by ``jax.nn.dot_product_attention``.

  Takes the arguments of :func:`dot_product_attention`, in the same order,
  so it drops into a layer's ``attention_fn``; choose the keyword-only
  options with ``functools.partial``. The result equals the default path's
  to float rounding (the scale is applied to the logits rather than the
  query, and the softmax is always computed in float32). Linen's inputs are
  mapped onto the fused call: any number of batch axes (flattened into
  one), masks of 0/1 or booleans (``True`` = attend) and biases
  broadcastable to ``[batch..., heads, q_length, kv_length]``, and key/value
  heads that divide the query heads (grouped-query attention, which the
  default path lacks).

  What ``jax.nn.dot_product_attention`` cannot do runs on
  :func:`dot_product_attention` instead, with a
  :class:`FusedAttentionWarning` naming the reason (or, with
  ``fallback=False``, raises :class:`FusedAttentionError`): dropout that is
  on (``dropout_rate > 0`` and not ``deterministic``; the fallback draws
  the same mask from ``dropout_rng``, so it equals the default path bit for
  bit), ``module`` (sowing the weights, which the kernel never forms),
  ``precision``, custom einsums or ``einsum_dot_general``, and a value depth
  different from the key depth. ``is_causal`` and ``local_window_size`` then
  become an explicit mask.

  Args:
    query: ``[batch..., q_length, num_heads, qk_depth]``.
    key: ``[batch..., kv_length, num_kv_heads, qk_depth]``, ``num_kv_heads``
      dividing ``num_heads``.
    value: ``[batch..., kv_length, num_kv_heads, v_depth]``.
    bias: added to the logits; broadcastable to
      ``[batch..., num_heads, q_length, kv_length]``.
    mask: same broadcasting as ``bias``; where it is ``False`` (or 0) the
      query does not attend to the key.
    broadcast_dropout: share one dropout mask across batch and head axes
      (fallback only).
    dropout_rng: PRNG key for dropout (fallback only).
    dropout_rate: probability of dropping a weight; above 0 and not
      ``deterministic``, the call falls back.
    deterministic: when true, no dropout is applied.
    dtype: computation dtype; inferred from the inputs when None.
    precision: must be None for the fused path (otherwise it falls back).
    module: must be None for the fused path (otherwise it falls back and
      sows the weights).
    force_fp32_for_softmax: the fused softmax is always float32; when true
      the output is returned in float32, as the default path returns it.
    einsum_dot_general: must be None for the fused path.
    qk_attn_weights_einsum: must be None for the fused path.
    attn_weights_value_einsum: must be None for the fused path.
    implementation: ``jax.nn.dot_product_attention``'s: None (JAX picks;
      today XLA), ``'xla'`` or ``'cudnn'`` (the cuDNN flash kernel on an
      NVIDIA GPU: float16/bfloat16 only, and it raises for what it does not
      support).
    is_causal: query ``i`` attends to keys ``j <= i``, as
      :func:`make_causal_mask`; needs ``q_length == kv_length``. With cuDNN
      the masked half is skipped rather than computed.
    local_window_size: ``(left, right)``: query ``i`` attends to keys ``i -
      left <= j <= i + right``; an int ``w`` means ``(w, w)``. Needs
      ``q_length == kv_length``; cuDNN takes only ``right == 0`` or
      ``is_causal``.
    fallback: when the call cannot be fused, run
      :func:`dot_product_attention` with a warning (True) or raise (False).

  Returns:
    ``[batch..., q_length, num_heads, v_depth]``, of the computation dtype
    (float32 when ``force_fp32_for_softmax``).

  Raises:
    FusedAttentionError: shapes that do not fit together, a mask or bias
      that does not broadcast, a bad ``local_window_size``, ``is_causal`` or
      a window with ``q_length != kv_length``, or an unfusable call with
      ``fallback=False``.

  >>> import functools, jax, jax.numpy as jnp
  >>> import liftmods as nn
  >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 5, 4, 8))
  >>> mask = nn.make_causal_mask(jnp.ones((2, 5)))
  >>> fused = nn.fused_dot_product_attention(q, k, v, mask=mask)
  >>> default = nn.dot_product_attention(q, k, v, mask=mask)
  >>> bool(jnp.allclose(fused, default, atol=1e-5))
  True
  >>> causal = functools.partial(nn.fused_dot_product_attention,
  ...                            is_causal=True)
  >>> layer = nn.MultiHeadDotProductAttention(num_heads=4,
  ...                                         attention_fn=causal)
  >>> x = jnp.ones((2, 5, 16))
  >>> layer.apply(layer.init(jax.random.key(1), x), x).shape
  (2, 5, 16)
  """
  q_shape, k_shape, v_shape = (tuple(jnp.shape(x))
                                for x in (query, key, value))
  problem = _shape_error(q_shape, k_shape, v_shape)
  if problem:
    raise FusedAttentionError(f'fused_dot_product_attention: {problem}.')
  window = _window_pair(local_window_size)
  q_len, kv_len = q_shape[-3], k_shape[-3]
  if (is_causal or window is not None) and q_len != kv_len:
    raise FusedAttentionError(
        'fused_dot_product_attention: is_causal and local_window_size align '
        'query i with key i, so they need q_length == kv_length, got '
        f'{q_len} and {kv_len}. For other alignments (e.g. one decoding '
        'step against a cache) pass an explicit mask instead.')
  reasons = _fallback_reasons(dropout_rate, deterministic, precision, module,
                              einsum_dot_general, qk_attn_weights_einsum,
                              attn_weights_value_einsum, q_shape[-1],
                              v_shape[-1])
  if reasons:
    what = '; '.join(reasons)
    if not fallback:
      raise FusedAttentionError(
          f'fused_dot_product_attention cannot fuse this call: {what} '
          '(fallback=False).')
    warnings.warn(FusedAttentionWarning(
        'fused_dot_product_attention runs liftmods.dot_product_attention '
        f'instead of jax.nn.dot_product_attention: {what}.'), stacklevel=2)
    groups = q_shape[-2] // k_shape[-2]
    if groups > 1:
      key = jnp.repeat(key, groups, axis=-2)
      value = jnp.repeat(value, groups, axis=-2)
    return dot_product_attention(
        query, key, value, bias,
        _and_masks(mask, _position_mask(q_len, is_causal, window)),
        broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype,
        precision, module, force_fp32_for_softmax, einsum_dot_general,
        qk_attn_weights_einsum, attn_weights_value_einsum)

  query, key, value = promote_dtype(query, key, value, dtype=dtype)
  dtype = query.dtype
  options = _options_of(jax.nn.dot_product_attention)
  kwargs = {}
  if implementation is not None:
    if 'implementation' not in options:
      raise FusedAttentionError(
          'fused_dot_product_attention: this JAX '
          f'({jax.__version__}) has no implementation= option on '
          f'jax.nn.dot_product_attention; got {implementation!r}.')
    kwargs['implementation'] = implementation
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      mask = mask != 0
  # Causal and window masks go to JAX as options where it has them (cuDNN
  # then skips the masked blocks), else into the mask.
  if (is_causal and 'is_causal' not in options) or (
      window is not None and 'local_window_size' not in options):
    mask = _and_masks(mask, _position_mask(q_len, is_causal, window))
  else:
    if is_causal:
      kwargs['is_causal'] = True
    if window is not None:
      kwargs['local_window_size'] = window
  *batch, _, heads, depth = query.shape
  batch = tuple(batch)
  flat = math.prod(batch)
  full_lengths = implementation == 'cudnn'  # cuDNN takes no length broadcast
  mask = _as_4d(mask, 'mask', batch, heads, q_len, kv_len, full_lengths)
  bias = _as_4d(bias, 'bias', batch, heads, q_len, kv_len, full_lengths)
  if bias is not None and implementation == 'cudnn':
    bias = bias.astype(dtype)
  out = explicit.as_first(
      'fused_dot_product_attention', 'attention',
      functools.partial(jax.nn.dot_product_attention, **kwargs),
      query.reshape((flat, q_len, heads, depth)),
      key.reshape((flat,) + key.shape[-3:]),
      value.reshape((flat,) + value.shape[-3:]), bias, mask)
  out = out.reshape(batch + (q_len, heads, value.shape[-1]))
  if force_fp32_for_softmax and dtype != jnp.float32:
    out = out.astype(jnp.float32)
  return out
