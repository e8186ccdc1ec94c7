"""Sequential: chains callables, each fed the output of the one before.

>>> import jax, jax.numpy as jnp
>>> from liftmods.layers.combinators import Sequential
>>> Sequential([jnp.tanh, lambda x: x * 2]).apply({}, jnp.zeros(2))
Array([0., 0.], dtype=float32)
"""
from collections.abc import Callable, Sequence
from typing import Any

from liftmods.module import Module, compact


class Sequential(Module):
  """Applies ``layers`` (modules or plain functions) in order.

  The first layer gets the call's arguments. A layer returning a ``tuple``
  passes it on as positional arguments, one returning a ``dict`` as keyword
  arguments; anything else is passed as the single argument. The layers may
  be modules constructed in the enclosing ``@compact`` method (their
  variables then live in the enclosing module, as in Linen) or outside any
  module (they become children ``layers_0``, ``layers_1``, ...).

  Attributes:
    layers: the modules or functions to apply, first to last.

  >>> import jax, jax.numpy as jnp
  >>> def split(x):
  ...   return x[:1], x[1:]
  >>> def join(a, b):
  ...   return {'total': a.sum() + b.sum()}
  >>> def report(total):
  ...   return total
  >>> Sequential([split, join, report]).apply({}, jnp.arange(4.0))
  Array(6., dtype=float32)
  """

  layers: Sequence[Callable[..., Any]]

  def __post_init__(self):
    if not isinstance(self.layers, Sequence):
      raise ValueError(
          f"'layers' must be a sequence, got '{type(self.layers).__name__}'. "
          '(Sequential takes a list or tuple of callables.)')
    super().__post_init__()

  @compact
  def __call__(self, *args, **kwargs):
    if not self.layers:
      raise ValueError(f'Empty Sequential module {self.name}. (Sequential '
                       f'at {self.scope.path_text} has no layers; pass at '
                       'least one callable.)')
    outputs = self.layers[0](*args, **kwargs)
    for layer in self.layers[1:]:
      outputs = _feed(layer, outputs)
    return outputs


def _feed(layer, outputs):
  """Calls ``layer`` with the previous outputs, spread as Linen spreads
  them: tuples positionally, dicts as keywords."""
  if isinstance(outputs, tuple):
    return layer(*outputs)
  if isinstance(outputs, dict):
    return layer(**outputs)
  return layer(outputs)
