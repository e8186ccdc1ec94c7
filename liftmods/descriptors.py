"""Descriptors (properties, ``functools.cached_property``, ...) defined in a
Module class are put behind a proxy when the class is created.

Python looks an attribute up in ``Module.__getattr__`` when a descriptor's
getter raises AttributeError, so a bug inside a property would read as "no
attribute named after the property". The proxy raises
``DescriptorAttributeError`` instead, chained to the original error.

>>> import liftmods as nn
>>> class Foo(nn.Module):
...   @property
...   def width(self):
...     return self.missing
>>> try:
...   Foo().width
... except nn.errors.DescriptorAttributeError as e:
...   print(type(e.__cause__).__name__)
AttributeError
"""
from liftmods import errors


def wrap_descriptor(descriptor):
  """``descriptor`` behind a proxy whose ``__get__`` turns an AttributeError
  raised inside the getter into ``DescriptorAttributeError`` (otherwise
  Python would fall back to ``Module.__getattr__`` and report the property
  itself as missing). Data and non-data descriptors stay what they were."""
  if isinstance(descriptor, DescriptorProxy):
    return descriptor
  namespace = {}
  if hasattr(descriptor, '__isabstractmethod__'):
    namespace['__isabstractmethod__'] = descriptor.__isabstractmethod__
  for method in ('__set__', '__delete__', '__set_name__'):
    if hasattr(descriptor, method):
      namespace[method] = _forward(method)
  if hasattr(descriptor, '__get__'):
    namespace['__get__'] = DescriptorProxy._get
  proxy_cls = type('DescriptorProxy', (DescriptorProxy,), namespace)
  return proxy_cls(descriptor)


def _forward(method):

  def forward(self, *args, **kwargs):
    return getattr(self.wrapped, method)(*args, **kwargs)

  forward.__name__ = method
  return forward


class DescriptorProxy:
  """Base of the proxies made by ``wrap_descriptor``."""

  def __init__(self, wrapped):
    self.wrapped = wrapped

  def _get(self, instance, owner=None):
    try:
      return self.wrapped.__get__(instance, owner)
    except AttributeError as e:
      name = getattr(self.wrapped, '__name__', None) or getattr(
          getattr(self.wrapped, 'fget', None), '__name__', '?')
      raise errors.DescriptorAttributeError(
          name, getattr(owner, '__name__', '')) from e

  def __getattr__(self, name):
    if 'wrapped' not in vars(self):
      raise AttributeError(name)
    return getattr(self.wrapped, name)


def local_descriptors(cls, exclude):
  """Names of the descriptors (properties, ...) defined in ``cls`` itself."""
  out = []
  for name, attr in cls.__dict__.items():
    if name in exclude or callable(attr):
      continue
    if isinstance(attr, (staticmethod, classmethod)):
      continue
    if any(hasattr(attr, m) for m in ('__get__', '__set__', '__delete__')):
      out.append(name)
  return out
