"""An immutable, hashable mapping that is a JAX pytree, plus helpers that work
on plain dicts and FrozenDicts alike.

Variables are plain dicts by default; FrozenDict exists for code that asks
for it.

>>> from liftmods.core import freeze, unfreeze, copy, pop
>>> fd = freeze({'params': {'w': 1}})
>>> fd['params']['w']
1
>>> rest, w = pop(fd['params'], 'w')
>>> (dict(rest), w)
({}, 1)
>>> unfreeze(copy(fd, {'extra': 2}))
{'params': {'w': 1}, 'extra': 2}
"""
from collections.abc import Mapping
from typing import Any

import jax


class FrozenDict(Mapping):
  """An immutable mapping; nested dicts are frozen too.

  Args:
    *args: as for ``dict``: a mapping or an iterable of pairs.
    __unsafe_skip_copy__: keep the given dict as it is (no copy, nested
      dicts not frozen); for callers that own it.
    **kwargs: as for ``dict``: entries by keyword.
  """

  __slots__ = ('_dict', '_hash')

  def __init__(self, *args: Any, __unsafe_skip_copy__: bool = False,
               **kwargs: Any):
    raw = dict(*args, **kwargs)
    if not __unsafe_skip_copy__:
      raw = {k: _freeze_value(v) for k, v in raw.items()}
    self._dict = raw
    self._hash = None

  @classmethod
  def __subclasshook__(cls, other):
    # flax.core.FrozenDict (flax.core stays flax's under liftmods.compat, and
    # Linen's apply takes frozen variables) is a FrozenDict here too:
    # recognised by its name and the Mapping protocol, without importing flax.
    if cls is FrozenDict and other.__name__ == 'FrozenDict' and issubclass(
        other, Mapping):
      return True
    return NotImplemented

  def __getitem__(self, key):
    return self._dict[key]

  def __contains__(self, key):
    return key in self._dict

  def __iter__(self):
    return iter(self._dict)

  def __len__(self):
    return len(self._dict)

  def __setitem__(self, key, value):
    raise ValueError('FrozenDict is immutable; use copy(fd, {key: value}).')

  def __repr__(self):
    return pretty_repr(self)

  def __hash__(self):
    if self._hash is None:
      self._hash = hash(tuple((k, self._dict[k]) for k in sorted(self._dict)))
    return self._hash

  def __eq__(self, other):
    if isinstance(other, FrozenDict):
      other = other._dict
    return isinstance(other, dict) and self._dict == other

  def __reduce__(self):
    return FrozenDict, (unfreeze(self),)

  def __or__(self, other):
    return self.copy(other)

  def copy(self, add_or_replace: Mapping = ()) -> 'FrozenDict':
    """Returns a new FrozenDict with ``add_or_replace`` merged in."""
    return type(self)({**self._dict, **dict(add_or_replace)})

  def pop(self, key):
    """Returns ``(rest, value)``: a new FrozenDict without ``key`` and its value."""
    value = self._dict[key]
    rest = {k: v for k, v in self._dict.items() if k != key}
    return type(self)(rest, __unsafe_skip_copy__=True), value

  def unfreeze(self) -> dict:
    return unfreeze(self)

  def pretty_repr(self, num_spaces: int = 4) -> str:
    return pretty_repr(self, num_spaces)


def _freeze_value(v):
  if isinstance(v, dict):
    return FrozenDict(v)
  return v


def _flatten_with_keys(fd):
  keys = tuple(sorted(fd._dict))
  return [(jax.tree_util.DictKey(k), fd._dict[k]) for k in keys], keys


def _unflatten(keys, values):
  return FrozenDict(dict(zip(keys, values)), __unsafe_skip_copy__=True)


jax.tree_util.register_pytree_with_keys(
    FrozenDict, _flatten_with_keys, _unflatten,
    flatten_func=lambda fd: (tuple(fd._dict[k] for k in sorted(fd._dict)),
                             tuple(sorted(fd._dict))))


def freeze(xs: Mapping) -> FrozenDict:
  """A FrozenDict copy of ``xs`` (nested mappings frozen too).

  Args:
    xs: a mapping.

  Returns:
    The frozen copy.
  """
  return FrozenDict(xs)


def unfreeze(x: Any) -> Any:
  """A nested plain-dict copy of a (Frozen)dict; leaves are shared.

  Args:
    x: a FrozenDict or dict (anything else is returned as it is).

  Returns:
    The plain-dict copy.
  """
  if isinstance(x, (FrozenDict, dict)):
    return {k: unfreeze(v) for k, v in x.items()}
  return x


def copy(x: Mapping, add_or_replace: Mapping = FrozenDict()) -> Mapping:
  """A shallow copy of ``x`` with ``add_or_replace`` merged in.

  Args:
    x: a FrozenDict or dict; the copy has the same type.
    add_or_replace: entries to add or replace.

  Returns:
    The new mapping.

  Raises:
    TypeError: ``x`` is neither a dict nor a FrozenDict.
  """
  if isinstance(x, FrozenDict):
    return x.copy(add_or_replace)
  if isinstance(x, dict):
    new = dict(x)
    new.update(add_or_replace)
    return new
  raise TypeError(f'copy() expects a dict or FrozenDict, got {type(x)}')


def pop(x: Mapping, key: Any) -> tuple[Mapping, Any]:
  """Removes ``key`` from a copy of ``x``; ``x`` is not changed.

  Args:
    x: a FrozenDict or dict.
    key: the key to remove.

  Returns:
    ``(rest, value)``.

  Raises:
    TypeError: ``x`` is neither a dict nor a FrozenDict.
    KeyError: ``key`` is missing.
  """
  if isinstance(x, FrozenDict):
    return x.pop(key)
  if isinstance(x, dict):
    new = dict(x)
    value = new.pop(key)
    return new, value
  raise TypeError(f'pop() expects a dict or FrozenDict, got {type(x)}')


def pretty_repr(x: Any, num_spaces: int = 4) -> str:
  """An indented, multi-line representation of a nested mapping.

  Args:
    x: a nested mapping (or any value, shown with ``repr``).
    num_spaces: indentation per level.

  Returns:
    The text.
  """

  def render(value, depth):
    if not isinstance(value, Mapping):
      return repr(value)
    if not value:
      return '{}'
    pad = ' ' * (num_spaces * (depth + 1))
    items = ',\n'.join(f'{pad}{k}: {render(v, depth + 1)}'
                       for k, v in value.items())
    closing = ' ' * (num_spaces * depth)
    return '{\n' + items + ',\n' + closing + '}'

  body = render(x, 0)
  return f'FrozenDict({body})' if isinstance(x, FrozenDict) else body
