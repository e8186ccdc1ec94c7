"""Carrying scopes across a JAX transform boundary.

A scope function ``fn(scope, *args)`` reads and writes variables through its
scope, so it is not a pure function and cannot be handed to ``jax.vmap`` or
``jax.lax.scan`` directly. ``pack`` turns it into one: it pulls the variables
and PRNG keys of the scope(s) out into plain pytrees ("groups"), lets the
transform carry those groups across the JAX boundary, rebuilds scopes on the
inside (``make_scopes``), collects what the inside wrote (``repack_fn``) and
writes the mutable part back into the outer scopes.

Variable groups are tuples (one entry per collection filter) of tuples (one
entry per distinct outer scope) of ``{collection: variables}`` dicts. RNG
groups have the same layout with ``{sequence_name: key}`` dicts holding plain
JAX keys; the static part of each sequence (the scope names folded into it
lazily) stays outside the transform and is re-attached by ``make_scopes``.

Also here: the axis markers of ``variable_axes`` (``In``, ``Out``,
``broadcast``), the checks that mapped variables have the expected axis
size, and the inference of that size from the inputs.
"""
import dataclasses
import functools
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Generic, Sequence, TypeVar

import jax
import numpy as np
from jax import random

from liftmods import errors
from liftmods.core.filters import in_filter, intersect, union
from liftmods.core.rngs import LazyKey
from liftmods.core.scope import Scope

T = TypeVar('T')


# -- axis markers ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class In(Generic[T]):
  """In ``variable_axes``: the collection enters the transform on ``axis``
  but whatever the body writes to it is dropped."""

  axis: T


@dataclasses.dataclass(frozen=True)
class Out(Generic[T]):
  """In ``variable_axes``: the collection is not passed in, only what the
  body creates in it comes out, stacked on ``axis``."""

  axis: T


class _Broadcast:
  """Marks a scan input/output that is the same for every iteration."""

  __slots__ = ()

  def __repr__(self):
    return 'broadcast'

  def __reduce__(self):
    return 'broadcast'


broadcast = _Broadcast()


def split_in_out_axes(variable_axes: Mapping):
  ins, outs = {}, {}
  for col_filter, axis in variable_axes.items():
    if isinstance(axis, In):
      ins[col_filter] = axis.axis
    elif isinstance(axis, Out):
      outs[col_filter] = axis.axis
    else:
      ins[col_filter] = outs[col_filter] = axis
  return ins, outs


def unzip2(pairs):
  pairs = tuple(pairs)
  if not pairs:
    return (), ()
  firsts, seconds = zip(*pairs)
  return tuple(firsts), tuple(seconds)


# -- small helpers --------------------------------------------------------------


def thaw(tree):
  """A copy of the dict skeleton of ``tree`` (leaves shared), FrozenDicts
  turned into dicts, so that an inner scope can write without touching it."""
  if isinstance(tree, Mapping):
    return {k: thaw(v) for k, v in tree.items()}
  return tree


def _group(mapping: Mapping, filters: tuple) -> list:
  """Splits ``mapping`` by the first filter each key matches (others drop)."""
  groups = [{} for _ in filters]
  for key, value in mapping.items():
    for i, f in enumerate(filters):
      if in_filter(f, key):
        groups[i][key] = value
        break
  return groups


def _scope_identity(scope: Scope):
  """Two Scope objects at the same place of the same store are one scope."""
  return (id(scope.root._variables), scope.path, id(scope.rng_counters))


def _merge_into(target: dict, name, value):
  """``target[name] = value`` that keeps existing child dicts (other scopes
  may hold references to them) and updates them in place instead."""
  old = target.get(name)
  if isinstance(old, dict) and isinstance(value, Mapping):
    for k, v in value.items():
      _merge_into(old, k, v)
  else:
    target[name] = value


def shape_of(x):
  shape = getattr(x, 'shape', None)
  return tuple(shape) if shape is not None else np.shape(x)


def typeof(x):
  try:
    return jax.typeof(x)
  except TypeError:
    return None


def describe_aval(aval) -> str:
  if aval is None:
    return 'a non-array value'
  return f'{aval.dtype}{list(aval.shape)}'


def var_name(path) -> str:
  """'Dense_0/kernel' from a key path into a collection."""
  parts = []
  for key in path:
    for attr in ('key', 'idx', 'name'):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return '/'.join(parts) if parts else '<collection>'


# -- pack -------------------------------------------------------------------------


class Packing:
  """One crossing of a transform boundary by a tree of scopes."""

  __slots__ = ('scopes', 'treedef', 'links', 'out_filters', 'out_union',
               'kind', 'rng_suffixes')

  def __init__(self, scope_tree, out_filters, out_union, kind):
    self.out_filters = out_filters
    self.out_union = out_union
    self.kind = kind
    if isinstance(scope_tree, Scope):
      scope_tree._check_valid()
      self.scopes = (scope_tree,)
      self.treedef = None
      self.links = ((0, ()),)
    elif (type(scope_tree) is list and len(scope_tree) == 1  # pylint: disable=unidiomatic-typecheck
          and isinstance(scope_tree[0], Scope)):
      # A module's own scope, as lifted transforms pass it: no walk needed.
      scope_tree[0]._check_valid()
      self.scopes = (scope_tree[0],)
      self.treedef = _ONE_SCOPE_LIST
      self.links = ((0, ()),)
    else:
      leaves, self.treedef = jax.tree_util.tree_flatten(
          scope_tree, is_leaf=lambda x: isinstance(x, Scope))
      for leaf in leaves:
        if not isinstance(leaf, Scope):
          raise TypeError(f'{kind}: expected a Scope or a pytree of Scopes, '
                          f'found a leaf of type {type(leaf).__name__}')
        leaf._check_valid()
      self.scopes, self.links = _dedup(leaves)

  # What the transform gets to carry across.

  def variable_groups(self, filters):
    if len(self.scopes) == 1 and len(filters) == 1 and filters[0] is True:
      return ((self.scopes[0].variables(),),)  # a fresh dict already
    per_scope = [_group(s.variables(), filters) for s in self.scopes]
    return tuple(tuple(groups[i] for groups in per_scope)
                 for i in range(len(filters)))

  def rng_groups(self, filters):
    if len(self.scopes) == 1 and not self.scopes[0].rngs:
      if len(filters) == 1:
        return (({},),)
      return tuple(({},) for _ in filters)
    per_scope, suffixes = [], []
    for s in self.scopes:
      # The names folded lazily into each key are kept now, not read when
      # the inner scopes are made: JAX may trace the inside after the outer
      # scopes were released (the forward of a custom_vjp, differentiated
      # after ``apply`` returned).
      keys, suffix = {}, {}
      for name, lazy in s.rngs.items():
        keys[name], suffix[name] = lazy.key, lazy.suffix
      suffixes.append(suffix)
      per_scope.append(_group(keys, filters) if keys
                       else [{} for _ in filters])
    self.rng_suffixes = tuple(suffixes)
    return tuple(tuple(groups[i] for groups in per_scope)
                 for i in range(len(filters)))

  # Inside the transform.

  def make_scopes(self, variable_groups, rng_groups, mutable_filter=True,
                  keep_rng_suffix=True):
    """Fresh scopes (same tree as the outer ones) over the given groups.

    ``mutable_filter`` narrows what the inner scopes may write;
    ``keep_rng_suffix=False`` drops the scope names folded lazily into the
    keys (lifted jit does this so that its cache does not depend on them).
    """
    roots = []
    for i, outer in enumerate(self.scopes):
      variables = {}
      for group in variable_groups:
        variables.update(group[i])
      mutable = intersect(intersect(outer.mutable, self.out_union),
                          mutable_filter)
      if mutable is not False:
        for col in variables:
          if in_filter(mutable, col):
            variables[col] = thaw(variables[col])
      inner = Scope(variables, None, outer.name, mutable, None, outer.path,
                    outer.flags)
      rngs = {}
      for group in rng_groups:
        for name, key in group[i].items():
          rngs[name] = LazyKey(
              key, self.rng_suffixes[i][name] if keep_rng_suffix else ())
      inner.rngs = rngs
      inner.rng_counters = outer.rng_counters
      roots.append(inner)
    if self.treedef is None:
      return roots[0]
    leaves = []
    for index, rel_path in self.links:
      scope = roots[index]
      for name in rel_path:
        scope = scope.push(name, reuse=True)
      leaves.append(scope)
    return self.treedef.unflatten(leaves)

  def repack_fn(self, inner_tree):
    """The writable collections of inner scopes, grouped by out filter."""
    if self.treedef is None:
      roots = (inner_tree,)
    else:
      roots = [None] * len(self.scopes)
      for leaf, (index, _) in zip(self.treedef.flatten_up_to(inner_tree),
                                  self.links):
        if roots[index] is None:
          roots[index] = leaf.root
    n_out = len(self.out_filters)
    out = [[None] * len(roots) for _ in range(n_out)]
    for i, inner in enumerate(roots):
      inner.invalidate()
      groups = [{} for _ in range(n_out)]
      for col, collection in inner._variables.items():  # pylint: disable=protected-access
        if not inner.is_mutable_collection(col):
          continue
        for g, f in enumerate(self.out_filters):
          if in_filter(f, col):
            groups[g][col] = collection
            break
        else:
          raise errors.LiftError(
              f'{self.kind} at {inner.path_text}: collection "{col}" was '
              'written but no output filter of the transform selects it.')
      for g in range(n_out):
        out[g][i] = groups[g]
    return tuple(tuple(per_scope) for per_scope in out)

  # Back outside.

  def publish(self, out_groups):
    for i, scope in enumerate(self.scopes):
      for group in out_groups:
        for col, collection in group[i].items():
          if not scope.is_mutable_collection(col):
            continue  # e.g. read-only broadcast collections scan hands back
          scope._check_valid()  # pylint: disable=protected-access
          target = scope._mutable_collection(col)  # pylint: disable=protected-access
          for name, value in collection.items():
            _merge_into(target, name, value)


_ONE_SCOPE_LIST = jax.tree_util.tree_structure([0])


def _dedup(leaves):
  """Distinct outermost scopes, and for each leaf (index, path below it)."""
  ids = [_scope_identity(s) for s in leaves]
  present = set(ids)
  owner = {}
  links = []
  for leaf, ident in zip(leaves, ids):
    top, top_ident, rel = leaf, ident, ()
    names = [leaf.name]
    node = leaf.parent
    while node is not None:
      node_ident = _scope_identity(node)
      if node_ident in present:
        top, top_ident, rel = node, node_ident, tuple(reversed(names))
      names.append(node.name)
      node = node.parent
    links.append((top_ident, rel, top))
  # Keep first-appearance order of the leaves that are outermost themselves.
  order = []
  for leaf, ident, (top_ident, rel, top) in zip(leaves, ids, links):
    if top_ident not in owner and ident == top_ident:
      owner[top_ident] = len(order)
      order.append(leaf)
  for top_ident, rel, top in links:
    if top_ident not in owner:  # an ancestor that is no leaf: cannot happen
      owner[top_ident] = len(order)
      order.append(top)
  return tuple(order), tuple((owner[t], rel) for t, rel, _ in links)


def pack(fn: Callable[..., Any], in_variable_filters: Sequence[Any],
         out_variable_filters: Sequence[Any], rng_filters: Sequence[Any],
         name: str | None = None, enable_kwargs: bool = False):
  """Makes ``fn(make_scopes, repack_fn, variable_groups, rng_groups, *args)``
  callable as ``wrapper(scope_tree, *args)``.

  ``fn`` must return ``(y, out_variable_groups)``: ``y`` is returned to the
  caller, the groups (one per out filter, as made by ``repack_fn``) are
  written back to the outer scopes wherever the collection is mutable there.
  A collection goes to the first in/out filter that matches it; collections
  matching no in filter do not enter, and the inner scopes may write only
  collections that are mutable outside and match an out filter.
  """
  in_filters = tuple(in_variable_filters)
  out_filters = tuple(out_variable_filters)
  rng_filters = tuple(rng_filters)
  out_union = False
  for f in out_filters:
    out_union = union(out_union, f)
  kind = name or getattr(fn, '__name__', 'transform')

  @functools.wraps(fn)
  def wrapper(scope_tree, *args, **kwargs):
    if kwargs and not enable_kwargs:
      warnings.warn(f'{kind} does not take keyword arguments; ignoring '
                    f'{", ".join(kwargs)}', RuntimeWarning, stacklevel=2)
      kwargs = {}
    packing = Packing(scope_tree, out_filters, out_union, kind)
    variable_groups = packing.variable_groups(in_filters)
    rng_groups = packing.rng_groups(rng_filters)
    y, out_groups = fn(packing.make_scopes, packing.repack_fn, variable_groups,
                       rng_groups, *args, **kwargs)
    packing.publish(out_groups)
    return y

  return wrapper


def outer_scopes(make_scopes) -> tuple:
  """The distinct outer scopes behind the ``make_scopes`` a packed function
  received (for error messages and rng-counter bookkeeping)."""
  return make_scopes.__self__.scopes


def has_rngs(rng_groups) -> bool:
  """Whether any rng sequence crosses the boundary."""
  return any(per_scope for group in rng_groups for per_scope in group)


def split_keys(group, n, reshard_to=None):
  """Each key of an rng group split into ``n`` (one per iteration or batch
  element), optionally resharded along the mesh axis ``reshard_to``."""
  def split(key):
    keys = random.split(random.clone(key), n)
    if reshard_to is not None:
      keys = jax.sharding.reshard(keys, jax.sharding.PartitionSpec(reshard_to))
    return keys
  return jax.tree_util.tree_map(split, group)


# -- axis checks ------------------------------------------------------------------


def _axis_error(kind, scope, col, path, shape, axis, size, source):
  where = f'variable "{var_name(path)}" of collection "{col}"'
  if len(shape) <= (axis if axis >= 0 else -axis - 1):
    got = f'has shape {shape}, which has no axis {axis}'
  else:
    got = f'has shape {shape}, whose axis {axis} has size {shape[axis]}'
  return errors.VariableAxisError(
      f'{kind} at {scope.path_text}: {where} {got}; expected axis {axis} of '
      f'size {size} ({source}). The variables do not match this transform: '
      'check variable_axes and the axis size, or re-initialize.')


def _axis_matches(shape, axis, size):
  ndim = len(shape)
  if not -ndim <= axis < ndim:
    return False
  return shape[axis] == size


def check_variable_axes(kind, scopes, groups, axes, size, source,
                        explain=None):
  """Every leaf of a mapped collection must have ``axis`` of ``size``.

  ``explain(scope, where, shape)``, when given, words the error instead
  (``where`` names the variable and its collection).
  """
  for group, axis in zip(groups, axes):
    if axis is None or axis is broadcast:
      continue
    for scope, cols in zip(scopes, group):
      for col, collection in cols.items():
        for leaf in jax.tree_util.tree_leaves(collection):
          if not _axis_matches(shape_of(leaf), axis, size):
            for path, bad in jax.tree_util.tree_flatten_with_path(
                collection)[0]:
              if not _axis_matches(shape_of(bad), axis, size):
                shape = shape_of(bad)
                if explain is not None:
                  raise explain(scope, f'variable "{var_name(path)}" of '
                                f'collection "{col}"', shape)
                raise _axis_error(kind, scope, col, path, shape, axis, size,
                                  source)


def infer_axis_size(kind, noun, inputs, in_axes, args, unmapped, given,
                    given_name):
  """``(size, source)`` of the axis a vmap or scan maps over.

  ``given`` (the ``axis_size``/``length`` argument, named ``given_name``)
  wins; otherwise the size is read from the arguments mapped by ``in_axes``
  (entries equal to ``unmapped`` are not), which must agree. ``size`` is
  None when neither tells; ``source`` says where the size came from, for
  error messages (``noun``/``inputs`` word them, e.g. 'length' of the
  'scanned inputs').
  """
  sizes = set()

  def note(axis, arg):
    if axis is not unmapped:
      leaves = jax.tree_util.tree_leaves(arg)
      if leaves:
        sizes.add(shape_of(leaves[0])[axis])
    return axis

  jax.tree_util.tree_map(
      note, in_axes, args,
      is_leaf=(lambda x: x is None) if unmapped is None else None)
  if len(sizes) > 1:
    raise ValueError(f'{kind}: inconsistent {noun}s of the {inputs}: '
                     f'{sorted(sizes)}')
  if given is not None:
    return given, given_name
  if sizes:
    return next(iter(sizes)), f'the {noun} of the {inputs}'
  return None, None


def first_mapped_size(groups, axes):
  """The size of ``axis`` of the first leaf of the first mapped group."""
  for group, axis in zip(groups, axes):
    if axis is None:
      continue
    leaves = jax.tree_util.tree_leaves(group)
    if leaves:
      shape = shape_of(leaves[0])
      if -len(shape) <= axis < len(shape):
        return shape[axis]
  return None


def flat_axes(prefix, tree):
  """The entry of the prefix tree ``prefix`` that governs each leaf."""
  out = []
  jax.tree_util.tree_map(
      lambda ax, sub: out.extend([ax] * len(jax.tree_util.tree_leaves(sub))),
      prefix, tree, is_leaf=lambda x: x is None)
  return out
