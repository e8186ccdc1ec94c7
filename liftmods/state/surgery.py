"""Model surgery on variable trees: get, drop, rename, graft, load.

Paths are ``'/'``-joined strings (``'params/encoder/Dense_0'``) or tuples of
keys; ``''`` / ``()`` is the root. A path names a leaf or a whole sub-tree.
Mappings go from source to destination, ``{from: to}``, everywhere.

The usual fine-tuning move, *insert a layer and keep the rest*: initialize
the new model, then :func:`load` the old variables into it. Leaves at the
same path (after ``mapping``) are loaded, with shape and dtype checked; the
report lists what was loaded, what is new (keeps its fresh init), and what
of the old tree was not used.

>>> import jax.numpy as jnp
>>> from liftmods import state
>>> old = {'params': {'Dense_0': {'w': jnp.ones(2)},
...                   'Dense_1': {'w': jnp.ones(3)}}}
>>> new = {'params': {'Dense_0': {'w': jnp.zeros(2)},
...                   'Dense_1': {'w': jnp.zeros(4)},   # the inserted layer
...                   'Dense_2': {'w': jnp.zeros(3)}}}
>>> merged, report = state.load(new, old, {'params/Dense_1': 'params/Dense_2'})
>>> print(report)
loaded (2): params/Dense_0/w, params/Dense_2/w <- params/Dense_1/w
new (1): params/Dense_1/w
unused (0):
>>> merged['params']['Dense_2']['w']
Array([1., 1., 1.], dtype=float32)
"""
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from liftmods.core.meta import AxisMetadata
from liftmods.state import errors
from liftmods.state.errors import show
from liftmods.state.tree import check_tree, iter_leaves, unflatten


PathLike = str | Sequence[Any]  # 'a/b' or ('a', 'b')


def to_path(path: PathLike) -> tuple:
  """A path as a tuple of keys: ``'a/b'`` -> ``('a', 'b')``.

  Args:
    path: a ``'/'``-joined string, or a tuple or list of keys.

  Returns:
    The tuple of keys.

  Raises:
    StateError: ``path`` is neither.
  """
  if isinstance(path, str):
    return tuple(k for k in path.split('/') if k)
  if isinstance(path, (tuple, list)):
    return tuple(path)
  raise errors.StateError(f'A path is a "/"-joined string or a tuple of keys; '
                          f'got {path!r}.')


def _under(path: tuple, prefix: tuple) -> bool:
  return path[:len(prefix)] == prefix


def _subtree_items(fn: str, flat: dict, prefix: tuple, where: str) -> dict:
  """``{relative_path: leaf}`` of the leaf or sub-tree at ``prefix``."""
  found = {p[len(prefix):]: x for p, x in flat.items() if _under(p, prefix)}
  if not found:
    raise errors.UnknownPathError(fn, prefix, where)
  return found


def get(tree: Mapping, path: PathLike) -> Any:
  """The leaf or sub-tree of ``tree`` at ``path``.

  Args:
    tree: a variable tree.
    path: ``'params/Dense_0'`` or a tuple of keys.

  Returns:
    The leaf or sub-tree.

  Raises:
    UnknownPathError: ``tree`` has nothing at ``path``.
  """
  check_tree('get', tree)
  node = tree
  for i, key in enumerate(to_path(path)):
    if not isinstance(node, Mapping) or key not in node:
      raise errors.UnknownPathError('get', to_path(path)[:i + 1])
    node = node[key]
  return node


def drop(tree: Mapping, *paths: PathLike) -> Mapping:
  """``tree`` without the leaves and sub-trees at ``paths``.

  Args:
    tree: a variable tree.
    *paths: the paths to remove.

  Returns:
    The new tree.

  Raises:
    UnknownPathError: a path is not in ``tree``.
  """
  check_tree('drop', tree)
  flat = dict(iter_leaves(tree))
  for path in map(to_path, paths):
    gone = _subtree_items('drop', flat, path, 'the tree')
    for rel in gone:
      del flat[path + rel]
  return unflatten(flat, like=tree)


def rename(tree: Mapping, mapping: Mapping[PathLike, PathLike]) -> Mapping:
  """Moves sub-trees (or leaves) of ``tree`` to new paths.

  All moves happen at once, so swaps and shifts (``{'Dense_1': 'Dense_2',
  'Dense_2': 'Dense_3'}``) work.

  Args:
    tree: a variable tree.
    mapping: ``{src_path: dst_path}``.

  Returns:
    The new tree.

  Raises:
    UnknownPathError: a source path is not in ``tree``.
    PathExistsError: a destination is occupied by something not moved.
  """
  check_tree('rename', tree)
  flat = dict(iter_leaves(tree))
  moved = []
  for src, dst in ((to_path(s), to_path(d)) for s, d in mapping.items()):
    for rel, leaf in _subtree_items('rename', flat, src, 'the tree').items():
      moved.append((src, dst, dst + rel, leaf))
      del flat[src + rel]
  for src, dst, path, leaf in moved:
    if any(_under(p, path) or _under(path, p) for p in flat):
      raise errors.PathExistsError('rename', src, dst)
    flat[path] = leaf
  return unflatten(flat, like=tree)


def _shape_dtype(leaf):
  if isinstance(leaf, AxisMetadata):
    try:
      leaf = leaf.unbox(apply_constraint=False)  # no sharding op for a look
    except TypeError:
      leaf = leaf.unbox()
  if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
    return tuple(leaf.shape), np.dtype(leaf.dtype)
  arr = np.asarray(leaf)
  return arr.shape, arr.dtype


def _check_same(src_path, src_leaf, dst_path, dst_leaf):
  s_shape, s_dtype = _shape_dtype(src_leaf)
  d_shape, d_dtype = _shape_dtype(dst_leaf)
  if s_shape != d_shape or s_dtype != d_dtype:
    raise errors.GraftShapeError(show(src_path), s_shape, s_dtype,
                                 show(dst_path), d_shape, d_dtype)


def graft(dst: Mapping, src: Mapping,
          mapping: Mapping[PathLike, PathLike] | None = None) -> Mapping:
  """``dst`` with sub-trees of ``src`` copied in.

  Each source sub-tree must have exactly the leaves of its destination,
  with the same shapes and dtypes. For a lenient, reporting version use
  :func:`load`.

  Args:
    dst: the tree to copy into.
    src: the tree to copy from.
    mapping: ``{src_path: dst_path}`` (default ``{'': ''}``: the whole
      tree).

  Returns:
    The new tree.

  Raises:
    UnknownPathError: a path of ``mapping`` is missing from its tree.
    GraftStructureError: the leaves differ (names what is missing on
      either side).
    GraftShapeError: a shape or dtype differs (names both paths and both
      shapes).
  """
  check_tree('graft', dst)
  check_tree('graft', src)
  flat_dst = dict(iter_leaves(dst))
  flat_src = dict(iter_leaves(src))
  for s, d in (mapping or {'': ''}).items():
    s, d = to_path(s), to_path(d)
    part = _subtree_items('graft', flat_src, s, 'the source tree')
    target = _subtree_items('graft', flat_dst, d, 'the destination tree')
    missing = sorted(show(d + r) for r in part.keys() - target.keys())
    extra = sorted(show(d + r) for r in target.keys() - part.keys())
    if missing or extra:
      detail = []
      if missing:
        detail.append(f'the destination has no {", ".join(missing)}')
      if extra:
        detail.append(f'the source has nothing for {", ".join(extra)}')
      raise errors.GraftStructureError(s, d, '; '.join(detail) + '.')
    for rel, leaf in part.items():
      _check_same(s + rel, leaf, d + rel, target[rel])
      flat_dst[d + rel] = leaf
  return unflatten(flat_dst, like=dst)


@dataclasses.dataclass(frozen=True)
class LoadReport:
  """What :func:`load` did, as ``'/'``-joined paths of the new tree.

  Attributes:
    loaded: the leaves that took their value from the old tree.
    new: the leaves that kept the value they had in the new tree.
    unused: the old-tree paths nothing took.
    sources: ``{new path: old path}`` of the loaded leaves that moved.
  """

  loaded: tuple
  new: tuple
  unused: tuple
  sources: Mapping = dataclasses.field(default_factory=dict)

  def __str__(self):
    def line(name, items):
      return f'{name} ({len(items)}): {", ".join(items)}'.rstrip()

    loaded = [p if p not in self.sources else f'{p} <- {self.sources[p]}'
              for p in self.loaded]
    return '\n'.join([line('loaded', loaded), line('new', self.new),
                      line('unused', self.unused)])


def load(new: Mapping, old: Mapping,
         mapping: Mapping[PathLike, PathLike] | None = None
         ) -> tuple[Mapping, LoadReport]:
  """Loads ``old`` into ``new`` where they agree.

  Every old leaf goes to its own path unless ``mapping`` sends it (or
  something else) elsewhere. An old leaf whose destination is a leaf of
  ``new`` replaces it, after a shape and dtype check; the rest of ``new``
  is left as it is.

  Args:
    new: the tree to load into (e.g. a fresh ``init``).
    old: the tree to load from (e.g. a checkpoint).
    mapping: ``{old_path: new_path}`` for sub-trees of ``old`` that moved.

  Returns:
    ``(tree, report)``, with a :class:`LoadReport`.

  Raises:
    UnknownPathError: a path of ``mapping`` is not in ``old``.
    GraftShapeError: a shape or dtype differs (names both paths and both
      shapes).
  """
  check_tree('load', new)
  check_tree('load', old)
  flat_new = dict(iter_leaves(new))
  flat_old = dict(iter_leaves(old))
  source, mapped = {}, set()  # new path -> old path; old paths mapped away
  for s, d in (mapping or {}).items():
    s, d = to_path(s), to_path(d)
    for rel in _subtree_items('load', flat_old, s, 'the old tree'):
      source[d + rel] = s + rel
      mapped.add(s + rel)
  for path in flat_old:
    if path not in mapped:
      source.setdefault(path, path)
  used = set()
  for dst, src in source.items():
    if dst in flat_new:
      _check_same(src, flat_old[src], dst, flat_new[dst])
      flat_new[dst] = flat_old[src]
      used.add(src)
  report = LoadReport(
      loaded=tuple(show(p) for p in flat_new if p in source),
      new=tuple(show(p) for p in flat_new if p not in source),
      unused=tuple(show(p) for p in flat_old if p not in used),
      sources={show(d): show(s) for d, s in source.items()
               if d in flat_new and d != s})
  return unflatten(flat_new, like=new), report
