"""Errors raised by ``liftmods.state``, one class per mistake.

Every class derives from :class:`liftmods.errors.LiftmodsError`; those that
NNX raises as ``ValueError`` / ``TypeError`` derive from that builtin too, so
``except ValueError`` written for NNX's ``split`` still catches them.
Paths in messages are ``'/'``-joined, with ``'/'`` for the root.

>>> from liftmods.state import errors
>>> err = errors.GraftShapeError('backbone/kernel', (3, 4), 'float32',
...                              'encoder/kernel', (3, 5), 'float32')
>>> print(err)  # doctest: +NORMALIZE_WHITESPACE
Cannot graft backbone/kernel (shape (3, 4), float32) onto encoder/kernel
(shape (3, 5), float32): shapes differ. (see docs/state.md#errors)
"""
from liftmods.errors import LiftmodsError


def show(path) -> str:
  """A path tuple (or string) as ``'a/b/c'``; ``'/'`` for the root."""
  if isinstance(path, str):
    return path or '/'
  return '/'.join(str(k) for k in path) or '/'


class StateError(LiftmodsError):
  """Base class of the errors of ``liftmods.state``."""

  docs_link = 'docs/state.md#errors'


class NotATreeError(StateError, TypeError):
  """Something other than a variable tree (dict or FrozenDict) was passed."""

  def __init__(self, fn, got):
    hint = ''
    if hasattr(got, 'scope') and hasattr(got, 'init'):
      hint = (' To read the variables of a bound module use '
              'state_of(module, ...).')
    super().__init__(f'{fn}() expects a variable tree (a dict or FrozenDict of '
                     f'nested dicts), got {type(got).__name__}.{hint}')


class InvalidFilterError(StateError, TypeError):
  """Something that is not a filter was passed where a filter is expected."""

  def __init__(self, got):
    super().__init__(
        'A state filter must be a string (path glob), a type, a callable '
        '(path, leaf) -> bool, True/False/.../None, a list or tuple of '
        f'filters, or a liftmods.state filter; got {got!r}.')


class FilterOrderError(StateError, ValueError):
  """A catch-all filter is followed by filters that could never match."""

  def __init__(self, index, filters):
    super().__init__(
        f'Filter {index} ({filters[index]!r}) matches every leaf, so the '
        f'filters after it ({", ".join(map(repr, filters[index + 1:]))}) '
        'would receive nothing. Put the catch-all (... or True) last.')


class UnmatchedLeafError(StateError, ValueError):
  """A leaf matches none of the filters given to ``split``."""

  def __init__(self, path, filters):
    super().__init__(
        f'Non-exhaustive filters: the leaf at {show(path)} matches none of '
        f'{", ".join(map(repr, filters))}. Add a last filter ... (Everything) '
        'to collect the remaining leaves.')


class MergeConflictError(StateError, ValueError):
  """Two trees given to ``merge`` hold a leaf at the same path."""

  def __init__(self, path, first, second):
    super().__init__(
        f'merge(): the trees at positions {first} and {second} both define '
        f'{show(path)}. The '
        'trees to merge must be disjoint; use update() to overwrite leaves.')


class UnknownPathError(StateError, KeyError):
  """A path names no leaf or sub-tree of the tree it is applied to."""

  def __init__(self, fn, path, where='the tree'):
    self.message = (f'{fn}(): {show(path)} is not in {where}.')
    super().__init__(self.message)

  def __str__(self):
    return self.message


class PathExistsError(StateError, ValueError):
  """A move or graft target already holds something it would overwrite."""

  def __init__(self, fn, src, dst):
    super().__init__(
        f'{fn}(): cannot move {show(src)} to {show(dst)}: {show(dst)} already '
        'exists. Drop it first, or graft onto it.')


class GraftStructureError(StateError, ValueError):
  """A grafted sub-tree does not have the structure of its destination."""

  def __init__(self, src, dst, detail):
    super().__init__(f'Cannot graft {show(src)} onto {show(dst)}: {detail}')


class GraftShapeError(StateError, ValueError):
  """A grafted leaf has another shape or dtype than the leaf it replaces."""

  def __init__(self, src, src_shape, src_dtype, dst, dst_shape, dst_dtype):
    what = 'shapes differ' if tuple(src_shape) != tuple(dst_shape) else (
        'dtypes differ')
    super().__init__(
        f'Cannot graft {show(src)} (shape {tuple(src_shape)}, {src_dtype}) '
        f'onto {show(dst)} (shape {tuple(dst_shape)}, {dst_dtype}): {what}.')


class UnresolvedModuleFilterError(StateError, ValueError):
  """A module-type filter is used without the model that defines the types."""

  def __init__(self, filt):
    super().__init__(
        f'{filt!r} selects leaves by the type of the module that owns them, '
        'which only a model knows. Use state_of(bound_model, ...), or pass '
        'modules=bound_model (or modules=module_types(...)) to InModule.')


class UnknownModuleError(StateError, ValueError):
  """Module types are asked for a sub-tree whose module was never created."""

  def __init__(self, path, leaf_path):
    super().__init__(
        f'No module is known at {show(path)}, which holds {show(leaf_path)}: '
        'the bound model creates @compact submodules only when it is '
        'called. Call the bound model once, or pass '
        'modules=module_types(bound_model, *example_inputs).')
