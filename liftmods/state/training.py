"""Partial training: optax masks and labels from filters, gradients of a part.

optax is not imported here: :func:`mask` and :func:`labels` build the plain
trees that ``optax.masked`` and ``optax.multi_transform`` take.

To freeze part of a model, give the frozen leaves ``optax.set_to_zero()``.
(``optax.masked(tx, mask)`` alone does *not* freeze: it passes the
masked-out gradients through unchanged, so an ``apply_updates`` would still
move those leaves.)

>>> import jax, jax.numpy as jnp, optax
>>> from liftmods import state
>>> params = {'encoder': {'w': jnp.ones(2)}, 'head': {'w': jnp.ones(2)}}
>>> tx = optax.multi_transform(
...     {'train': optax.sgd(0.1), 'frozen': optax.set_to_zero()},
...     state.labels(params, {'frozen': 'encoder', 'train': ...}))
>>> grads = jax.tree_util.tree_map(jnp.ones_like, params)
>>> updates, _ = tx.update(grads, tx.init(params), params)
>>> new = optax.apply_updates(params, updates)
>>> new['encoder']['w'], new['head']['w']
(Array([1., 1.], dtype=float32), Array([0.9, 0.9], dtype=float32))
"""
from collections.abc import Mapping
from typing import Callable

import jax

from liftmods.state import errors
from liftmods.state.filters import FilterLike, to_predicate, to_predicates
from liftmods.state.tree import (check_tree, iter_leaves, merge, split,
                                 unflatten)


def mask(tree: Mapping, *filters: FilterLike) -> Mapping:
  """The ``mask`` of ``optax.masked``: True at the leaves any filter matches.

  Args:
    tree: a variable tree.
    *filters: anything :func:`to_predicate` accepts.

  Returns:
    A tree like ``tree`` with ``True`` at the matched leaves and ``False``
      elsewhere.

  >>> from liftmods import state
  >>> state.mask({'enc': {'w': 1}, 'head': {'w': 2}}, 'head')
  {'enc': {'w': False}, 'head': {'w': True}}
  """
  check_tree('mask', tree)
  preds = tuple(to_predicate(f) for f in filters)
  items = ((p, any(f(p, x) for f in preds)) for p, x in iter_leaves(tree))
  return unflatten(items, like=tree)


def labels(tree: Mapping, spec: Mapping[str, FilterLike]) -> Mapping:
  """The ``param_labels`` of ``optax.multi_transform``, from filters.

  Args:
    tree: a variable tree.
    spec: ``{label: filter}``; the first (in order) whose filter matches a
      leaf labels it. End it with a ``...`` filter to label the rest.

  Returns:
    A tree like ``tree`` with a label at each leaf.

  Raises:
    StateError: ``spec`` is not a non-empty mapping.
    UnmatchedLeafError: a leaf matches no filter.
  """
  check_tree('labels', tree)
  if not isinstance(spec, Mapping) or not spec:
    raise errors.StateError('labels() takes a non-empty {label: filter} '
                            f'mapping; got {spec!r}.')
  names = tuple(spec)
  preds = to_predicates(tuple(spec.values()))

  def label(path, leaf):
    for name, pred in zip(names, preds):
      if pred(path, leaf):
        return name
    raise errors.UnmatchedLeafError(path, preds)

  items = ((p, label(p, x)) for p, x in iter_leaves(tree))
  return unflatten(items, like=tree)


def value_and_grad(fn: Callable, wrt: FilterLike, *, argnums: int = 0,
                   has_aux: bool = False) -> Callable:
  """``jax.value_and_grad`` of ``fn`` with respect to part of a variable tree.

  The tree is split, differentiated with respect to the selected part, and
  merged back with the rest inside; no gradient is computed for the other
  leaves.

  Args:
    fn: the function; its ``argnums`` argument is a variable tree.
    wrt: the filter of the leaves to differentiate with respect to.
    argnums: the position of the tree among ``fn``'s arguments.
    has_aux: ``fn`` returns ``(value, aux)``.

  Returns:
    A function of ``fn``'s arguments returning ``(value, grads)``
      (``((value, aux), grads)`` with ``has_aux``), ``grads`` holding only
      the selected leaves. It raises ``StateError`` when given fewer than
      ``argnums + 1`` positional arguments.

  >>> import jax.numpy as jnp
  >>> from liftmods import state
  >>> v = {'params': {'a': jnp.float32(2), 'b': jnp.float32(3)}}
  >>> loss = lambda v: v['params']['a'] * v['params']['b']
  >>> state.value_and_grad(loss, 'params/b')(v)
  (Array(6., dtype=float32), {'params': {'b': Array(2., dtype=float32)}})
  """
  wrt = to_predicate(wrt)

  def wrapped(*args, **kwargs):
    if len(args) <= argnums:
      raise errors.StateError(
          f'value_and_grad: argnums={argnums} but only {len(args)} '
          'positional arguments were given.')
    part, rest = split(args[argnums], wrt, ...)

    def on_part(part):
      merged = merge(part, rest)
      return fn(*args[:argnums], merged, *args[argnums + 1:], **kwargs)

    return jax.value_and_grad(on_part, has_aux=has_aux)(part)

  return wrapped


def grad(fn: Callable, wrt: FilterLike, *, argnums: int = 0,
         has_aux: bool = False) -> Callable:
  """Like :func:`value_and_grad`, but the function returns only gradients.

  Args:
    fn: the function; its ``argnums`` argument is a variable tree.
    wrt: the filter of the leaves to differentiate with respect to.
    argnums: the position of the tree among ``fn``'s arguments.
    has_aux: ``fn`` returns ``(value, aux)``.

  Returns:
    A function returning ``grads`` (``(grads, aux)`` with ``has_aux``).
  """
  vg = value_and_grad(fn, wrt, argnums=argnums, has_aux=has_aux)

  def wrapped(*args, **kwargs):
    value, grads = vg(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return wrapped
