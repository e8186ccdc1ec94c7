"""Filters pick leaves of a variable tree by path, value or owning module.

A filter is a predicate ``(path, leaf) -> bool``. ``path`` is the tuple of
keys from the root of the tree being filtered to the leaf: for a full
variables dict it starts with the collection (``('params', 'encoder',
'kernel')``), for a params tree with the top-level submodule. A *leaf* is
whatever is stored below the last mapping: an array, a boxed value
(``nn.Partitioned``), a tuple of sown values.

Anything :func:`to_predicate` accepts may be passed as a filter:

* a string is a **path glob** matched against the ``'/'``-joined path. It
  selects every leaf *at or below* a path it matches, so ``'params'`` is the
  whole params collection and ``'params/encoder'`` the encoder's sub-tree.
  ``*`` matches within one key, ``**`` any number of keys (zero included),
  ``?`` and ``[...]`` one character (see :class:`Path`);
* a type: a :class:`~liftmods.Module` subclass selects the leaves owned by
  modules of that type (:class:`InModule`); any other type selects leaves
  that are instances of it (:class:`OfType`, e.g. ``nn.Partitioned``);
* ``True`` / ``...`` select everything, ``False`` / ``None`` nothing;
* a list or tuple is :class:`Any` of its items;
* a callable is used as the predicate itself.

These are NNX's rules, with one difference forced by the tree: NNX matches a
string against a Variable's *tag*; here the collection plays that role, and
it is the first key of the path, so a string matches it as a glob.

>>> from liftmods import state
>>> p = ('params', 'encoder', 'Dense_0', 'kernel')
>>> state.to_predicate('params')(p, None)
True
>>> state.to_predicate('params/encoder/**/kernel')(p, None)
True
>>> state.to_predicate('encoder/**')(p, None)  # globs are anchored at the root
False
>>> (state.Path('*/encoder') & ~state.PathContains('bias'))(p, None)
True
"""
import dataclasses
import fnmatch
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any as AnyType

from liftmods.module import Module
from liftmods.state import errors

Predicate = Callable[[tuple, AnyType], bool]
# Anything to_predicate accepts: a Filter, a path glob, a compiled regex, a
# type, True/False/None/..., a list or tuple of those, or a predicate.
FilterLike = AnyType


class Filter:
  """Base of the filter classes: callable, combinable with ``& | ~``."""

  def __call__(self, path: tuple, leaf) -> bool:
    raise NotImplementedError

  def __and__(self, other):
    return All(self, other)

  def __or__(self, other):
    return Any(self, other)

  def __invert__(self):
    return Not(self)

  def resolve(self, modules) -> 'Filter':
    """This filter with every :class:`InModule` inside bound to ``modules``."""
    del modules
    return self


@dataclasses.dataclass(frozen=True, repr=False)
class Everything(Filter):
  """Matches every leaf (NNX's ``Everything``; also ``True`` and ``...``)."""

  def __call__(self, path, leaf):
    return True

  def __repr__(self):
    return 'Everything()'


@dataclasses.dataclass(frozen=True, repr=False)
class Nothing(Filter):
  """Matches no leaf (NNX's ``Nothing``; also ``False`` and ``None``)."""

  def __call__(self, path, leaf):
    return False

  def __repr__(self):
    return 'Nothing()'


class _Combinator(Filter):

  def __init__(self, *filters: FilterLike):
    self.predicates = tuple(to_predicate(f) for f in filters)

  def __eq__(self, other):
    return type(self) is type(other) and self.predicates == other.predicates

  def __hash__(self):
    return hash((type(self), self.predicates))

  def __repr__(self):
    return f'{type(self).__name__}({", ".join(map(repr, self.predicates))})'

  def resolve(self, modules):
    return type(self)(*(_resolve(p, modules) for p in self.predicates))


class Any(_Combinator):
  """Matches a leaf that at least one of the filters matches.

  Args:
    *filters: the filters (anything :func:`to_predicate` accepts).
  """

  def __call__(self, path, leaf):
    return any(p(path, leaf) for p in self.predicates)


class All(_Combinator):
  """Matches a leaf that every one of the filters matches.

  Args:
    *filters: the filters (anything :func:`to_predicate` accepts).
  """

  def __call__(self, path, leaf):
    return all(p(path, leaf) for p in self.predicates)


class Not(Filter):
  """Matches a leaf that ``filter_like`` does not match.

  Args:
    filter_like: the filter to negate (anything :func:`to_predicate`
      accepts).
  """

  def __init__(self, filter_like: FilterLike, /):
    self.predicate = to_predicate(filter_like)

  def __call__(self, path, leaf):
    return not self.predicate(path, leaf)

  def __eq__(self, other):
    return isinstance(other, Not) and self.predicate == other.predicate

  def __hash__(self):
    return hash((Not, self.predicate))

  def __repr__(self):
    return f'Not({self.predicate!r})'

  def resolve(self, modules):
    return Not(_resolve(self.predicate, modules))


@dataclasses.dataclass(frozen=True, init=False)
class Collection(Filter):
  """Matches the leaves whose first path key is one of ``names``.

  In a full ``{collection: ...}`` variables tree, that key is the
  collection.

  Args:
    *names: the collection names.
  """

  names: frozenset

  def __init__(self, *names: str):
    object.__setattr__(self, 'names', frozenset(names))

  def __call__(self, path, leaf):
    return bool(path) and path[0] in self.names

  def __repr__(self):
    return f'Collection({", ".join(map(repr, sorted(self.names)))})'


@dataclasses.dataclass(frozen=True)
class Path(Filter):
  """Matches the leaves at or below a path that ``pattern`` matches.

  The pattern is split at ``'/'`` and matched key by key against the path
  from the root: ``**`` matches any number of keys (zero included); any
  other pattern key is an ``fnmatch`` pattern for exactly one key (``*``,
  ``?``, ``[seq]``). ``'params/**/kernel'`` is every kernel of the params
  collection; ``'params/Dense_*'`` every sub-tree of a top-level Dense.

  Attributes:
    pattern: the glob.

  Raises:
    InvalidFilterError: ``pattern`` is not a non-empty string.
  """

  pattern: str

  def __post_init__(self):
    if not isinstance(self.pattern, str) or not self.pattern.strip('/'):
      raise errors.InvalidFilterError(self.pattern)

  @functools.cached_property
  def _keys(self) -> tuple:
    return tuple(self.pattern.strip('/').split('/'))

  def __call__(self, path, leaf):
    return _glob_prefix_match(self._keys, tuple(str(k) for k in path))


def _glob_prefix_match(pattern: tuple, keys: tuple) -> bool:
  """Whether some prefix of ``keys`` matches ``pattern`` key by key, ``**``
  spanning any number of keys."""
  ends = [0]  # where the pattern read so far can end in keys, ascending
  for glob in pattern:
    if glob == '**':
      ends = range(ends[0], len(keys) + 1)
    else:
      ends = [j + 1 for j in ends
              if j < len(keys) and fnmatch.fnmatchcase(keys[j], glob)]
    if not ends:
      return False
  return True


@dataclasses.dataclass(frozen=True)
class PathRegex(Filter):
  """Matches the leaves whose ``'/'``-joined path ``re.fullmatch``-es
  ``regex`` (a string or compiled pattern). Unlike :class:`Path` it sees the
  leaf's full path only: ``'params/encoder/.*'`` for a sub-tree.

  Attributes:
    regex: the regular expression, a string or compiled pattern.
  """

  regex: AnyType

  @functools.cached_property
  def _compiled(self):
    return re.compile(self.regex)

  def __call__(self, path, leaf):
    return self._compiled.fullmatch('/'.join(str(k) for k in path)) is not None


@dataclasses.dataclass(frozen=True)
class PathContains(Filter):
  """Matches the leaves with ``key`` among their path keys (NNX's ``PathContains``).

  Attributes:
    key: the key to look for.
    exact: match whole keys; False matches keys whose text contains
      ``key``'s.
  """

  key: AnyType
  exact: bool = True

  def __call__(self, path, leaf):
    if self.exact:
      return self.key in path
    return any(str(self.key) in str(k) for k in path)


@dataclasses.dataclass(frozen=True)
class OfType(Filter):
  """Matches the leaves that are instances of ``type`` (NNX's ``OfType``).

  Attributes:
    type: the leaf type, e.g. ``nn.Partitioned``.
  """

  type: type

  def __call__(self, path, leaf):
    return isinstance(leaf, self.type)


class InModule(Filter):
  """Matches the leaves owned by a module of one of ``types``, directly or
  through its submodules.

  Which module owns a path is known only to a model: ``modules`` is a bound
  module, or a ``{module_path: type}`` mapping from :func:`module_types`.
  Without it, the filter must be resolved by :func:`state_of` (which knows
  the model) before it is used. The module path of a leaf is its path minus
  the variable name and minus a leading collection key, so the filter works
  on full variables trees and on params trees alike (a first key that names
  a top-level submodule is taken as that submodule).

  Args:
    *types: Module classes; subclasses match too.
    modules: a bound module or a ``{module_path: type}`` mapping (None:
      resolve later).

  Raises:
    InvalidFilterError: no types, or one that is not a class.
  """

  def __init__(self, *types: type, modules: AnyType = None):
    if not types or not all(isinstance(t, type) for t in types):
      raise errors.InvalidFilterError(types)
    self.types = types
    self.modules = None if modules is None else _module_map(modules)

  def __call__(self, path, leaf):
    if self.modules is None:
      raise errors.UnresolvedModuleFilterError(self)
    mpath = tuple(path[:-1])
    if mpath and (mpath[0],) not in self.modules:
      mpath = mpath[1:]
    for n in range(len(mpath) + 1):
      cls = self.modules.get(mpath[:n])
      if cls is not None and issubclass(cls, self.types):
        return True
    return False

  def resolve(self, modules):
    if self.modules is not None:
      return self
    return InModule(*self.types, modules=modules)

  def __eq__(self, other):
    return (isinstance(other, InModule) and self.types == other.types
            and self.modules == other.modules)

  def __hash__(self):
    return hash((InModule, self.types))

  def __repr__(self):
    names = ', '.join(t.__name__ for t in self.types)
    return f'InModule({names}{"" if self.modules is None else ", <resolved>"})'


# Reads a bound model's ``{module_path: type}``: ``state.modules`` (the part
# of this package that knows Modules) installs it when it loads, which
# importing ``liftmods.state`` always does, so these pure predicates need not
# import it back.
_model_reader: Callable[[AnyType], Mapping] | None = None


def set_model_reader(reader: Callable[[AnyType], Mapping]) -> None:
  """Sets how :class:`InModule` and :func:`resolve` read a bound model.

  Args:
    reader: maps a bound model given as ``modules`` to its
      ``{module_path: type}`` mapping.
  """
  global _model_reader
  _model_reader = reader


def _module_map(modules) -> Mapping:
  if isinstance(modules, Mapping):
    return dict(modules)
  return _model_reader(modules)


def _resolve(pred, modules):
  return pred.resolve(modules) if isinstance(pred, Filter) else pred


def resolve(filter_like: FilterLike, modules: AnyType) -> Predicate:
  """``filter_like`` as a predicate, its :class:`InModule` parts bound.

  Args:
    filter_like: anything :func:`to_predicate` accepts.
    modules: a bound module or a ``{module_path: type}`` mapping.

  Returns:
    The predicate ``(path, leaf) -> bool``.
  """
  return _resolve(to_predicate(filter_like), modules)


def needs_modules(filter_like: FilterLike) -> bool:
  """Whether ``filter_like`` holds an :class:`InModule` not yet resolved.

  Args:
    filter_like: anything :func:`to_predicate` accepts.

  Returns:
    True when it must be resolved against a model first.
  """
  pred = to_predicate(filter_like)
  if isinstance(pred, InModule):
    return pred.modules is None
  if isinstance(pred, _Combinator):
    return any(needs_modules(p) for p in pred.predicates)
  if isinstance(pred, Not):
    return needs_modules(pred.predicate)
  return False


def to_predicate(filter_like: FilterLike) -> Predicate:
  """The predicate for anything usable as a filter (see the module doc).

  Args:
    filter_like: a Filter, a path glob, a compiled regex, a type,
      True/False/None/``...``, a list or tuple of those, or a callable
      ``(path, leaf) -> bool``.

  Returns:
    The predicate ``(path, leaf) -> bool``.

  Raises:
    InvalidFilterError: ``filter_like`` is none of those.
  """
  if isinstance(filter_like, Filter):
    return filter_like
  if isinstance(filter_like, str):
    return Path(filter_like)
  if isinstance(filter_like, re.Pattern):
    return PathRegex(filter_like)
  if isinstance(filter_like, type):
    if issubclass(filter_like, Module):
      return InModule(filter_like)
    return OfType(filter_like)
  if filter_like is True or filter_like is Ellipsis:
    return Everything()
  if filter_like is False or filter_like is None:
    return Nothing()
  if isinstance(filter_like, (list, tuple)):
    return Any(*filter_like)
  if callable(filter_like):
    return filter_like
  raise errors.InvalidFilterError(filter_like)


def to_predicates(filters: Sequence[FilterLike]) -> tuple:
  """Predicates for ``filters``, in order.

  Args:
    filters: anything :func:`to_predicate` accepts, each.

  Returns:
    The predicates.

  Raises:
    FilterOrderError: a catch-all is followed by something else (as in
      NNX).
  """
  preds = tuple(to_predicate(f) for f in filters)
  for i, p in enumerate(preds):
    if isinstance(p, Everything) and not all(
        isinstance(q, Everything) for q in preds[i + 1:]):
      raise errors.FilterOrderError(i, preds)
  return preds
