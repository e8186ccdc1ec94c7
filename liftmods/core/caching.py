"""The one cache policy of liftmods' process-wide caches, and key helpers.

Every cache that outlives a call (lifted jit's compiled functions, scan's
rng-counter replays, the parameter-shape checks of ``Scope.param``) is a
``BoundedCache``: a mapping with a fixed number of entries that, when full,
evicts an entry not used since it was last passed over ("second chance", a
cheap approximation of least-recently-used). A hit only sets a flag, so it
costs one dict lookup, and a hot entry survives any number of one-off keys
passing through.

>>> cache = BoundedCache(2)
>>> cache['a'] = 1; cache['b'] = 2
>>> cache.get('a')
1
>>> cache['c'] = 3  # full: 'a' was used since, so 'b' goes
>>> sorted(cache)
['a', 'c']
"""
from collections.abc import Iterable

from liftmods.core.filters import DenyList

_MISSING = object()


class BoundedCache:
  """A mapping of at most ``limit`` entries with second-chance eviction.

  Entries sit in insertion order, each with a "used" flag that a lookup
  sets. To make room, the oldest entry is evicted if its flag is clear;
  otherwise the flag is cleared and the entry moves to the back. Not
  locked: as with any dict, concurrent writers can only lose entries.
  """

  __slots__ = ('limit', '_data')

  def __init__(self, limit: int):
    if limit < 1:
      raise ValueError(f'BoundedCache needs a positive limit, got {limit}')
    self.limit = limit
    self._data = {}  # key -> [value, used]

  def get(self, key, default=None):
    """The value for ``key`` (marking it used), or ``default``."""
    item = self._data.get(key)
    if item is None:
      return default
    item[1] = True
    return item[0]

  def __setitem__(self, key, value):
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

  def __getitem__(self, key):
    value = self.get(key, _MISSING)
    if value is _MISSING:
      raise KeyError(key)
    return value

  def __contains__(self, key) -> bool:
    return key in self._data

  def __len__(self) -> int:
    return len(self._data)

  def __iter__(self):
    return iter(list(self._data))

  def clear(self):
    self._data.clear()


def hashable_filter(f):
  """A hashable stand-in for a collection filter (sets and lists by their
  members, a DenyList by what it denies)."""
  if f is True or f is False or isinstance(f, str):
    return f
  if isinstance(f, DenyList):
    return ('deny', hashable_filter(f.deny))
  if isinstance(f, Iterable):
    return frozenset(f)
  return f


def hashable_flags(flags):
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
