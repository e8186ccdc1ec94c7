"""Dropout.

The mask is drawn exactly as Linen draws it (``jax.random.bernoulli`` with
the keep probability, on the input shape with ``broadcast_dims`` set to 1), so
the same ``'dropout'`` key gives the same mask.

>>> import jax, jax.numpy as jnp
>>> from liftmods.layers.stochastic import Dropout
>>> x = jnp.ones((2, 4))
>>> Dropout(0.5, deterministic=True).apply({}, x) is x
True
>>> y = Dropout(0.5).apply({}, x, deterministic=False,
...                        rngs={'dropout': jax.random.key(0)})
>>> bool(((y == 0) | (y == 2)).all())  # dropped, or kept and doubled
True
"""
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax, random

from liftmods import errors
from liftmods.core import explicit
from liftmods.module import Module, compact, merge_param, nowrap

PRNGKey = Any


class Dropout(Module):
  """Zeroes each entry with probability ``rate`` and scales the rest by
  ``1 / (1 - rate)``; the identity when ``deterministic``.

  ``deterministic`` is given to the constructor or at call time, exactly
  once. The key comes from ``rng`` or else from the ``rng_collection``
  sequence (pass ``rngs={'dropout': key}`` to ``apply``). Entries along
  ``broadcast_dims`` share one mask value.

  Attributes:
    rate: the probability of zeroing an entry.
    broadcast_dims: axes along which entries share one mask value.
    deterministic: return the inputs unchanged; given here or at call time,
      exactly once.
    rng_collection: the rng sequence the mask key comes from.

  >>> import jax, jax.numpy as jnp
  >>> drop = Dropout(rate=0.5, broadcast_dims=(0,))
  >>> y = drop.apply({}, jnp.ones((3, 4)), deterministic=False,
  ...                rngs={'dropout': jax.random.key(1)})
  >>> bool((y == y[0]).all())  # rows share the mask
  True
  """

  rate: float
  broadcast_dims: Sequence[int] = ()
  deterministic: bool | None = None
  rng_collection: str = 'dropout'

  @compact
  def __call__(self, inputs, deterministic: bool | None = None,
               rng: PRNGKey | None = None):
    """Returns ``inputs`` with a random mask applied, or unchanged."""
    deterministic = self._deterministic(deterministic)
    if self.rate == 0.0 or deterministic:
      return inputs
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    keep_prob = 1.0 - self.rate
    if rng is None:
      rng = self._make_rng()
    mask_shape = list(inputs.shape)
    for dim in self.broadcast_dims:
      mask_shape[dim] = 1
    mask = random.bernoulli(
        rng, p=keep_prob, shape=mask_shape,
        out_sharding=explicit.sharding_like(inputs, mask_shape))
    mask = explicit.match(jnp.broadcast_to(mask, inputs.shape), inputs)
    return lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))

  @nowrap
  def _deterministic(self, call_value):
    try:
      return merge_param('deterministic', self.deterministic, call_value)
    except ValueError as e:
      raise ValueError(
          f'{e} (Dropout at {self.scope.path_text}: use True to return the '
          'inputs unchanged (evaluation), False to apply a random mask '
          '(training).)') from None

  @nowrap
  def _make_rng(self):
    scope = self.scope
    if scope.has_rng(self.rng_collection) or scope.has_rng('params'):
      return self.make_rng(self.rng_collection)
    raise errors.missing_rng(
        self.rng_collection, scope.name, scope.path_text,
        ' Dropout draws its mask from it; pass deterministic=True to turn '
        'dropout off instead, or rng= to the call.')
