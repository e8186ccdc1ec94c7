"""Functional dropout (``flax.core.nn.dropout``).

>>> import jax, jax.numpy as jnp
>>> from liftmods import core
>>> from liftmods.core.nn.stochastic import dropout
>>> y, _ = core.init(dropout)({'params': jax.random.key(0),
...                            'dropout': jax.random.key(1)},
...                           jnp.ones(4), 0.5)
>>> sorted(set(y.tolist())) in ([0.0, 2.0], [2.0], [0.0])
True
"""
import jax.numpy as jnp
from jax import lax, random

__all__ = ['dropout']


def dropout(scope, inputs, rate, deterministic=False, rng=None):
  """Zeroes each element with probability ``rate`` and scales the rest by
  ``1 / (1 - rate)``; the mask comes from ``rng`` or the ``dropout``
  sequence."""
  if rate == 0.0 or deterministic:
    return inputs
  keep = 1.0 - rate
  if rng is None:
    rng = scope.make_rng('dropout')
  mask = random.bernoulli(rng, p=keep, shape=inputs.shape)
  return lax.select(mask, inputs / keep, jnp.zeros_like(inputs))
