"""Flattening nested variable dicts, with Linen's ``traverse_util`` names.

>>> flat = flatten_dict({'params': {'Dense_0': {'kernel': 1, 'bias': 2}}})
>>> flat[('params', 'Dense_0', 'kernel')]
1
>>> flatten_dict({'a': {'b': 1}}, sep='/')
{'a/b': 1}
>>> unflatten_dict({'a/b': 1}, sep='/')
{'a': {'b': 1}}
"""
from collections.abc import Mapping


class _EmptyNode:
  """Marks an empty sub-dict kept by ``flatten_dict(keep_empty_nodes=True)``."""

  def __repr__(self):
    return 'empty_node'


empty_node = _EmptyNode()


def flatten_dict(xs, keep_empty_nodes=False, is_leaf=None, sep=None):
  """``{path: leaf}`` for a nested mapping; paths are key tuples, or strings
  joined by ``sep``. ``is_leaf(path, node)`` stops the descent at a node."""
  if not isinstance(xs, Mapping):
    raise TypeError(f'flatten_dict expects a mapping, got {type(xs).__name__}')
  out = {}

  def key(path):
    return sep.join(path) if sep is not None else path

  def walk(node, path):
    leaf = not isinstance(node, Mapping) or (
        is_leaf is not None and is_leaf(path, node))
    if leaf:
      out[key(path)] = node
    elif not node:
      if keep_empty_nodes and path:
        out[key(path)] = empty_node
    else:
      for k, v in node.items():
        walk(v, path + (k,))

  walk(xs, ())
  return out


def unflatten_dict(xs, sep=None):
  """The nested dict of a ``flatten_dict`` result (``empty_node`` -> ``{}``)."""
  out = {}
  for path, value in xs.items():
    if sep is not None:
      path = tuple(path.split(sep))
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = {} if value is empty_node else value
  return out


def path_aware_map(f, nested_dict):
  """Map ``f(path, leaf)`` over a nested dict, keeping its structure.

  ``path`` is the tuple of keys leading to the leaf; empty sub-dicts stay.

  >>> params = {'dense': {'kernel': 2.0, 'bias': 1.0}, 'empty': {}}
  >>> path_aware_map(lambda p, x: 0.0 if p[-1] == 'bias' else x, params)
  {'dense': {'kernel': 2.0, 'bias': 0.0}, 'empty': {}}
  """
  flat = flatten_dict(nested_dict, keep_empty_nodes=True)
  return unflatten_dict({path: value if value is empty_node else f(path, value)
                         for path, value in flat.items()})
