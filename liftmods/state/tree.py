"""split / select / merge / update over nested variable trees.

Every function here is pure: it builds new mappings along the paths it
returns and shares the leaves, never writing into its inputs. Nothing looks
at leaf values except the filters, so all of them work inside ``jax.jit``
(filters then see tracers; paths are static). Each node of an output has the
container kind of the input node it comes from, so a FrozenDict comes back
as a FrozenDict and a dict as a dict.

A mapping with no leaves below it holds no variables: outputs never contain
one, so ``merge(*split(v, ...)) == v`` holds for every tree ``v`` without
empty sub-mappings (``init`` never makes any).

>>> import jax.numpy as jnp
>>> from liftmods import state
>>> v = {'params': {'enc': {'kernel': jnp.ones((2, 2))},
...                 'head': {'kernel': jnp.ones((2, 1))}},
...      'batch_stats': {'enc': {'mean': jnp.zeros(2)}}}
>>> head, rest = state.split(v, 'params/head', ...)
>>> state.paths(head)
['params/head/kernel']
>>> state.paths(rest)
['params/enc/kernel', 'batch_stats/enc/mean']
>>> state.merge(head, rest) == v
True
"""
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from liftmods.core.frozen_dict import FrozenDict
from liftmods.state import errors
from liftmods.state.filters import FilterLike, to_predicates

_MISSING = object()


def check_tree(fn: str, tree: Any) -> None:
  """Checks that ``tree`` is a mapping.

  Args:
    fn: the calling function's name, for the message.
    tree: the value to check.

  Raises:
    NotATreeError: ``tree`` is not a mapping.
  """
  if not isinstance(tree, Mapping):
    raise errors.NotATreeError(fn, tree)


def iter_leaves(tree: Mapping,
                prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
  """The leaves of ``tree`` with their paths, depth first in key order.

  Every mapping is descended into; everything else is a leaf.

  Args:
    tree: a variable tree.
    prefix: keys put in front of every path.

  Yields:
    ``(path, leaf)``, ``path`` a tuple of keys.
  """
  for key, value in tree.items():
    path = prefix + (key,)
    if isinstance(value, Mapping):
      yield from iter_leaves(value, path)
    else:
      yield path, value


def flatten(tree: Mapping) -> dict:
  """``{path_tuple: leaf}`` for every leaf of ``tree``.

  Args:
    tree: a variable tree.

  Returns:
    The flat dict, in depth-first key order.

  Raises:
    NotATreeError: ``tree`` is not a mapping.

  >>> from liftmods import state
  >>> state.flatten({'params': {'w': 1, 'sub': {'b': 2}}})
  {('params', 'w'): 1, ('params', 'sub', 'b'): 2}
  """
  check_tree('flatten', tree)
  return dict(iter_leaves(tree))


def paths(tree: Mapping) -> list:
  """The ``'/'``-joined paths of the leaves of ``tree``, in order.

  Args:
    tree: a variable tree.

  Returns:
    The paths, e.g. ``['params/Dense_0/kernel', ...]``.

  Raises:
    NotATreeError: ``tree`` is not a mapping.
  """
  check_tree('paths', tree)
  return [errors.show(p) for p, _ in iter_leaves(tree)]


def _kinds(tree: Mapping, kinds: dict, prefix: tuple = ()) -> dict:
  """Records ``{node_path: container type}`` for every mapping of ``tree``
  whose path is not recorded yet (so the first tree given wins)."""
  kinds.setdefault(prefix, FrozenDict if isinstance(tree, FrozenDict) else dict)
  for key, value in tree.items():
    if isinstance(value, Mapping):
      _kinds(value, kinds, prefix + (key,))
  return kinds


def unflatten(flat: Mapping[tuple, Any] | Iterable[tuple[tuple, Any]],
              like: Mapping | None = None) -> Mapping:
  """The nested tree of a flat ``{path_tuple: leaf}``.

  Args:
    flat: ``{path_tuple: leaf}``, or ``(path_tuple, leaf)`` pairs.
    like: a tree whose nodes give the container kind (FrozenDict or dict)
      of the same nodes of the result (default: dicts).

  Returns:
    The nested tree.

  Raises:
    MergeConflictError: two paths collide (one is a prefix of the other).
  """
  kinds = _kinds(like, {}) if like is not None else {}
  items = flat.items() if isinstance(flat, Mapping) else flat
  return _build(((p, x, 0) for p, x in items), kinds)


def _build(items, kinds: dict):
  """Nests ``(path, leaf, owner)`` items; a path that collides with another
  item's (same path, or one a prefix of the other) is a MergeConflictError
  naming both owners."""
  root, owner_of = {}, {}
  for path, leaf, owner in items:
    node = root
    for i, key in enumerate(path[:-1]):
      child = node.get(key, _MISSING)
      if child is _MISSING:
        child = node[key] = {}
      elif not isinstance(child, dict):
        raise errors.MergeConflictError(path[:i + 1],
                                        owner_of[path[:i + 1]], owner)
      node = child
    key = path[-1]
    if key in node:
      other = node[key]
      first = owner_of.get(path) if not isinstance(other, dict) else (
          _any_owner(other, path, owner_of))
      raise errors.MergeConflictError(path, first, owner)
    node[key] = leaf
    owner_of[path] = owner
  return _finish(root, (), kinds)


def _any_owner(node: dict, prefix: tuple, owner_of: dict):
  for path, _ in iter_leaves(node, prefix):
    return owner_of[path]
  return None


def _finish(node: dict, path: tuple, kinds: dict):
  """Converts the nested dicts to their recorded kinds; a node no input had
  takes the root's kind."""
  out = {k: _finish(v, path + (k,), kinds) if isinstance(v, dict) else v
         for k, v in node.items()}
  if kinds.get(path, kinds.get(())) is FrozenDict:
    return FrozenDict(out, __unsafe_skip_copy__=True)
  return out


def _partition(fn: str, tree: Mapping, filters, drop_rest: bool):
  check_tree(fn, tree)
  preds = to_predicates(filters or (...,))
  buckets = [[] for _ in preds]
  for path, leaf in iter_leaves(tree):
    for i, pred in enumerate(preds):
      if pred(path, leaf):
        buckets[i].append((path, leaf, 0))
        break
    else:
      if not drop_rest:
        raise errors.UnmatchedLeafError(path, preds)
  kinds = _kinds(tree, {})
  out = tuple(_build(b, kinds) for b in buckets)
  return out[0] if len(out) == 1 else out


def split(tree: Mapping, *filters: FilterLike) -> Mapping | tuple:
  """One tree per filter: each leaf goes to the first filter that matches it.

  End with ``...`` to collect the rest.

  Args:
    tree: a variable tree.
    *filters: anything :func:`to_predicate` accepts; a catch-all may only
      be followed by catch-alls.

  Returns:
    With one filter the tree itself, with several a tuple of trees, as
      NNX's ``split`` does; with none, a copy.

  Raises:
    UnmatchedLeafError: a leaf matches no filter.
    FilterOrderError: a catch-all comes before another filter.

  >>> import jax.numpy as jnp
  >>> from liftmods import state
  >>> v = {'params': {'w': jnp.ones(2)}, 'batch_stats': {'m': jnp.ones(2)}}
  >>> params, rest = state.split(v, 'params', ...)
  >>> rest
  {'batch_stats': {'m': Array([1., 1.], dtype=float32)}}
  """
  return _partition('split', tree, filters, drop_rest=False)


def select(tree: Mapping, *filters: FilterLike) -> Mapping | tuple:
  """Like :func:`split`, but leaves that no filter matches are dropped.

  NNX's ``filter_state``.

  Args:
    tree: a variable tree.
    *filters: anything :func:`to_predicate` accepts.

  Returns:
    One tree (one filter) or a tuple of trees.
  """
  return _partition('select', tree, filters, drop_rest=True)


def merge(*trees: Mapping) -> Mapping:
  """The union of disjoint trees: the inverse of :func:`split`.

  To overwrite leaves, use :func:`update`.

  Args:
    *trees: variable trees with no path in common.

  Returns:
    The merged tree, with the root container kind of the first tree.

  Raises:
    StateError: no tree is given.
    MergeConflictError: two trees define one path (the same leaf, or a leaf
      where another has a sub-tree).
  """
  if not trees:
    raise errors.StateError('merge() needs at least one tree.')
  kinds = {}
  for tree in trees:
    check_tree('merge', tree)
    _kinds(tree, kinds)
  items = ((p, x, i) for i, t in enumerate(trees) for p, x in iter_leaves(t))
  return _build(items, kinds)


def update(tree: Mapping, *partials: Mapping) -> Mapping:
  """``tree`` with the leaves of each partial tree put in place of its own.

  Later partials win over earlier ones; use :func:`merge` to add leaves.

  Args:
    tree: a variable tree.
    *partials: trees whose every leaf replaces a leaf of ``tree``.

  Returns:
    The updated tree.

  Raises:
    UnknownPathError: a partial has a path ``tree`` lacks.
  """
  check_tree('update', tree)
  flat = dict(iter_leaves(tree))
  for partial in partials:
    check_tree('update', partial)
    for path, leaf in iter_leaves(partial):
      if path not in flat:
        raise errors.UnknownPathError('update', path,
                                      'the tree being updated')
      flat[path] = leaf
  return _build(((p, x, 0) for p, x in flat.items()), _kinds(tree, {}))
