"""The shapes an initializer makes, cached per initializer fingerprint.

``Scope.param`` checks a stored parameter against the shapes its
initializer would produce. Finding those shapes costs a ``jax.eval_shape``
of the initializer, so the answer is cached under a fingerprint of the
initializer: its code, the immutable values its closure and defaults hold,
the current values of the globals it reads, and its arguments. An
initializer that could change behind the cache's back (a bound method, a
closure over a list) gets no fingerprint and is evaluated every time.

Only shapes are cached, never values: parameter values always come from
calling the initializer itself.

>>> import jax
>>> expected_shapes(jax.nn.initializers.zeros, ((2, 3),), {})
((2, 3),)
"""
import functools
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from liftmods.core import caching

_SHAPE_CACHE = caching.BoundedCache(
    4096, name='core.init_shapes._SHAPE_CACHE', policy=caching.Policy(
        holds='the shapes an initializer makes (`Scope.param` checks a '
              'stored parameter against them)',
        keyed_on='initializer fingerprint (code, closure values, '
                 'defaults), the values of the globals it reads, its '
                 'arguments',
        bound='4096 entries',
        cleared='on eviction'))

_VALUE_TYPES = (int, float, complex, bool, str, bytes, type(None), type,
                np.dtype)
_PLAIN = frozenset((int, float, complex, bool, str, bytes, type(None)))

# Libraries whose functions are taken as fixed: their globals are not read.
_LIBRARIES = frozenset(('jax', 'jaxlib', 'numpy', 'liftmods', 'flax',
                        'ml_dtypes', 'optax', 'functools', 'math'))


class _Uncacheable(Exception):
  """Raised for a value that could change behind the cache's back."""


def _value_key(x: Any) -> Any:
  """``x`` if it is an immutable value (or a tuple of them, or a function
  keyed by ``_fn_key``); raises _Uncacheable for anything that could change
  behind the cache's back."""
  kind = type(x)
  if kind in _PLAIN:
    return x
  if kind is tuple:
    for v in x:
      if type(v) not in _PLAIN:
        return tuple(_value_key(v) for v in x)
    return x
  if isinstance(x, _VALUE_TYPES):
    return x
  if isinstance(x, (tuple, frozenset)):
    return type(x)(_value_key(v) for v in x)
  if callable(x):
    return _fn_key(x)
  raise _Uncacheable


def _fn_key(fn: Callable) -> Any:
  """A hashable identity for an initializer that survives re-creation: two
  closures of the same code over equal immutable values compute the same
  shapes. Bound methods and closures over mutable objects are not cached."""
  if isinstance(fn, functools.partial):
    return (_fn_key(fn.func), _value_key(fn.args),
            tuple(sorted((k, _value_key(v)) for k, v in fn.keywords.items())))
  code = getattr(fn, '__code__', None)
  if code is None or hasattr(fn, '__self__'):
    if isinstance(fn, type) or getattr(fn, '__module__', None) == 'numpy':
      return fn
    raise _Uncacheable
  cells = tuple(_value_key(c.cell_contents) for c in (fn.__closure__ or ()))
  return (code, cells, _value_key(fn.__defaults__ or ()))


def _globals_key(fn: Callable, seen: set | None = None) -> tuple:
  """The current values of the globals a user-defined initializer reads
  (library functions are taken as fixed). Recomputed on every check, so a
  rebound global is never served a stale shape."""
  if isinstance(fn, functools.partial):
    return _globals_key(fn.func, seen)
  module = getattr(fn, '__module__', None) or ''
  code = getattr(fn, '__code__', None)
  if code is None or module.partition('.')[0] in _LIBRARIES:
    return ()
  seen = set() if seen is None else seen
  if id(code) in seen:
    return ()
  seen.add(id(code))
  out = []
  namespace = fn.__globals__
  for name in code.co_names:
    if name not in namespace:
      continue
    value = namespace[name]
    if isinstance(value, types.ModuleType):
      continue
    if callable(value) and hasattr(value, '__code__'):
      out.append((name, value, _globals_key(value, seen)))
    else:
      out.append((name, _value_key(value)))
  for cell in fn.__closure__ or ():
    if callable(cell.cell_contents):
      out.append(_globals_key(cell.cell_contents, seen))
  return tuple(out)


_FN_KEYS: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()
caching.register('core.init_shapes._FN_KEYS', caching.Policy(
    holds='initializer fingerprints (the part that cannot change: code, '
          'closure values, defaults)',
    keyed_on='the initializer function object',
    bound='weak',
    cleared='when the function is collected'), clear=_FN_KEYS.clear)


def _cached_fn_key(fn: Callable) -> Any:
  """``_fn_key(fn)``, remembered per function object where it is weakly
  referenceable."""
  try:
    return _FN_KEYS[fn]
  except (KeyError, TypeError):
    key = _fn_key(fn)
  try:
    _FN_KEYS[fn] = key
  except TypeError:  # not weakly referenceable
    pass
  return key


def expected_shapes(init_fn: Callable, init_args: tuple,
                    init_kwargs: Mapping[str, Any]) -> tuple:
  """The shapes of the leaves ``init_fn(key, *init_args, **init_kwargs)``
  makes, from the cache when the initializer has a fingerprint.

  Args:
    init_fn: the initializer, called with a key first.
    init_args: its positional arguments after the key.
    init_kwargs: its keyword arguments.

  Returns:
    One shape tuple per leaf of the initializer's output, in
    ``jax.tree_util.tree_leaves`` order (an axis-metadata box contributes
    the leaves of its value).
  """
  try:
    key = (_cached_fn_key(init_fn), _globals_key(init_fn),
           _value_key(init_args),
           tuple(sorted((k, _value_key(v)) for k, v in init_kwargs.items())))
    hit = _SHAPE_CACHE.get(key)
    if hit is not None:
      return hit
  except (_Uncacheable, TypeError, ValueError):  # no safe key: no caching
    key = None
  abstract = jax.eval_shape(
      lambda: init_fn(jax.random.key(0), *init_args, **init_kwargs))
  # Boxes are pytrees over their value: the leaves are the abstract arrays.
  # (Unboxing would apply a box's sharding constraint to them.)
  shapes = tuple(np.shape(x) for x in jax.tree_util.tree_leaves(abstract))
  if key is not None:
    _SHAPE_CACHE[key] = shapes
  return shapes
