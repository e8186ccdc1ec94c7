"""PRNG sequences derived from module paths and call counters.

A sequence is a root key plus a *suffix*: the names of the scopes pushed since
the key was last materialised, and finally a call counter. Materialising
hashes the whole suffix with SHA-1 (names as UTF-8, counters as minimal
big-endian bytes, no separators), takes the first four bytes as an unsigned
32-bit integer and folds it into the root key. This reproduces Flax 0.12's
default derivation bit for bit, so the same seed gives the same parameters.

>>> import jax
>>> seq = LazyKey(jax.random.key(0)).child('Dense_0').child(1)
>>> seq.suffix
('Dense_0', 1)
>>> seq.materialize().shape
()
"""
import dataclasses
import functools
import hashlib
from typing import Any

import jax
import numpy as np

from liftmods import errors
from liftmods.config import FLAG_VALUES
from liftmods.core import caching


def hash_suffix(suffix: tuple) -> int:
  """The 32-bit integer folded into a key for a suffix of names/counters."""
  m = hashlib.sha1()
  separate = FLAG_VALUES['flax_fix_rng_separator']
  for part in suffix:
    if separate:  # keeps ('ab', 'c') and ('a', 'bc') apart
      m.update(b'\x00')
    if isinstance(part, str):
      m.update(part.encode('utf-8'))
    elif isinstance(part, int):
      m.update(part.to_bytes((part.bit_length() + 7) // 8, 'big'))
    else:
      raise ValueError(f'rng suffix parts must be str or int, got {part!r}')
  return int.from_bytes(m.digest()[:4], 'big')


def fold_static(key, suffix: tuple):
  """Folds a suffix of names/counters into ``key`` (no-op for an empty one)."""
  if not suffix:
    return key
  return jax.random.fold_in(key, np.uint32(hash_suffix(suffix)))


class LazyKey:
  """A root key with the static suffix still to be folded into it.

  Args:
    key: the root PRNG key.
    suffix: the names (and counters) still to be folded into ``key``.
  """

  __slots__ = ('key', 'suffix')

  def __init__(self, key: jax.Array, suffix: tuple = ()):
    self.key = key
    self.suffix = suffix

  def child(self, part) -> 'LazyKey':
    return LazyKey(self.key, self.suffix + (part,))

  def materialize(self):
    return fold_static(self.key, self.suffix)

  def __repr__(self):
    return f'LazyKey({self.key}, suffix={self.suffix})'


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class LazyRng:
  """Linen's lazily folded key (``flax.core.scope.LazyRng``): a pytree whose
  child is the root key and whose static part is the suffix.

  Accepted wherever an rng is (as :class:`LazyKey` with the same suffix).

  Attributes:
    rng: the root PRNG key.
    suffix: the names and counters still to be folded into ``rng``.
  """
  rng: Any
  suffix: tuple = ()

  def as_jax_rng(self) -> jax.Array:
    """Returns the key with the suffix folded in, as Linen folds it."""
    return fold_static(self.rng, tuple(self.suffix))

  @staticmethod
  def create(rng: Any, *suffix: str | int) -> 'LazyRng':
    """A LazyRng over ``rng``, a key or a LazyRng whose suffix it extends.

    Args:
      rng: a PRNG key, or a LazyRng (liftmods' or flax's).
      *suffix: names and counters appended to the suffix.

    Returns:
      The LazyRng.
    """
    if type(rng).__name__ == 'LazyRng':
      return LazyRng(rng.rng, tuple(rng.suffix) + suffix)
    return LazyRng(rng, suffix)

  def clear_suffix(self) -> 'LazyRng':
    """Returns a LazyRng of the same root key with an empty suffix."""
    return LazyRng(self.rng, ())

  def replace(self, **changes: Any) -> 'LazyRng':
    """Returns a copy with ``changes`` (field: value) applied.

    Args:
      **changes: new values of ``rng`` and/or ``suffix``.
    """
    return dataclasses.replace(self, **changes)

  def tree_flatten(self):
    return (self.rng,), tuple(self.suffix)

  @classmethod
  def tree_unflatten(cls, suffix, children):
    return cls(children[0], suffix)


def as_lazy(name: str, rng, entry: str = 'apply') -> LazyKey:
  """Validates a user-supplied rng and wraps it as a LazyKey; ``entry``
  names the call it was passed to, for the error message."""
  if isinstance(rng, LazyKey):
    return rng
  if hasattr(rng, '__class__') and type(rng).__name__ == 'LazyRng':
    return LazyKey(rng.rng, tuple(rng.suffix))  # a flax LazyRng, duck-typed
  if not _is_key(rng):
    raise errors.bad_rng(name, rng, entry)
  return LazyKey(rng)


def _is_key(x) -> bool:
  """One key: a typed key of shape (), or raw key data of the default
  implementation's shape (uint32[2] for threefry)."""
  dtype = getattr(x, 'dtype', None)
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return x.shape == ()
  return dtype == np.uint32 and x.shape == _raw_key_shape()


@functools.lru_cache(maxsize=None)
def _raw_key_shape() -> tuple:
  return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


caching.register('core.rngs._raw_key_shape', caching.Policy(
    holds='the shape of raw key data of the default implementation',
    keyed_on='nothing (`lru_cache` of no arguments)',
    bound='1 entry',
    cleared='never'), clear=_raw_key_shape.cache_clear)
