"""Inspecting JAX's trace state (``flax.core.tracers``'s two functions).

>>> from liftmods.core.tracers import current_trace
>>> current_trace() == current_trace()
True
"""
import jax

__all__ = ['current_trace', 'check_trace_level']


def current_trace():
  """An opaque token of the current JAX trace state (equal tokens: the
  same trace level)."""
  from jax.extend import core as jex_core  # pylint: disable=g-import-not-at-top
  get_state = getattr(jex_core, 'get_opaque_trace_state', None)
  if get_state is None:  # older jax
    get_state = jax.core.get_opaque_trace_state
  return get_state(convention='flax')


def check_trace_level(base_level):
  """Accepts any level: Linen disabled this check, and so does liftmods."""
  del base_level
