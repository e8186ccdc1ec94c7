"""FP8 training ops: delayed-scaling quantization of matmul operands.

A matmul ``x @ k`` in fp8 training quantizes ``x`` and ``k`` to
``float8_e4m3fn`` and the output gradient to ``float8_e5m2``. Each of the
three has a *scale* and an *amax history* (the last ``amax_history_length``
absolute maxima). Before quantizing, the scale is recomputed from the largest
amax in the history (``compute_scale``) and the history is rolled with the
current amax (``compute_amax_history``).

The new scales and histories leave the computation through the *gradient*:
the backward pass returns them as the "gradients" of the scale and history
variables, which live in the ``_overwrite_with_gradient`` collection. An
optimizer is expected to overwrite those variables with their gradient
instead of applying it. The numbers here are Linen's (``flax.linen.fp8_ops``).

>>> import jax, jax.numpy as jnp
>>> from liftmods.fp8_ops import Fp8DotGeneral, OVERWRITE_WITH_GRADIENT
>>> op = Fp8DotGeneral(amax_history_length=4)
>>> x, k = jnp.ones((2, 3)), jnp.ones((3, 2))
>>> dims = (((1,), (0,)), ((), ()))
>>> variables = op.init(jax.random.key(0), x, k, dims)
>>> sorted(variables[OVERWRITE_WITH_GRADIENT])  # doctest: +NORMALIZE_WHITESPACE
['input_amax_history', 'input_scale', 'kernel_amax_history', 'kernel_scale',
 'output_grad_amax_history', 'output_grad_scale']
>>> op.apply(variables, x, k, dims)
Array([[3., 3.],
       [3., 3.]], dtype=float32)
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from functools import partial
from typing import Any

import jax
import numpy as np
from jax import custom_jvp, custom_vjp, lax, random
from jax import numpy as jnp

from liftmods import initializers
from liftmods import jax_private
from liftmods.jax_private import CAN_USE_EARRAY
from liftmods.module import Module, nowrap

DType = Any

OVERWRITE_WITH_GRADIENT = '_overwrite_with_gradient'

_FP8_TYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
              jnp.float8_e5m2fnuz)


# -- the fp8 meta dtype: a float whose gradients accumulate by max --------------


def _supports_inf(dtype) -> bool:
  """Whether ``dtype`` has an infinity (``float8_e4m3fn`` has none: an
  infinity cast to it becomes NaN)."""
  return bool(np.isinf(np.asarray(np.inf).astype(dtype)))


class Fp8MetaTyRules:
  """Rules of the ``fp8_meta`` extended dtype: stored as its float dtype,
  but *adding* two values (as gradient accumulation does, e.g. across
  microbatches or a scan) takes their maximum."""

  @staticmethod
  def physical_element_aval(dtype) -> jax.core.ShapedArray:
    return jax.core.ShapedArray((), dtype.float_dtype)

  @staticmethod
  def convert_from(fp8_meta_dtype, other_dtype) -> bool:
    return fp8_meta_dtype.float_dtype == other_dtype

  @staticmethod
  def convert_to(other_dtype, fp8_meta_dtype) -> bool:
    return fp8_meta_dtype.float_dtype == other_dtype

  @staticmethod
  def add(dt, x, y):
    as_float = lambda v: lax.convert_element_type(v, dt.float_dtype)
    return lax.convert_element_type(lax.max(as_float(x), as_float(y)), dt)

  @staticmethod
  def zero(dt):
    float_dtype = dt.float_dtype
    lowest = (-np.inf if _supports_inf(float_dtype)
              else jnp.finfo(float_dtype).min)
    return lax.convert_element_type(np.array(lowest, float_dtype), dt)

  @staticmethod
  def tangent_dtype(dtype):
    return dtype

  @staticmethod
  def full(shape, fill_value, dtype):
    value = lax.convert_element_type(fill_value, dtype.float_dtype)
    return lax.convert_element_type(
        lax.full(shape, value, dtype.float_dtype), dtype)

  @staticmethod
  def global_sharded_result_handler(aval, out_sharding, committed):
    return jax_private.extended_result_handler(aval, out_sharding, committed)


class fp8_meta_dtype(jax.dtypes.extended):  # pylint: disable=invalid-name
  """Scalar type of the ``fp8_meta`` dtypes."""


@dataclasses.dataclass(frozen=True)
class fp8_meta_dtype_wrapper(jax_private.ExtendedDType):  # pylint: disable=invalid-name
  """An ``fp8_meta`` dtype over ``float_dtype`` (see ``Fp8MetaTyRules``).

  Attributes:
    float_dtype: the float dtype the values are stored in.
  """

  float_dtype: Any
  _rules: type = Fp8MetaTyRules
  type: type = fp8_meta_dtype

  def __repr__(self) -> str:
    return f'fp8_meta{jnp.finfo(self.float_dtype).bits}'

  name = property(__repr__)


fm32 = fp8_meta_dtype_wrapper(jnp.float32)
fp32_max_grad = fp8_meta_dtype_wrapper(jnp.float32)


def _fm32_to_float32(value):
  """Plain float32 view of a value that may be of the ``fm32`` dtype."""
  if value.dtype == fm32:
    return lax.convert_element_type(value, jnp.float32)
  return value


# -- quantization and scaling ----------------------------------------------------


def get_fp8_max(fp8_dtype: DType, out_dtype: DType) -> jax.Array:
  """Largest finite value of ``fp8_dtype``, as ``out_dtype``.

  Args:
    fp8_dtype: one of the fp8 types.
    out_dtype: the dtype of the result.

  Returns:
    The value, a scalar.

  >>> float(get_fp8_max(jnp.float8_e4m3fn, jnp.float32))
  448.0
  """
  assert fp8_dtype in _FP8_TYPES, fp8_dtype
  return jnp.finfo(fp8_dtype).max.astype(out_dtype)


def quantize(x: jax.Array, q_dtype: DType, scale: jax.Array,
             compute_dtype: DType) -> jax.Array:
  """``x / scale`` clipped to the range of ``q_dtype`` and cast to it.

  Args:
    x: the values.
    q_dtype: the fp8 type.
    scale: the scale, broadcast to ``x``.
    compute_dtype: the dtype the division and clipping run in.

  Returns:
    The quantized values.
  """
  bound = get_fp8_max(q_dtype, compute_dtype)
  scaled = x / jnp.broadcast_to(scale.astype(compute_dtype), x.shape)
  return jnp.clip(scaled, -bound, bound).astype(q_dtype)


def dequantize(x: jax.Array, dq_dtype: DType, scale: jax.Array) -> jax.Array:
  """``x`` cast to ``dq_dtype`` and multiplied by ``scale``.

  Args:
    x: quantized values.
    dq_dtype: the dtype of the result.
    scale: the scale, broadcast to ``x``.

  Returns:
    The dequantized values.
  """
  return x.astype(dq_dtype) * jnp.broadcast_to(scale.astype(dq_dtype),
                                               x.shape)


def qdq(x: jax.Array, q_dtype: DType, scale: jax.Array,
        compute_dtype: DType) -> jax.Array:
  """Quantizes ``x`` and dequantizes it back to ``x.dtype``.

  Args:
    x: the values.
    q_dtype: the fp8 type.
    scale: the scale.
    compute_dtype: the dtype quantization runs in.

  Returns:
    ``x`` rounded through ``q_dtype``.

  >>> qdq(jnp.array([1.0, 0.3]), jnp.float8_e4m3fn, jnp.ones(1), jnp.float32)
  Array([1.    , 0.3125], dtype=float32)
  """
  return dequantize(quantize(x, q_dtype, scale, compute_dtype), x.dtype,
                    scale)


def compute_scale(amax: jax.Array, scale: jax.Array, fp8_max: jax.Array,
                  margin: int = 0) -> jax.Array:
  """The scale that maps ``amax`` to ``fp8_max / 2**margin``.

  Args:
    amax: the largest absolute value seen.
    scale: the current scale, kept when ``amax`` is zero or not finite.
    fp8_max: the largest value of the fp8 type.
    margin: powers of two of headroom.

  Returns:
    The new scale.
  """
  inverse = 1.0 / scale
  factor = (fp8_max / amax) / (2**margin)
  factor = jnp.where(amax > 0.0, factor, inverse)
  factor = jnp.where(jnp.isfinite(amax), factor, inverse)
  return 1.0 / factor


def compute_amax_history(x: jax.Array, amax_history: jax.Array) -> jax.Array:
  """``amax_history`` rolled by one with ``max |x|`` written at index 0.

  Args:
    x: the new values.
    amax_history: the past absolute maxima.

  Returns:
    The new history.
  """
  amax = jnp.max(jnp.abs(x)).astype(amax_history.dtype)
  return jnp.roll(amax_history, shift=-1, axis=0).at[0].set(amax)


def update_fp8_meta(x: jax.Array, q_dtype: DType, scale: jax.Array,
                    amax_history: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The scale and history for quantizing ``x``.

  The scale comes from the history *before* ``x`` is recorded in it.

  Args:
    x: the values to quantize.
    q_dtype: the fp8 type.
    scale: the current scale.
    amax_history: the past absolute maxima.

  Returns:
    ``(new_scale, new_amax_history)``.
  """
  meta = scale.dtype == fm32 and amax_history.dtype == fm32
  if meta:
    amax_history = lax.convert_element_type(amax_history, jnp.float32)
    scale = lax.convert_element_type(scale, jnp.float32)
  new_scale = compute_scale(jnp.max(amax_history, axis=0), scale,
                            get_fp8_max(q_dtype, jnp.float32))
  new_history = compute_amax_history(x, amax_history)
  if meta:
    new_history = lax.convert_element_type(new_history, fp32_max_grad)
    new_scale = lax.convert_element_type(new_scale, fp32_max_grad)
  return new_scale, new_history


def quantize_dequantize_update(
    x: jax.Array, q_dtype: DType, scale: jax.Array, amax_history: jax.Array,
    compute_dtype: DType) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``qdq`` of ``x`` with the updated scale.

  Args:
    x: the values.
    q_dtype: the fp8 type.
    scale: the current scale.
    amax_history: the past absolute maxima.
    compute_dtype: the dtype quantization runs in.

  Returns:
    ``(qdq_x, new_scale, new_amax_history)``.
  """
  new_scale, new_history = update_fp8_meta(x, q_dtype, scale, amax_history)
  quantized = qdq(x, q_dtype, _fm32_to_float32(new_scale), compute_dtype)
  return quantized, new_scale, new_history


# -- transposes of dot_general ---------------------------------------------------


def _without(axes, *removed):
  gone = set(itertools.chain(*removed))
  return [a for a in axes if a not in gone]


def _consecutive_ranges(*groups):
  start = 0
  for group in groups:
    yield range(start, start + len(group))
    start += len(group)


def dot_general_transpose_lhs(g: jax.Array, x: jax.Array, y: jax.Array, *,
                              dimension_numbers: Any, precision: Any,
                              preferred_element_type: DType | None,
                              swap_ans: bool = False) -> jax.Array:
  """The cotangent of ``x`` in ``dot_general(x, y, dimension_numbers)``.

  Args:
    g: the output cotangent.
    x: the left operand (only its shape is used).
    y: the right operand.
    dimension_numbers: those of the forward ``dot_general``.
    precision: the precision of the product.
    preferred_element_type: the result dtype of the product.
    swap_ans: ``g`` has ``y``'s free axes before ``x``'s.

  Returns:
    The cotangent, shaped like ``x``.
  """
  (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
  x_kept = _without(range(x.aval.ndim), x_contract, x_batch)
  y_kept = _without(range(np.ndim(y)), y_contract, y_batch)
  if swap_ans:
    g_batch, g_y, _ = _consecutive_ranges(x_batch, y_kept, x_kept)
  else:
    g_batch, _, g_y = _consecutive_ranges(x_batch, x_kept, y_kept)
  dims = ((g_y, y_kept), (g_batch, y_batch))
  x_contract_in_y_order = list(np.take(x_contract, np.argsort(y_contract)))
  perm = np.argsort(list(x_batch) + x_kept + x_contract_in_y_order)
  product = lax.dot_general(g, y, dims, precision=precision,
                            preferred_element_type=preferred_element_type)
  return lax.transpose(product, tuple(perm))


def dot_general_transpose_rhs(g: jax.Array, x: jax.Array, y: jax.Array, *,
                              dimension_numbers: Any, precision: Any,
                              preferred_element_type: DType | None
                              ) -> jax.Array:
  """The cotangent of ``y`` in ``dot_general(x, y, dimension_numbers)``.

  Args:
    g: the output cotangent.
    x: the left operand.
    y: the right operand (only its shape is used).
    dimension_numbers: those of the forward ``dot_general``.
    precision: the precision of the product.
    preferred_element_type: the result dtype of the product.

  Returns:
    The cotangent, shaped like ``y``.
  """
  (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
  swapped = ((y_contract, x_contract), (y_batch, x_batch))
  return dot_general_transpose_lhs(
      g, y, x, dimension_numbers=swapped, precision=precision,
      preferred_element_type=preferred_element_type, swap_ans=True)


# -- custom-gradient pieces ------------------------------------------------------


@partial(custom_vjp, nondiff_argnums=(0, 1))
def in_qdq(compute_dtype: DType, q_dtype: DType, inp: jax.Array,
           scale: jax.Array, amax_history: jax.Array) -> jax.Array:
  """qdq of an operand, with the meta update carried by its gradient.

  The backward passes the gradient through and returns the updated scale
  and history as their gradients.

  Args:
    compute_dtype: the dtype quantization runs in.
    q_dtype: the fp8 type.
    inp: the operand.
    scale: its scale.
    amax_history: its history of absolute maxima.

  Returns:
    The operand rounded through ``q_dtype``.
  """
  return quantize_dequantize_update(inp, q_dtype, scale, amax_history,
                                    compute_dtype)[0]


def in_qdq_fwd(compute_dtype: DType, q_dtype: DType, inp: jax.Array,
               scale: jax.Array, amax_history: jax.Array
               ) -> tuple[jax.Array, tuple]:
  """Forward rule of :func:`in_qdq`; residuals: the new scale and history."""
  quantized, new_scale, new_history = quantize_dequantize_update(
      inp, q_dtype, scale, amax_history, compute_dtype)
  return quantized, (new_scale, new_history)


def in_qdq_bwd(compute_dtype: DType, q_dtype: DType, res: tuple,
               g: jax.Array) -> tuple:
  """Backward rule of :func:`in_qdq`: ``(g, new_scale, new_history)``."""
  del compute_dtype, q_dtype
  new_scale, new_history = res
  return g, new_scale, new_history


in_qdq.defvjp(in_qdq_fwd, in_qdq_bwd)


@partial(custom_vjp, nondiff_argnums=(0, 1))
def out_qdq(compute_dtype: DType, q_dtype: DType, out: jax.Array,
            scale: jax.Array, amax_history: jax.Array) -> jax.Array:
  """Identity on the output; its backward qdq's the output gradient.

  The backward also returns the updated scale and history as their
  gradients.

  Args:
    compute_dtype: the dtype quantization runs in.
    q_dtype: the fp8 type of the gradient.
    out: the output.
    scale: the gradient's scale.
    amax_history: the gradient's history of absolute maxima.

  Returns:
    ``out``.
  """
  del compute_dtype, q_dtype, scale, amax_history
  return out


def out_qdq_fwd(compute_dtype: DType, q_dtype: DType, out: jax.Array,
                scale: jax.Array, amax_history: jax.Array
                ) -> tuple[jax.Array, tuple]:
  """Forward rule of :func:`out_qdq`: ``(out, (scale, amax_history))``."""
  del compute_dtype, q_dtype
  return out, (scale, amax_history)


def out_qdq_bwd(compute_dtype: DType, q_dtype: DType, res: tuple,
                g: jax.Array) -> tuple:
  """Backward rule of :func:`out_qdq`: ``(qdq_g, new_scale, new_history)``."""
  scale, amax_history = res
  return quantize_dequantize_update(g, q_dtype, scale, amax_history,
                                    compute_dtype)


out_qdq.defvjp(out_qdq_fwd, out_qdq_bwd)


@partial(custom_vjp, nondiff_argnums=(0, 1))
def in_q(compute_dtype: DType, q_dtype: DType, inp: jax.Array,
         scale: jax.Array, amax_history: jax.Array
         ) -> tuple[jax.Array, jax.Array]:
  """Quantizes an operand with its updated scale.

  The backward returns the new scale and history as their gradients.

  Args:
    compute_dtype: the dtype quantization runs in.
    q_dtype: the fp8 type.
    inp: the operand.
    scale: its scale.
    amax_history: its history of absolute maxima.

  Returns:
    ``(q_inp, new_scale)``.
  """
  return in_q_fwd(compute_dtype, q_dtype, inp, scale, amax_history)[0]


def in_q_fwd(compute_dtype: DType, q_dtype: DType, inp: jax.Array,
             scale: jax.Array, amax_history: jax.Array) -> tuple:
  """Forward rule of :func:`in_q`; residuals: the new scale and history."""
  new_scale, new_history = update_fp8_meta(inp, q_dtype, scale,
                                           amax_history)
  quantized = quantize(inp, q_dtype, _fm32_to_float32(new_scale),
                       compute_dtype)
  return (quantized, new_scale), (new_scale, new_history)


def in_q_bwd(compute_dtype: DType, q_dtype: DType, res: tuple,
             _: Any) -> tuple:
  """Backward rule of :func:`in_q`: ``(None, new_scale, new_history)``."""
  del compute_dtype, q_dtype
  new_scale, new_history = res
  return None, new_scale, new_history


in_q.defvjp(in_q_fwd, in_q_bwd)


@partial(custom_vjp, nondiff_argnums=(0,))
def out_dq(dq_type: DType, lhs_scale: jax.Array, rhs_scale: jax.Array,
           out: jax.Array) -> jax.Array:
  """Dequantizes a product of two quantized operands.

  Args:
    dq_type: the dtype of the result.
    lhs_scale: the left operand's scale.
    rhs_scale: the right operand's scale.
    out: the quantized product.

  Returns:
    ``out`` times both scales.
  """
  scale = _fm32_to_float32(lhs_scale) * _fm32_to_float32(rhs_scale)
  return dequantize(out, dq_type, scale)


def out_dq_fwd(dq_type: DType, lhs_scale: jax.Array, rhs_scale: jax.Array,
               out: jax.Array) -> tuple[jax.Array, None]:
  """Forward rule of :func:`out_dq`: ``(dequantized, None)``."""
  return out_dq(dq_type, lhs_scale, rhs_scale, out), None


def out_dq_bwd(dq_type: DType, _: Any, g: jax.Array) -> tuple:
  """Backward rule of :func:`out_dq`: ``(None, None, g)``, all to ``out``."""
  del dq_type
  return None, None, g


out_dq.defvjp(out_dq_fwd, out_dq_bwd)


@partial(custom_vjp, nondiff_argnums=(8, 9))
def quantized_dot(lhs: jax.Array, q_lhs: jax.Array, lhs_scale: jax.Array,
                  rhs: jax.Array, q_rhs: jax.Array, rhs_scale: jax.Array,
                  out_grad_scale: jax.Array,
                  out_grad_amax_history: jax.Array, dimension_numbers: Any,
                  preferred_element_type: DType | None = None) -> jax.Array:
  """``dot_general`` of the quantized operands.

  Its backward quantizes the output gradient to e5m2 and returns the
  gradient's new scale and history as their gradients.

  Args:
    lhs: the left operand (for the backward pass).
    q_lhs: the quantized left operand.
    lhs_scale: its scale.
    rhs: the right operand (for the backward pass).
    q_rhs: the quantized right operand.
    rhs_scale: its scale.
    out_grad_scale: the output gradient's scale.
    out_grad_amax_history: the output gradient's history.
    dimension_numbers: as for ``lax.dot_general``.
    preferred_element_type: the result dtype.

  Returns:
    The (still scaled) product.
  """
  return quantized_dot_fwd(lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale,
                           out_grad_scale, out_grad_amax_history,
                           dimension_numbers, preferred_element_type)[0]


def quantized_dot_fwd(lhs: jax.Array, q_lhs: jax.Array,
                      lhs_scale: jax.Array, rhs: jax.Array,
                      q_rhs: jax.Array, rhs_scale: jax.Array,
                      out_grad_scale: jax.Array,
                      out_grad_amax_history: jax.Array,
                      dimension_numbers: Any,
                      preferred_element_type: DType | None) -> tuple:
  """Forward rule of :func:`quantized_dot`: ``(product, residuals)``."""
  out = lax.dot_general(q_lhs, q_rhs, dimension_numbers,
                        preferred_element_type=preferred_element_type,
                        precision=lax.Precision.DEFAULT)
  res = (lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale, out_grad_scale,
         out_grad_amax_history)
  return out, res


def quantized_dot_bwd(dimension_numbers: Any,
                      preferred_element_type: DType | None, res: tuple,
                      g: jax.Array) -> tuple:
  """Backward rule of :func:`quantized_dot`, through an e5m2 gradient."""
  (lhs, q_lhs, lhs_scale, rhs, q_rhs, rhs_scale, out_grad_scale,
   out_grad_amax_history) = res
  new_scale, new_history = update_fp8_meta(
      g, jnp.float8_e5m2, out_grad_scale, out_grad_amax_history)
  g_scale = _fm32_to_float32(new_scale)
  q_g = quantize(g, jnp.float8_e5m2, g_scale, preferred_element_type)
  common = dict(dimension_numbers=dimension_numbers,
                precision=lax.Precision.HIGHEST,
                preferred_element_type=preferred_element_type)
  grad_lhs = dequantize(
      dot_general_transpose_lhs(q_g, lhs, q_rhs, **common),
      preferred_element_type, _fm32_to_float32(rhs_scale) * g_scale)
  grad_rhs = dequantize(
      dot_general_transpose_rhs(q_g, q_lhs, rhs, **common),
      preferred_element_type, _fm32_to_float32(lhs_scale) * g_scale)
  return (grad_lhs, None, None, grad_rhs, None, None, new_scale, new_history)


quantized_dot.defvjp(quantized_dot_fwd, quantized_dot_bwd)


def fp8_scaled_dot_general(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
    precision: Any = None, preferred_element_type: DType | None = None, *,
    lhs_scale: jax.Array | None = None, rhs_scale: jax.Array | None = None,
    grad_scale: jax.Array | None = None,
    lhs_amax_history: jax.Array | None = None,
    rhs_amax_history: jax.Array | None = None,
    grad_amax_history: jax.Array | None = None,
    quantize_compute_type: DType = jnp.float32) -> jax.Array:
  """``dot_general`` done in fp8.

  Both operands are quantized to e4m3 with their updated scales and the
  product dequantized; in the backward pass the output gradient is
  quantized to e5m2.

  Args:
    lhs: the left operand.
    rhs: the right operand.
    dimension_numbers: as for ``lax.dot_general``.
    precision: ignored, with a warning.
    preferred_element_type: the result dtype.
    lhs_scale: the left operand's scale.
    rhs_scale: the right operand's scale.
    grad_scale: the output gradient's scale.
    lhs_amax_history: the left operand's history of absolute maxima.
    rhs_amax_history: the right operand's history.
    grad_amax_history: the output gradient's history.
    quantize_compute_type: the dtype quantization runs in.

  Returns:
    The product.
  """
  if precision is not None:
    warnings.warn('The function fp8_scaled_dot_general will set the '
                  '"precision" and disregard any provided "precision" '
                  'argument.')
  q_lhs, new_lhs_scale = in_q(quantize_compute_type, jnp.float8_e4m3fn, lhs,
                              lhs_scale, lhs_amax_history)
  q_rhs, new_rhs_scale = in_q(quantize_compute_type, jnp.float8_e4m3fn, rhs,
                              rhs_scale, rhs_amax_history)
  y = quantized_dot(lhs, q_lhs, new_lhs_scale, rhs, q_rhs, new_rhs_scale,
                    grad_scale, grad_amax_history, dimension_numbers,
                    preferred_element_type)
  return out_dq(preferred_element_type, new_lhs_scale, new_rhs_scale, y)


@partial(custom_jvp, nondiff_argnums=(2, 3, 4))
def dot_general_with_precision(lhs: jax.Array, rhs: jax.Array,
                               dimension_numbers: Any, precision: Any = None,
                               preferred_element_type: DType | None = None
                               ) -> jax.Array:
  """``dot_general`` at DEFAULT precision whose derivatives run at HIGHEST.

  Args:
    lhs: the left operand.
    rhs: the right operand.
    dimension_numbers: as for ``lax.dot_general``.
    precision: ignored, with a warning.
    preferred_element_type: ignored, with a warning.

  Returns:
    The product.
  """
  if precision is not None or preferred_element_type is not None:
    warnings.warn('The function dot_general_with_precision will set the '
                  'precision/preferred_element_type and disregard any '
                  'provided values.')
  return lax.dot_general(lhs, rhs, dimension_numbers,
                         precision=lax.Precision.DEFAULT)


@dot_general_with_precision.defjvp
def dot_general_with_precision_jvp(dimension_numbers: Any, precision: Any,
                                   preferred_element_type: DType | None,
                                   primals: tuple, tangents: tuple) -> tuple:
  """JVP rule of :func:`dot_general_with_precision` (HIGHEST precision).

  Args:
    dimension_numbers: as for ``lax.dot_general``.
    precision: ignored.
    preferred_element_type: ignored.
    primals: ``(lhs, rhs)``.
    tangents: their tangents.

  Returns:
    ``(product, product_tangent)``.
  """
  del precision, preferred_element_type
  lhs, rhs = primals
  lhs_dot, rhs_dot = tangents
  out = lax.dot_general(lhs, rhs, dimension_numbers,
                        precision=lax.Precision.DEFAULT)
  high = partial(lax.dot_general, dimension_numbers=dimension_numbers,
                 precision=lax.Precision.HIGHEST)
  return out, high(lhs_dot, rhs) + high(lhs, rhs_dot)


# -- modules -----------------------------------------------------------------------


def _parse_dot_inputs(*args, **kwargs):
  """``(x, kernel, dimension_numbers, compute_dtype)`` of a dot_general
  call; ``x`` is cast to the kernel's dtype."""
  del kwargs
  assert len(args) == 3, 'expected (x, kernel, dimension_numbers)'
  x, kernel, dims = args
  return jnp.asarray(x, kernel.dtype), kernel, dims, kernel.dtype


class Fp8DotGeneralBase(Module):
  """Holds the six fp8 meta variables in ``_overwrite_with_gradient``:
  ``{input,kernel,output_grad}_amax_history`` (zeros of length
  ``amax_history_length``) and ``{input,kernel,output_grad}_scale`` (ones
  of shape ``(1,)``).

  Attributes:
    amax_history_length: number of past absolute maxima kept per operand to
      compute its scale.
    e4m3_dtype: the fp8 type of the forward operands (inputs and kernel).
    e5m2_dtype: the fp8 type of the output gradient.
  """

  amax_history_length: int = 1024
  e4m3_dtype: DType = jnp.float8_e4m3fn
  e5m2_dtype: DType = jnp.float8_e5m2

  def setup(self) -> None:
    key = random.PRNGKey(0)  # the initializers ignore it
    history = (initializers.zeros_init(), key, (self.amax_history_length,),
               jnp.float32)
    scale = (initializers.ones_init(), key, (1,), jnp.float32)
    col = OVERWRITE_WITH_GRADIENT
    self.input_amax_history = self.variable(col, 'input_amax_history',
                                            *history)
    self.kernel_amax_history = self.variable(col, 'kernel_amax_history',
                                             *history)
    self.output_grad_amax_history = self.variable(
        col, 'output_grad_amax_history', *history)
    self.input_scale = self.variable(col, 'input_scale', *scale)
    self.kernel_scale = self.variable(col, 'kernel_scale', *scale)
    self.output_grad_scale = self.variable(col, 'output_grad_scale', *scale)

  @nowrap
  def _meta_kwargs(self, compute_dtype):
    return dict(lhs_scale=self.input_scale.value,
                rhs_scale=self.kernel_scale.value,
                grad_scale=self.output_grad_scale.value,
                lhs_amax_history=self.input_amax_history.value,
                rhs_amax_history=self.kernel_amax_history.value,
                grad_amax_history=self.output_grad_amax_history.value,
                quantize_compute_type=compute_dtype)


class Fp8DotGeneralOp(Fp8DotGeneralBase):
  """Deprecated qdq formulation: the operands are quantized and
  dequantized, then multiplied at DEFAULT precision; use
  :class:`Fp8DirectDotGeneralOp` or :class:`Fp8Einsum`.

  Attributes:
    amax_history_length: number of past absolute maxima kept per operand to
      compute its scale.
    e4m3_dtype: the fp8 type of the forward operands (inputs and kernel).
    e5m2_dtype: the fp8 type of the output gradient.
  """

  def __post_init__(self):
    super().__post_init__()
    if type(self) is Fp8DotGeneralOp:
      warnings.warn('The Fp8DotGeneralOp is deprecated. Use '
                    'Fp8DirectDotGeneralOp or Fp8Einsum instead.',
                    DeprecationWarning)

  def __call__(self, *args, **kwargs):
    x, k, dims, compute_dtype = _parse_dot_inputs(*args, **kwargs)
    x = in_qdq(compute_dtype, self.e4m3_dtype, x, self.input_scale.value,
               self.input_amax_history.value)
    k = in_qdq(compute_dtype, self.e4m3_dtype, k, self.kernel_scale.value,
               self.kernel_amax_history.value)
    y = dot_general_with_precision(x, k, dims)
    return out_qdq(compute_dtype, self.e5m2_dtype, y,
                   self.output_grad_scale.value,
                   self.output_grad_amax_history.value)


class Fp8DirectDotGeneralOp(Fp8DotGeneralBase):
  """A ``dot_general`` replacement (``Dense(dot_general_cls=...)``) that
  multiplies in fp8 with :func:`fp8_scaled_dot_general`.

  Attributes:
    amax_history_length: number of past absolute maxima kept per operand to
      compute its scale.
    e4m3_dtype: the fp8 type of the forward operands (inputs and kernel).
    e5m2_dtype: the fp8 type of the output gradient.
  """

  def __call__(self, *args, **kwargs):
    x, k, dims, compute_dtype = _parse_dot_inputs(*args, **kwargs)
    return fp8_scaled_dot_general(x, k, dims, precision=None,
                                  preferred_element_type=x.dtype,
                                  **self._meta_kwargs(compute_dtype))


class NANOOFp8DotGeneralOp(Fp8DotGeneralOp):
  """:class:`Fp8DotGeneralOp` with the ``fnuz`` fp8 types.

  Attributes:
    amax_history_length: number of past absolute maxima kept per operand to
      compute its scale.
    e4m3_dtype: the fp8 type of the forward operands (inputs and kernel).
    e5m2_dtype: the fp8 type of the output gradient.
  """

  e4m3_dtype: DType = jnp.float8_e4m3fnuz
  e5m2_dtype: DType = jnp.float8_e5m2fnuz


class Fp8Einsum(Fp8DotGeneralBase):
  """An einsum replacement (``Einsum``/attention ``*_einsum_cls``) whose
  contraction runs in fp8; ``lhs`` is cast to ``rhs``'s dtype.

  Attributes:
    amax_history_length: number of past absolute maxima kept per operand to
      compute its scale.
    e4m3_dtype: the fp8 type of the forward operands (inputs and kernel).
    e5m2_dtype: the fp8 type of the output gradient.
  """

  def __call__(self, eqn, lhs: jax.Array, rhs: jax.Array, precision=None,
               preferred_element_type=None) -> jax.Array:
    compute_dtype = rhs.dtype
    dot = partial(fp8_scaled_dot_general, **self._meta_kwargs(compute_dtype))
    return jnp.einsum(eqn, lhs.astype(compute_dtype), rhs,
                      precision=precision,
                      preferred_element_type=preferred_element_type,
                      _dot_general=dot)


Fp8DotGeneral = Fp8DirectDotGeneralOp


# -- the other names of flax.linen.fp8_ops -------------------------------------
# Code written for Linen reaches these as attributes of flax.linen.fp8_ops.
# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
from jax.typing import DTypeLike

from liftmods import module
# pylint: enable=g-import-not-at-top,wrong-import-position,unused-import

_JAX_PRIVATE = ("a private JAX module, which Linen's fp8_ops imports for "
                'itself; liftmods reaches past JAX\'s public API only through '
                'liftmods.jax_private')

# Names of flax.linen.fp8_ops that mean nothing in liftmods, and why.
_LINEN_ONLY = {
    'core': f'jax._src.core, {_JAX_PRIVATE}',
    'dtypes': f'jax._src.dtypes, {_JAX_PRIVATE}',
    'earray': f'jax._src.earray, {_JAX_PRIVATE}',
    'pxla': f'jax._src.interpreters.pxla, {_JAX_PRIVATE}',
}


from liftmods import linen_names  # pylint: disable=g-import-not-at-top,wrong-import-position

__getattr__ = linen_names.not_provided(__name__, 'flax.linen.fp8_ops',
                                        _LINEN_ONLY)
