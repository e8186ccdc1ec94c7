"""Activation functions that own parameters, hence are modules.

>>> import jax, jax.numpy as jnp
>>> from liftmods.layers.activation_modules import PReLU
>>> x = jnp.array([-2.0, 3.0])
>>> variables = PReLU().init(jax.random.key(0), x)
>>> PReLU().apply(variables, x)
Array([-0.02,  3.  ], dtype=float32)
"""
from typing import Any

import jax.numpy as jnp

from liftmods.module import Module, compact

__all__ = ['PReLU']

Array = Any
Dtype = Any


def _constant(rng, value, dtype) -> Array:
  """Initializer of a scalar parameter that ignores its key."""
  del rng
  return jnp.asarray(value, dtype)


class PReLU(Module):
  """Leaky ReLU whose negative slope is the learned scalar parameter
  ``negative_slope``: ``x if x >= 0 else negative_slope * x``.

  Attributes:
    param_dtype: dtype of ``negative_slope``.
    negative_slope_init: its initial value.

  >>> import jax, jax.numpy as jnp
  >>> layer = PReLU(negative_slope_init=0.5)
  >>> v = layer.init(jax.random.key(0), jnp.ones(2))
  >>> v['params']['negative_slope']
  Array(0.5, dtype=float32)
  >>> layer.apply(v, jnp.array([-4.0]))
  Array([-2.], dtype=float32)
  """

  param_dtype: Dtype = jnp.float32
  negative_slope_init: float = 0.01

  @compact
  def __call__(self, inputs: Array) -> Array:
    """Applies the activation elementwise; output dtype is the input's."""
    slope = self.param('negative_slope', _constant, self.negative_slope_init,
                       self.param_dtype)
    return jnp.where(inputs >= 0, inputs,
                     jnp.asarray(slope, inputs.dtype) * inputs)
