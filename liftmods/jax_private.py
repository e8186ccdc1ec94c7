"""Every use liftmods makes of JAX outside its stable public API, in one place.

JAX's public API (``jax``, ``jax.numpy``, ``jax.lax``, ``jax.sharding``, ...)
keeps its promises across releases; ``jax._src``, ``jax.interpreters`` and
``jax.extend`` do not. liftmods needs four things JAX offers only there:

- **partial evaluation** (``known_outputs``): which outputs of a function
  are computable from some of its inputs, and their values. Lazy init and
  scan's loop-invariant (broadcast) outputs rest on it.
- **running a traced program again** (``jaxpr_as_fun``): the 1F1B pipeline
  replays one traced stage so that its rng counters move once.
- **the trace-state token** (``opaque_trace_state``) of ``core.tracers``.
- **traceback filtering** (``api_boundary``, ``register_exclusion``), with
  which ``liftmods.traceback_util`` hides liftmods' frames.
- **extended dtypes** (``ExtendedDType`` and the ``EArray`` result handler)
  for the ``fp8_meta`` dtype of ``fp8_ops``.
- **the class of JAX's sharding type errors** (``ShardingTypeError``), which
  ``core.explicit`` re-raises naming the module path.

Nothing else in the package imports ``jax._src``, ``jax.interpreters`` or
``jax.extend`` (``tests/docs/test_jax_private.py`` reads every file for it),
and each name here is exercised on its own by that test, which lists the JAX
versions it was run against (``CHECKED_ON``). A JAX release that moves one of
these breaks that test first, naming the piece.

>>> import jax, jax.numpy as jnp
>>> def f(a, b):
...   return a + 1, a * b
>>> (plus_one, product), tree = known_outputs(
...     f, [jnp.float32(2), jax.ShapeDtypeStruct((), jnp.float32)])
>>> float(plus_one), product
(3.0, Unknown(aval=ShapedArray(float32[])))
"""
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax.extend import core as _jex_core
from jax.extend import linear_util as _lu
from jax.interpreters import partial_eval as _pe

__all__ = ['known_outputs', 'Unknown', 'jaxpr_as_fun', 'opaque_trace_state',
           'api_boundary', 'register_exclusion', 'ExtendedDType',
           'extended_result_handler', 'CAN_USE_EARRAY', 'ShardingTypeError']


class Unknown(NamedTuple):
  """An output of ``known_outputs`` that depends on an unknown input."""
  aval: Any


def _partial_value(x) -> Any:
  if isinstance(x, jax.core.ShapedArray):  # an abstract value, as it is
    return _pe.PartialVal.unknown(x)
  if isinstance(x, jax.ShapeDtypeStruct):
    return _pe.PartialVal.unknown(jax.core.ShapedArray(x.shape, x.dtype))
  return _pe.PartialVal.known(x)


def known_outputs(fn: Callable[..., Any], inputs: Sequence[Any],
                  name: str = 'liftmods partial eval'):
  """Runs ``fn(*inputs)`` as far as its known inputs allow.

  Args:
    fn: a function of ``len(inputs)`` arrays returning a pytree of arrays.
    inputs: arrays (known) or ``jax.ShapeDtypeStruct`` / ``ShapedArray``
      (unknown: staged, never computed).
    name: the name traces and errors give ``fn``.

  Returns:
    ``(values, tree)``: one entry per output leaf of ``fn``, the computed
    value where it depends on known inputs only and an ``Unknown`` (holding
    the output's abstract value) where it depends on an unknown one;
    ``tree`` is the output's tree structure.
  """
  trees = []

  def flat_fn(*flat):
    leaves, tree = jax.tree_util.tree_flatten(fn(*flat))
    trees.append(tree)
    return leaves

  debug = jax.api_util.debug_info(name, fn, tuple(inputs), {})
  _, pvals, _ = _pe.trace_to_jaxpr_nounits(
      _lu.wrap_init(flat_fn, debug_info=debug),
      [_partial_value(x) for x in inputs])
  return ([p.get_known() if p.is_known() else Unknown(p.get_aval())
           for p in pvals], trees[-1])


def jaxpr_as_fun(closed_jaxpr) -> Callable[..., Any]:
  """The function a ``jax.make_jaxpr`` result computes (flat arguments in,
  a flat list out)."""
  return _jex_core.jaxpr_as_fun(closed_jaxpr)


def opaque_trace_state() -> Any:
  """A token of the current trace state; equal tokens mean the same level."""
  return _jex_core.get_opaque_trace_state(convention='flax')


# -- traceback filtering ----------------------------------------------------------

try:
  from jax._src import traceback_util as _jax_traceback_util  # pylint: disable=g-import-not-at-top
  api_boundary = _jax_traceback_util.api_boundary
  register_exclusion = _jax_traceback_util.register_exclusion
except (ImportError, AttributeError):  # pragma: no cover - a JAX that moved it
  def api_boundary(fn):
    return fn

  def register_exclusion(path: str) -> None:
    del path


# -- extended dtypes ---------------------------------------------------------------

from jax._src import core as _jax_core  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax._src import dtypes as _jax_dtypes  # pylint: disable=g-import-not-at-top,wrong-import-position

ExtendedDType = _jax_dtypes.ExtendedDType

try:
  from jax._src import earray as _earray  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import pxla as _pxla  # pylint: disable=g-import-not-at-top
  CAN_USE_EARRAY = True
except (ModuleNotFoundError, ImportError):  # pragma: no cover
  CAN_USE_EARRAY = False


def extended_result_handler(aval, out_sharding, committed):
  """The handler that wraps a computation's buffers for an extended-dtype
  output ``aval`` into an ``EArray``.

  Raises:
    NotImplementedError: when this JAX has no ``EArray``.
  """
  if not CAN_USE_EARRAY:
    raise NotImplementedError('convert back under the jit')
  physical = _jax_core.physical_aval(aval)
  make_handler = _pxla.global_result_handlers[jax.core.ShapedArray]
  handler = make_handler(physical, out_sharding, committed)
  return lambda bufs: _earray.EArray(aval, handler(bufs))


#: What JAX raises when an operation's output sharding on Explicit mesh axes
#: is ambiguous or contradictory (not exported by ``jax.errors``).
ShardingTypeError = _jax_core.ShardingTypeError
