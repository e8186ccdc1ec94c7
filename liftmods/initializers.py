"""Parameter initializers, the ``nn.initializers`` namespace.

Every initializer is the very object exported by ``jax.nn.initializers``;
re-exporting instead of re-implementing is what makes parameter values equal
to Linen's bit for bit for the same PRNG key.

>>> import jax, jax.numpy as jnp
>>> from liftmods import initializers
>>> initializers.ones_init()(jax.random.key(0), (2,), jnp.float32)
Array([1., 1.], dtype=float32)
>>> initializers.lecun_normal()(jax.random.key(0), (3, 4)).shape
(3, 4)
"""
from collections.abc import Callable as _Callable
from typing import Any as _Any, Union as _Union

import jax as _jax
from jax.nn.initializers import constant as constant
from jax.nn.initializers import delta_orthogonal as delta_orthogonal
from jax.nn.initializers import glorot_normal as glorot_normal
from jax.nn.initializers import glorot_uniform as glorot_uniform
from jax.nn.initializers import he_normal as he_normal
from jax.nn.initializers import he_uniform as he_uniform
from jax.nn.initializers import kaiming_normal as kaiming_normal
from jax.nn.initializers import kaiming_uniform as kaiming_uniform
from jax.nn.initializers import lecun_normal as lecun_normal
from jax.nn.initializers import lecun_uniform as lecun_uniform
from jax.nn.initializers import normal as normal
from jax.nn.initializers import ones as ones
from jax.nn.initializers import orthogonal as orthogonal
from jax.nn.initializers import truncated_normal as truncated_normal
from jax.nn.initializers import uniform as uniform
from jax.nn.initializers import variance_scaling as variance_scaling
from jax.nn.initializers import xavier_normal as xavier_normal
from jax.nn.initializers import xavier_uniform as xavier_uniform
from jax.nn.initializers import zeros as zeros

# Anything callable as ``init(key, shape, dtype)`` counts as an initializer.
Initializer = _Union[_jax.nn.initializers.Initializer, _Callable[..., _Any]]


def zeros_init() -> Initializer:
  """Return the initializer that fills an array with zeros.

  >>> import jax, jax.numpy as jnp
  >>> zeros_init()(jax.random.key(1), (1, 2), jnp.float32)
  Array([[0., 0.]], dtype=float32)
  """
  return zeros


def ones_init() -> Initializer:
  """Return the initializer that fills an array with ones.

  >>> import jax, jax.numpy as jnp
  >>> ones_init()(jax.random.key(1), (2, 1), jnp.int32)
  Array([[1],
         [1]], dtype=int32)
  """
  return ones
