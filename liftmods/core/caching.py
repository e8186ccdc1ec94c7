"""The one cache policy of liftmods' process-wide caches, the registry that
lists every cache and memo table of the package, and key helpers.

Every cache that outlives a call and can grow with the user's programs
(lifted jit's compiled functions, scan's rng-counter replays, the
parameter-shape checks of ``Scope.param``) is a ``BoundedCache``: a mapping
with a fixed number of entries that, when full, evicts an entry not used
since it was last passed over ("second chance", a cheap approximation of
least-recently-used). A hit only sets a flag, so it costs one dict lookup,
and a hot entry survives any number of one-off keys passing through.

>>> cache = BoundedCache(2)
>>> cache['a'] = 1; cache['b'] = 2
>>> cache.get('a')
1
>>> cache['c'] = 3  # full: 'a' was used since, so 'b' goes
>>> sorted(cache)
['a', 'c']

Each table of the package is listed, with its ``Policy``, in one registry:
a named ``BoundedCache`` lists itself (every one made at that line of the
code passes the same policy), other tables (weak dictionaries,
``lru_cache`` functions, dicts filled on lookup) call ``register`` where
they are made, and the few whose modules cannot import this one are listed
here. ``registry()`` returns them all; ``clear_caches()`` empties those
whose entries are only remembered work.
"""
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from liftmods.core.filters import DenyList

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Policy:
  """What a cache or memo table holds, and how it is bounded and emptied.

  The texts are read by people (``docs/architecture.md`` shows them in its
  caches table), so they may use Markdown code spans.

  Attributes:
    holds: what an entry is.
    keyed_on: what an entry is looked up by.
    bound: how many entries there can be ('4096 entries', 'weak', ...).
    cleared: when entries leave on their own ('on eviction', 'when the
      function is collected', ...), or 'never'. Emptying by
      ``clear_caches()`` is not counted here: ``CacheInfo.clearable`` says
      whether it happens.
  """

  holds: str
  keyed_on: str
  bound: str
  cleared: str


@dataclasses.dataclass(frozen=True)
class CacheInfo:
  """One table of the registry.

  Attributes:
    name: where the table lives, dotted from the package root: module, then
      class or function, then the table's name
      (``'core.init_shapes._SHAPE_CACHE'``).
    policy: its policy.
    clearable: whether ``clear_caches()`` empties it.
  """

  name: str
  policy: Policy
  clearable: bool


_TABLES: dict[str, CacheInfo] = {}
_CLEARERS: dict[str, Callable[[], Any]] = {}
_LIVE: 'weakref.WeakSet[BoundedCache]' = weakref.WeakSet()


def _record(name: str, policy: Policy, clearable: bool) -> None:
  known = _TABLES.get(name)
  if known is not None:
    if known.policy is policy or (known.policy == policy
                                  and known.clearable == clearable):
      return
    raise ValueError(f'cache {name!r} is registered with another policy: '
                     f'{known.policy}')
  _TABLES[name] = CacheInfo(name, policy, clearable)


def register(name: str, policy: Policy,
             clear: Callable[[], Any] | None = None) -> None:
  """Lists a table in the registry.

  A ``BoundedCache`` lists itself instead (its ``name`` and ``policy``
  arguments). A table of ``BoundedCache`` instances made later, on each
  call of some function (lifted jit's, ``init_sharded``'s), is listed here
  at import with ``clear=clear_bounded_caches``, and each instance passes
  the same policy.
  Registering a name again with the same policy does nothing.

  Args:
    name: where the table lives, dotted from the package root (see
      ``CacheInfo.name``).
    policy: what it holds, and how it is bounded and emptied.
    clear: empties the table, for ``clear_caches()``. Leave it out for a
      table whose entries carry meaning beyond remembered work (emptying
      it would change what the package computes or says).

  Raises:
    ValueError: ``name`` is registered with another policy.
  """
  _record(name, policy, clear is not None)
  if clear is not None:
    _CLEARERS[name] = clear


def registry() -> tuple[CacheInfo, ...]:
  """Every cache and memo table registered so far, sorted by name.

  Tables register when their module is imported; ``import liftmods`` imports
  all of them but ``serialization``'s, which has none.

  Returns:
    One ``CacheInfo`` per table.

  >>> info = {c.name: c for c in registry()}['core.init_shapes._SHAPE_CACHE']
  >>> info.policy.bound, info.clearable
  ('4096 entries', True)
  """
  return tuple(_TABLES[name] for name in sorted(_TABLES))


def clear_bounded_caches() -> None:
  """Empties every ``BoundedCache``: the ``clear`` function of a table whose
  instances are made after import (``register``)."""
  for cache in list(_LIVE):
    cache.clear()


def clear_caches() -> None:
  """Empties every ``BoundedCache`` and every table registered with a
  ``clear`` function.

  What is emptied is remembered work only: later calls recompute it, with
  the same results. Tables whose entries carry meaning (adopted modules,
  the numbers standing for precision policies, warnings already given) are
  left alone, and so are JAX's own caches (``jax.clear_caches()``).
  """
  # Each function once: several tables may share one.
  for clear in dict.fromkeys((clear_bounded_caches, *_CLEARERS.values())):
    clear()


class BoundedCache:
  """A mapping of at most ``limit`` entries with second-chance eviction.

  Entries sit in insertion order, each with a "used" flag that a lookup
  sets. To make room, the oldest entry is evicted if its flag is clear;
  otherwise the flag is cleared and the entry moves to the back. Not
  locked: as with any dict, concurrent writers can only lose entries.

  Args:
    limit: the most entries it holds.
    name: the cache's name in the registry (see ``CacheInfo.name``);
      caches made at one place of the code share it.
    policy: the cache's policy, listed under ``name``. Caches made at one
      place pass the same policy (a module-level constant, so that listing
      it again costs one identity test).

  Raises:
    ValueError: ``limit`` is not positive, or one of ``name`` and
      ``policy`` comes without the other.
  """

  __slots__ = ('limit', '_data', '__weakref__')

  def __init__(self, limit: int, *, name: str | None = None,
               policy: Policy | None = None):
    if limit < 1:
      raise ValueError(f'BoundedCache needs a positive limit, got {limit}')
    if (name is None) != (policy is None):
      raise ValueError('a BoundedCache with a name needs a policy, and one '
                       f'with a policy a name (name={name!r})')
    if name is not None:
      _record(name, policy, clearable=True)
    self.limit = limit
    self._data = {}  # key -> [value, used]
    _LIVE.add(self)

  def get(self, key: Any, default: Any = None) -> Any:
    """The value for ``key`` (marking it used), or ``default``."""
    item = self._data.get(key)
    if item is None:
      return default
    item[1] = True
    return item[0]

  def __setitem__(self, key: Any, value: Any) -> None:
    data = self._data
    item = data.get(key)
    if item is not None:
      item[0] = value
      return
    while len(data) >= self.limit:
      oldest = next(iter(data))
      item = data.pop(oldest)
      if not item[1]:
        break
      item[1] = False
      data[oldest] = item
    data[key] = [value, False]

  def __getitem__(self, key: Any) -> Any:
    value = self.get(key, _MISSING)
    if value is _MISSING:
      raise KeyError(key)
    return value

  def __contains__(self, key: Any) -> bool:
    return key in self._data

  def __len__(self) -> int:
    return len(self._data)

  def __iter__(self) -> Iterator:
    return iter(list(self._data))

  def clear(self) -> None:
    """Drops every entry."""
    self._data.clear()


def hashable_filter(f: Any) -> Any:
  """A hashable stand-in for a collection filter (sets and lists by their
  members, a DenyList by what it denies)."""
  if f is True or f is False or isinstance(f, str):
    return f
  if isinstance(f, DenyList):
    return ('deny', hashable_filter(f.deny))
  if isinstance(f, Iterable):
    return frozenset(f)
  return f


def hashable_flags(flags: Mapping | None) -> tuple:
  """A hashable stand-in for a scope's flags dict: its items, or the dict's
  identity when some value cannot be hashed."""
  if not flags:
    return ()
  try:
    key = tuple(flags.items())
    hash(key)
    return key
  except TypeError:
    return ('flags-id', id(flags))


# The table whose module does not register it: ``dtypes`` sits below this
# module in the layer map.
register('dtypes._INEXACT', Policy(
    holds='whether a dtype is inexact',
    keyed_on='dtype',
    bound='one entry per dtype',
    cleared='never'))
