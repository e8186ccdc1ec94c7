"""Keyword-only dataclass fields (``nn.kw_only_dataclasses``).

``field(kw_only=True, default=...)`` marks a field keyword-only, so a base
class may give a field a default while a subclass adds required fields.
Linen wrote this module for Python versions before 3.10, moving such fields
to the end of the positional parameters; liftmods runs on Python 3.10+ and
uses the dataclasses support directly, so these fields are truly
keyword-only.

>>> import inspect
>>> @dataclass
... class Parent:
...   name: str = field(default='', kw_only=True)
>>> @dataclass
... class Child(Parent):
...   size: float
>>> print(inspect.signature(Child))
(size: float, *, name: str = '') -> None
"""
import dataclasses

__all__ = ['KW_ONLY', 'dataclass', 'field']

KW_ONLY = dataclasses.KW_ONLY


def field(*, metadata=None, kw_only=dataclasses.MISSING, **kwargs):
  """``dataclasses.field``; a keyword-only field must have a default.

  >>> field(kw_only=True)
  Traceback (most recent call last):
  ValueError: Keyword-only fields with no default are not supported.
  """
  if kw_only is not dataclasses.MISSING and kw_only:
    if (kwargs.get('default', dataclasses.MISSING) is dataclasses.MISSING and
        kwargs.get('default_factory', dataclasses.MISSING)
        is dataclasses.MISSING):
      raise ValueError('Keyword-only fields with no default are not '
                       'supported.')
  return dataclasses.field(metadata=metadata, kw_only=kw_only, **kwargs)


def dataclass(cls=None, extra_fields=None, **kwargs):
  """``dataclasses.dataclass`` that first adds ``extra_fields``, a list of
  ``(name, type, dataclasses.Field)``, to the class."""

  def wrap(cls):
    if extra_fields:
      annotations = cls.__dict__.get('__annotations__', {})
      cls.__annotations__ = annotations
      for name, annotation, default in extra_fields:
        if not (isinstance(name, str)
                and isinstance(default, dataclasses.Field)):
          raise ValueError('Expected extra_fields to a be a list of '
                           '(name, type, Field) tuples.')
        setattr(cls, name, default)
        annotations[name] = annotation
    return dataclasses.dataclass(cls, **kwargs)

  return wrap if cls is None else wrap(cls)


# -- the other names of flax.linen.kw_only_dataclasses -------------------------
# Code written for Linen reaches these as attributes of
# flax.linen.kw_only_dataclasses.
# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
import functools
import inspect
import sys
from types import MappingProxyType
from typing import Any, TypeVar
# pylint: enable=g-import-not-at-top,wrong-import-position,unused-import

M = TypeVar('M', bound='liftmods.module.Module')
FieldName = str
Annotation = Any
Default = Any

# Names of flax.linen.kw_only_dataclasses that mean nothing in liftmods, and
# why.
from liftmods import linen_names  # pylint: disable=g-import-not-at-top,wrong-import-position

_LINEN_ONLY = {
    **linen_names.shared('flax', 'tpe'),
}


__getattr__ = linen_names.not_provided(__name__, 'flax.linen.kw_only_dataclasses',
                                        _LINEN_ONLY)
