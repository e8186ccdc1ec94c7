"""Filters select collections (or rng sequence names) by name.

A filter is ``True`` (all), ``False`` (none), a name, a sequence of names, or
``DenyList(filter)`` (all but those).

>>> from liftmods.core.filters import DenyList, in_filter, intersect, subtract
>>> in_filter(['params', 'batch_stats'], 'params')
True
>>> in_filter(DenyList('intermediates'), 'intermediates')
False
>>> sorted(intersect(True, ['a', 'b']))
['a', 'b']
>>> subtract(True, 'params')
DenyList(deny='params')
"""
import abc
import dataclasses
from collections.abc import Iterable
from typing import Any

from liftmods import errors

Filter = Any  # bool | str | Iterable[str] | DenyList


@dataclasses.dataclass(frozen=True)
class DenyList(metaclass=abc.ABCMeta):
  """Matches every name that ``deny`` does not match.

  Under liftmods.compat ``flax.core`` stays flax's, and Linen's API takes
  its ``flax.core.scope.DenyList`` (keras' ``FlaxLayer`` passes one as
  ``mutable``): a class named ``DenyList`` with a ``deny`` dataclass field is
  an instance here too (``isinstance`` says so), without importing flax.

  Attributes:
    deny: the filter of the names not matched.
  """

  deny: Filter

  @classmethod
  def __subclasshook__(cls, other):
    if cls is DenyList and other.__name__ == 'DenyList' and 'deny' in getattr(
        other, '__dataclass_fields__', {}):
      return True
    return NotImplemented


def in_filter(filter_like: Filter, name: str) -> bool:
  """Whether ``name`` is selected by ``filter_like``.

  Args:
    filter_like: a filter.
    name: a collection or rng sequence name.

  Returns:
    True when selected.

  Raises:
    InvalidFilterError: ``filter_like`` is not a filter.
  """
  if filter_like is True or filter_like is False:
    return filter_like
  if isinstance(filter_like, str):
    return name == filter_like
  if isinstance(filter_like, DenyList):
    return not in_filter(filter_like.deny, name)
  if isinstance(filter_like, Iterable):
    return name in filter_like
  raise errors.InvalidFilterError(filter_like)


def filter_to_set(filter_like: Filter) -> set:
  """The finite set of names an explicit (non-DenyList) filter selects.

  Args:
    filter_like: False, a name or a collection of names.

  Returns:
    The names.

  Raises:
    ValueError: the filter is True or a DenyList (an open set).
    InvalidFilterError: ``filter_like`` is not a filter.
  """
  if filter_like is True or isinstance(filter_like, DenyList):
    raise ValueError(f'filter {filter_like!r} selects an open set of names')
  if filter_like is False:
    return set()
  if isinstance(filter_like, str):
    return {filter_like}
  if isinstance(filter_like, Iterable):
    return set(filter_like)
  raise errors.InvalidFilterError(filter_like)


def _is_open(f: Filter) -> bool:
  return f is True or isinstance(f, DenyList)


def _deny_set(f: Filter) -> set:
  return set() if f is True else filter_to_set(f.deny)


def union(a: Filter, b: Filter) -> Filter:
  """A filter matching what ``a`` or ``b`` matches.

  Args:
    a: a filter.
    b: a filter.

  Returns:
    The union.
  """
  if a is True or b is True:
    return True
  if a is False:
    return b
  if b is False:
    return a
  if _is_open(a) and _is_open(b):
    return _make_deny(_deny_set(a) & _deny_set(b))
  if _is_open(a):
    return _make_deny(_deny_set(a) - filter_to_set(b))
  if _is_open(b):
    return _make_deny(_deny_set(b) - filter_to_set(a))
  return filter_to_set(a) | filter_to_set(b)


def intersect(a: Filter, b: Filter) -> Filter:
  """A filter matching what both ``a`` and ``b`` match.

  Args:
    a: a filter.
    b: a filter.

  Returns:
    The intersection.
  """
  if a is False or b is False:
    return False
  if a is True:
    return b
  if b is True:
    return a
  if _is_open(a) and _is_open(b):
    return _make_deny(_deny_set(a) | _deny_set(b))
  if _is_open(a):
    return filter_to_set(b) - _deny_set(a)
  if _is_open(b):
    return filter_to_set(a) - _deny_set(b)
  return filter_to_set(a) & filter_to_set(b)


def subtract(a: Filter, b: Filter) -> Filter:
  """A filter matching what ``a`` matches and ``b`` does not.

  Args:
    a: a filter.
    b: a filter.

  Returns:
    The difference.
  """
  if b is True or a is False:
    return False
  if b is False:
    return a
  if _is_open(b):
    return intersect(a, _deny_set(b))
  if a is True:
    return DenyList(b)
  if isinstance(a, DenyList):
    return _make_deny(_deny_set(a) | filter_to_set(b))
  return filter_to_set(a) - filter_to_set(b)


def _make_deny(names: set) -> Filter:
  return DenyList(names) if names else True


def is_empty(filter_like: Filter) -> bool:
  """Whether the filter certainly matches no name.

  Args:
    filter_like: a filter.

  Returns:
    True when it matches nothing.
  """
  if filter_like is False:
    return True
  if _is_open(filter_like):
    return False
  return not filter_to_set(filter_like)
