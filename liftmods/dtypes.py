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
from typing import Any

import jax.numpy as jnp

Dtype = Any


def _infer_dtype(args, inexact: bool) -> Dtype:
  """Result dtype of the non-None ``args``, widened to float when needed."""
  present = [jnp.asarray(x) for x in args if x is not None]
  dtype = jnp.result_type(*present)
  if inexact and not jnp.issubdtype(dtype, jnp.inexact):
    dtype = jnp.promote_types(jnp.float32, dtype)
  return dtype


def canonicalize_dtype(
    *args, dtype: Dtype | None = None, inexact: bool = True
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
  """
  if dtype is None:
    dtype = _infer_dtype(args, inexact)
  if inexact and not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(f'Dtype must be inexact: {dtype}')
  return dtype


def promote_dtype(*args, dtype=None, inexact=True) -> list[Any]:
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
  return [None if x is None else jnp.asarray(x, dtype) for x in args]
