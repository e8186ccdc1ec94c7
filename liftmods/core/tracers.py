"""Inspecting JAX's trace state (``flax.core.tracers``'s two functions).

>>> from liftmods.core.tracers import current_trace
>>> current_trace() == current_trace()
True
"""
from typing import Any

from liftmods import jax_private

__all__ = ['current_trace', 'check_trace_level']


def current_trace() -> Any:
  """An opaque token of the current JAX trace state.

  Returns:
    The token; equal tokens mean the same trace level.
  """
  return jax_private.opaque_trace_state()


def check_trace_level(base_level: Any) -> None:
  """Accepts any level: Linen disabled this check, and so does liftmods.

  Args:
    base_level: a ``current_trace()`` token; ignored.
  """
  del base_level
