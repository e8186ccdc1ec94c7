"""Choosing and applying the computation dtype of a layer.

``canonicalize_dtype`` decides which dtype a set of arguments should share;
``promote_dtype`` casts them to it. An explicit ``dtype`` always wins over
inference, and with ``inexact=True`` the result must be a floating or complex
dtype (integer inputs are promoted to at least ``float32``).

>>> import jax.numpy as jnp
>>> from liftmods.dtypes import canonicalize_dtype, promote_dtype
>>> canonicalize_dtype(jnp.ones(2, jnp.int32), None)
dtype('float32')
>>> [x.dtype for x in promote_dtype(jnp.ones(1, jnp.bfloat16), 1.0)]
[dtype(bfloat16), dtype(bfloat16)]
"""
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp

Dtype = Union[jax.typing.DTypeLike, Any]
T = TypeVar('T', bound=tuple)  # flax.linen.dtypes.T


_INEXACT: dict = {}


def _is_inexact(dtype) -> bool:
  known = _INEXACT.get(dtype)
  if known is None:
    known = _INEXACT[dtype] = bool(jnp.issubdtype(dtype, jnp.inexact))
  return known


def _common_array_dtype(args):
  """The dtype shared by all non-None ``args`` when every one is a JAX array
  or tracer of that same dtype (the common case), else None."""
  dtype = None
  for x in args:
    if x is None:
      continue
    if not hasattr(x, 'aval'):
      return None
    if dtype is None:
      dtype = x.dtype
    elif x.dtype != dtype:
      return None
  return dtype


def _infer_dtype(args, inexact: bool) -> Dtype:
  """Result dtype of the non-None ``args``, widened to float when needed."""
  shared = _common_array_dtype(args)
  if shared is not None and (not inexact or _is_inexact(shared)):
    return shared
  present = [jnp.asarray(x) for x in args if x is not None]
  dtype = jnp.result_type(*present)
  if inexact and not jnp.issubdtype(dtype, jnp.inexact):
    dtype = jnp.promote_types(jnp.float32, dtype)
  return dtype


def canonicalize_dtype(
    *args: Any, dtype: Dtype | None = None, inexact: bool = True
) -> Dtype:
  """Return the dtype that ``args`` should be computed in.

  Args:
    *args: array-like values; ``None`` entries are skipped.
    dtype: explicit dtype; when given it is returned as is (after the
      ``inexact`` check) and nothing is inferred from ``args``.
    inexact: require a real or complex floating dtype. Inferred integer or
      boolean dtypes are promoted with ``float32``; an explicit non-inexact
      ``dtype`` raises ``ValueError``.

  Returns:
    The chosen dtype.

  Raises:
    ValueError: ``inexact`` and the dtype is not floating or complex.
  """
  if dtype is None:
    dtype = _infer_dtype(args, inexact)
  if inexact and not _is_inexact(dtype):
    raise ValueError(f'Dtype must be inexact: {dtype}')
  return dtype


def promote_dtype(*args: Any, dtype: Dtype | None = None,
                  inexact: bool = True) -> list[Any]:
  """Cast every argument to one common dtype.

  The dtype is picked by :func:`canonicalize_dtype` with the same arguments.

  Args:
    *args: array-like values; ``None`` entries are passed through unchanged.
    dtype: explicit target dtype, disabling inference.
    inexact: require the target dtype to be floating or complex.

  Returns:
    A list with each argument converted by ``jnp.asarray(x, dtype)``.
  """
  dtype = canonicalize_dtype(*args, dtype=dtype, inexact=inexact)
  return [x if _already(x, dtype) else jnp.asarray(x, dtype) for x in args]


def _already(x, dtype) -> bool:
  """None, or a strongly typed JAX array/tracer already of ``dtype`` (for
  which ``jnp.asarray`` would be the identity)."""
  if x is None:
    return True
  aval = getattr(x, 'aval', None)
  return aval is not None and x.dtype == dtype and not aval.weak_type
