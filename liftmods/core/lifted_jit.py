"""Lifted ``jax.jit``, with a compile cache keyed by what a trace depends on.

The cache maps a fingerprint (the caller's ``hash_key``, the mutability and
flags of the scopes, how they nest, and their rng counters) to a jitted
function. A cached call also replays the rng-counter changes the traced call
made, so that counters advance exactly as if the body had run.
"""
import functools
import threading
from collections.abc import Iterable
from typing import Any, Callable

import jax

from liftmods.core import caching, rng_counters
from liftmods.core.caching import BoundedCache, hashable_filter, hashable_flags
from liftmods.core.filters import union
from liftmods.core.pack import Packing, pack


class _JitContext(threading.local):

  def __init__(self):
    super().__init__()
    self.stack = []


class _JitEntry:
  __slots__ = ('call', 'changes')

  def __init__(self, call):
    self.call = call
    self.changes = None  # per scope, set after the first (tracing) call


# Compiled functions kept per lifted jit (each holds its own jax.jit caches).
JIT_CACHE_LIMIT = 128
JIT_CACHE_POLICY = caching.Policy(
    holds='compiled entries of one `jit(...)` (for `nn.jit`: of one lifted '
          'method, made on its first bound call)',
    keyed_on='`hash_key` (`ModuleKey`: module configuration), mutability, '
             'flags, scope-tree structure, counters before',
    bound=f'{JIT_CACHE_LIMIT} entries per jitted function',
    cleared='on eviction; with the jitted function')
caching.register('core.lifted_jit.jit.cache', JIT_CACHE_POLICY,
                 clear=caching.clear_bounded_caches)


def shift_argnums(argnums: int | Iterable[int], by: int) -> tuple[int, ...]:
  """Argument numbers that count a scope or module as argument 0, moved
  for a function that takes ``by`` arguments in front of argument 1.

  Entry 0 (the scope or module itself, never traced) and negative entries
  are dropped.

  Args:
    argnums: an argument number or several (``static_argnums``,
      ``donate_argnums``).
    by: how far the arguments after the scope or module move.

  Returns:
    The moved numbers.

  >>> shift_argnums(2, 1), shift_argnums((0, 1, 3), 0)
  ((3,), (1, 3))
  """
  if not isinstance(argnums, Iterable):
    argnums = (argnums,)
  return tuple(i + by for i in argnums if i > 0)


def jit(fn: Callable[..., Any], variables: Any = True, rngs: Any = True,
        static_argnums: int | Iterable[int] = (),
        static_argnames: str | Iterable[str] = (),
        donate_argnums: int | Iterable[int] = (), device: Any = None,
        backend: str | None = None) -> Callable[..., Any]:
  """``jax.jit`` for scope functions.

  As in Flax, the result is called as ``f(scope, hash_key, *args)`` and runs
  ``fn(scope, hash_key, *args)``; ``hash_key`` is any hashable value telling
  apart calls that need different traces (modules pass a fingerprint of
  themselves). Argument numbers count the scope as 0 and skip ``hash_key``.

  Compiled functions are cached per ``hash_key``, scope position, mutability,
  flags and rng counter state; a call that hits the cache runs without
  tracing and advances the rng counters as the traced call did. Inside,
  rng sequences start from the bare keys (the scope names already folded
  into them lazily are dropped, as in Flax).

  Args:
    fn: ``fn(scope, hash_key, *args)``.
    variables: the collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.
    static_argnums: static arguments (the scope is 0).
    static_argnames: static keyword arguments.
    donate_argnums: arguments whose buffers may be reused (the scope is 0).
    device: passed to ``jax.jit``.
    backend: passed to ``jax.jit``.

  Returns:
    The compiled ``f(scope, hash_key, *args)``.
  """
  # Inside: (variable_groups, rng_groups, *args); user arg i>0 is args[i-1].
  jit_kwargs = dict(static_argnums=shift_argnums(static_argnums, 1),
                    static_argnames=static_argnames,
                    donate_argnums=shift_argnums(donate_argnums, 1))
  if device is not None:
    jit_kwargs['device'] = device
  if backend is not None:
    jit_kwargs['backend'] = backend
  filters, rng_filters = (variables,), (rngs,)
  out_union = union(False, variables)
  context = _JitContext()
  cache = BoundedCache(JIT_CACHE_LIMIT, name='core.lifted_jit.jit.cache',
                       policy=JIT_CACHE_POLICY)

  def new_entry():
    # A fresh function object per entry so that JAX's own caches (which key
    # on the function) never mix up traces of different fingerprints.
    def traced(variable_groups, rng_groups, *args, **kwargs):
      packing, hash_key = context.stack[-1]
      scope = packing.make_scopes(variable_groups, rng_groups,
                                  keep_rng_suffix=False)
      y = fn(scope, hash_key, *args, **kwargs)
      return y, packing.repack_fn(scope)

    functools.update_wrapper(traced, fn)
    return _JitEntry(jax.jit(traced, **jit_kwargs))

  @functools.wraps(fn)
  def wrapper(scope_tree, hash_key, *args, **kwargs):
    # What ``pack`` does, inlined: this runs on every call of a jitted
    # module, and a cache hit should cost little more than jax.jit's own.
    packing = Packing(scope_tree, filters, out_union, 'jit')
    scopes = packing.scopes
    # Not the scopes' paths: the traced computation sees only the variable
    # groups and bare keys, so identical modules at different paths share
    # one compiled function (as in Linen).
    if len(scopes) == 1:
      s = scopes[0]
      state = rng_counters.snapshot(s.rng_counters) if s.rng_counters else ()
      before = (state,)
      where = ((hashable_filter(s.mutable), hashable_flags(s.flags)),)
      counters = (rng_counters.without_zero_children(state) if state else (),)
    else:
      before = tuple(rng_counters.snapshot(s.rng_counters) for s in scopes)
      where = tuple((hashable_filter(s.mutable), hashable_flags(s.flags))
                    for s in scopes)
      counters = tuple(rng_counters.without_zero_children(b) for b in before)
    fingerprint = (hash_key, where, packing.links, packing.treedef, counters)
    entry = cache.get(fingerprint)
    if entry is None:
      entry = cache[fingerprint] = new_entry()
    variable_groups = packing.variable_groups(filters)
    rng_groups = packing.rng_groups(rng_filters)
    stack = context.stack
    stack.append((packing, hash_key))  # read by ``traced`` if JAX traces
    try:
      y, out_groups = entry.call(variable_groups, rng_groups, *args, **kwargs)
    finally:
      stack.pop()
    if entry.changes is None:
      made = tuple(
          rng_counters.changes(b, rng_counters.snapshot(s.rng_counters))
          for s, b in zip(scopes, before))
      entry.changes = made if any(made) else ()
    else:
      for s, delta in zip(scopes, entry.changes):
        rng_counters.apply_changes(s.rng_counters, delta)
    packing.publish(out_groups)
    return y

  return wrapper


def fold_rngs(fn: Callable[..., Any], variables=True, rngs=True):
  """Calls ``fn(scope, hash_key, *args)`` on a scope whose rng sequences
  start from their bare keys (the lazily folded scope names dropped), like
  the inside of ``jit`` but without compiling."""

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, hash_key,
            *args, **kwargs):
    scope = make_scopes(variable_groups, rng_groups, keep_rng_suffix=False)
    y = fn(scope, hash_key, *args, **kwargs)
    return y, repack_fn(scope)

  return pack(inner, (variables,), (variables,), (rngs,), name='fold_rngs',
              enable_kwargs=True)
