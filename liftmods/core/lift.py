"""Lifted transforms: JAX transforms applied to functions of scopes.

A scope function ``fn(scope, *args)`` reads and writes variables through its
scope, so it is not a pure function and cannot be handed to ``jax.vmap`` or
``jax.lax.scan`` directly. ``pack`` turns it into one: it pulls the variables
and PRNG keys of the scope(s) out into plain pytrees ("groups"), lets the
transform carry those groups across the JAX boundary, rebuilds scopes on the
inside (``scope_fn``), collects what the inside wrote (``repack_fn``) and
writes the mutable part back into the outer scopes. Every transform below is
a short function over ``pack``.

Variable groups are tuples (one entry per collection filter) of tuples (one
entry per distinct outer scope) of ``{collection: variables}`` dicts. RNG
groups have the same layout with ``{sequence_name: key}`` dicts holding plain
JAX keys; the static part of each sequence (the scope names folded into it
lazily) stays outside the transform and is re-attached by ``scope_fn``.

PRNG sequences and their counters behave exactly as in Flax: the inner scope
shares the counters of the outer one, so a transform that traces its body
twice (scan does, to initialise broadcast variables) advances them twice, and
the keys drawn are bit-identical to ``flax.core.lift``.

>>> import jax, jax.numpy as jnp
>>> from liftmods.core import init, lift
>>> def dense(scope, x):
...   w = scope.param('w', jax.nn.initializers.normal(), (x.shape[-1], 2))
...   return x @ w
>>> stacked = lift.vmap(dense, variable_axes={'params': 0},
...                     split_rngs={'params': True})
>>> y, variables = init(stacked)(jax.random.key(0), jnp.ones((4, 3)))
>>> y.shape, variables['params']['w'].shape
((4, 2), (4, 3, 2))
"""
import dataclasses
import functools
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Generic, Sequence, TypeVar

import jax
import numpy as np
from jax import lax
from jax import random
from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe

from liftmods import errors
from liftmods.core import meta
from liftmods.core.filters import (DenyList, in_filter, intersect, is_empty,
                                   subtract, union)
from liftmods.core.frozen_dict import FrozenDict
from liftmods.core.rngs import LazyKey
from liftmods.core.scope import Scope

T = TypeVar('T')

__all__ = [
    'In', 'Out', 'broadcast', 'pack', 'map_variables', 'swap_collection',
    'vmap', 'scan', 'while_loop', 'fori_loop', 'cond', 'switch', 'checkpoint',
    'remat', 'remat_scan', 'jit', 'fold_rngs', 'custom_vjp', 'vjp', 'jvp',
    'value_and_grad',
]


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


def _split_in_out_axes(variable_axes: Mapping):
  ins, outs = {}, {}
  for col_filter, axis in variable_axes.items():
    if isinstance(axis, In):
      ins[col_filter] = axis.axis
    elif isinstance(axis, Out):
      outs[col_filter] = axis.axis
    else:
      ins[col_filter] = outs[col_filter] = axis
  return ins, outs


def _unzip2(pairs):
  pairs = tuple(pairs)
  if not pairs:
    return (), ()
  firsts, seconds = zip(*pairs)
  return tuple(firsts), tuple(seconds)


# -- small helpers --------------------------------------------------------------


def _thaw(tree):
  """A copy of the dict skeleton of ``tree`` (leaves shared), FrozenDicts
  turned into dicts, so that an inner scope can write without touching it."""
  if isinstance(tree, Mapping):
    return {k: _thaw(v) for k, v in tree.items()}
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


def _shape(x):
  shape = getattr(x, 'shape', None)
  return tuple(shape) if shape is not None else np.shape(x)


def _typeof(x):
  try:
    return jax.typeof(x)
  except TypeError:
    return None


def _describe_aval(aval) -> str:
  if aval is None:
    return 'a non-array value'
  return f'{aval.dtype}{list(aval.shape)}'


def _var_name(path) -> str:
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


def _hashable_filter(f):
  if f is True or f is False or isinstance(f, str):
    return f
  if isinstance(f, DenyList):
    return ('deny', _hashable_filter(f.deny))
  if isinstance(f, Iterable):
    return frozenset(f)
  return f


def _hashable_flags(flags):
  if not flags:
    return ()
  try:
    key = tuple(flags.items())
    hash(key)
    return key
  except TypeError:
    return ('flags-id', id(flags))


# -- pack -------------------------------------------------------------------------


class _Packing:
  """One crossing of a transform boundary by a tree of scopes."""

  __slots__ = ('scopes', 'treedef', 'links', 'out_filters', 'out_union',
               'kind')

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
      return tuple(({},) for _ in filters)
    per_scope = []
    for s in self.scopes:
      if s.rngs:
        keys = {name: lazy.key for name, lazy in s.rngs.items()}
        per_scope.append(_group(keys, filters))
      else:
        per_scope.append([{} for _ in filters])
    return tuple(tuple(groups[i] for groups in per_scope)
                 for i in range(len(filters)))

  # Inside the transform.

  def scope_fn(self, variable_groups, rng_groups, mutable_filter=True,
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
            variables[col] = _thaw(variables[col])
      inner = Scope(variables, None, outer.name, mutable, None, outer.path,
                    outer.flags)
      outer_rngs = outer.rngs
      rngs = {}
      for group in rng_groups:
        for name, key in group[i].items():
          rngs[name] = LazyKey(
              key, outer_rngs[name].suffix if keep_rng_suffix else ())
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
  """Makes ``fn(scope_fn, repack_fn, variable_groups, rng_groups, *args)``
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
    packing = _Packing(scope_tree, out_filters, out_union, kind)
    variable_groups = packing.variable_groups(in_filters)
    rng_groups = packing.rng_groups(rng_filters)
    y, out_groups = fn(packing.scope_fn, packing.repack_fn, variable_groups,
                       rng_groups, *args, **kwargs)
    packing.publish(out_groups)
    return y

  return wrapper


def _outer_scopes(scope_fn) -> tuple:
  return scope_fn.__self__.scopes


# -- axis checks ------------------------------------------------------------------


def _axis_error(kind, scope, col, path, shape, axis, size, source):
  where = f'variable "{_var_name(path)}" of collection "{col}"'
  if kind == 'Stack':
    return _stack_length_error(scope, where, shape, size)
  if len(shape) <= (axis if axis >= 0 else -axis - 1):
    got = f'has shape {shape}, which has no axis {axis}'
  else:
    got = f'has shape {shape}, whose axis {axis} has size {shape[axis]}'
  return errors.VariableAxisError(
      f'{kind} at {scope.path_text}: {where} {got}; expected axis {axis} of '
      f'size {size} ({source}). The variables do not match this transform: '
      'check variable_axes and the axis size, or re-initialize.')


def _stack_length_error(scope, where, shape, length):
  """nn.Stack stores layers on axis 0: a mismatch is a checkpoint saved for
  another number of layers."""
  if not shape:
    got = f'has shape {shape}, with no layer axis'
  else:
    got = f'has shape {shape}: the checkpoint has {shape[0]} layers'
  return errors.VariableAxisError(
      f'Stack at {scope.path_text}: {where} {got}, the stack {length}. Load '
      f'variables saved for {length} layers, build the stack with the '
      "checkpoint's length, or re-initialize.")


def _axis_matches(shape, axis, size):
  ndim = len(shape)
  if not -ndim <= axis < ndim:
    return False
  return shape[axis] == size


def _check_variable_axes(kind, scopes, groups, axes, size, source):
  """Every leaf of a mapped collection must have ``axis`` of ``size``."""
  for group, axis in zip(groups, axes):
    if axis is None or axis is broadcast:
      continue
    for scope, cols in zip(scopes, group):
      for col, collection in cols.items():
        for leaf in jax.tree_util.tree_leaves(collection):
          if not _axis_matches(_shape(leaf), axis, size):
            for path, bad in jax.tree_util.tree_flatten_with_path(
                collection)[0]:
              if not _axis_matches(_shape(bad), axis, size):
                raise _axis_error(kind, scope, col, path, _shape(bad), axis,
                                  size, source)


def _first_mapped_size(groups, axes):
  for group, axis in zip(groups, axes):
    if axis is None:
      continue
    leaves = jax.tree_util.tree_leaves(group)
    if leaves:
      shape = _shape(leaves[0])
      if -len(shape) <= axis < len(shape):
        return shape[axis]
  return None


def _split_keys(group, n, reshard_to=None):
  def split(key):
    keys = random.split(random.clone(key), n)
    if reshard_to is not None:
      keys = jax.sharding.reshard(keys, jax.sharding.PartitionSpec(reshard_to))
    return keys
  return jax.tree_util.tree_map(split, group)


def _flat_axes(prefix, tree):
  """The entry of the prefix tree ``prefix`` that governs each leaf."""
  out = []
  jax.tree_util.tree_map(
      lambda ax, sub: out.extend([ax] * len(jax.tree_util.tree_leaves(sub))),
      prefix, tree, is_leaf=lambda x: x is None)
  return out


# -- map_variables / swap_collection --------------------------------------------


def _identity(x):
  return x


id_fn = _identity


def map_variables(fn: Callable[..., Any], mapped_collections,
                  map_in_fn: Callable[..., Any] = _identity,
                  map_out_fn: Callable[..., Any] = _identity,
                  init: bool = False, mutable: bool = False, rngs=True,
                  variables=True):
  """Lets ``fn`` see ``map_in_fn`` of the collections ``mapped_collections``.

  ``map_in_fn``/``map_out_fn`` take and return ``{collection: variables}``
  for one scope. With ``mutable`` the body may write the mapped collections
  and ``map_out_fn`` maps what it wrote back; with ``init`` the body first
  runs unmapped once so that it can create them.
  """
  writes_target = mutable or init

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args,
            **kwargs):
    target, other = variable_groups
    if init:
      scopes = scope_fn((target, other), rng_groups)
      if any(not is_empty(s.mutable)
             for s in jax.tree_util.tree_leaves(
                 scopes, is_leaf=lambda x: isinstance(x, Scope))):
        fn(scopes, *args, **kwargs)
        target, _ = repack_fn(scopes)
        target = tuple(map_out_fn(x) for x in target)
    target = tuple(map_in_fn(_thaw(x)) for x in target)
    narrow = True if writes_target else subtract(True, mapped_collections)
    scopes = scope_fn((target, other), rng_groups, mutable_filter=narrow)
    y = fn(scopes, *args, **kwargs)
    out_target, out_other = repack_fn(scopes)
    if writes_target:
      out_target = tuple(map_out_fn(x) for x in out_target)
    return y, (out_target, out_other)

  in_groups = (mapped_collections, variables)
  if writes_target:
    out_groups = in_groups
  else:
    out_groups = (False, subtract(variables, mapped_collections))
  return pack(inner, in_groups, out_groups, (rngs,), name='map_variables',
              enable_kwargs=True)


def swap_collection(fn: Callable[..., Any], col_a: str, col_b: str):
  """Runs ``fn`` with collections ``col_a`` and ``col_b`` exchanged."""

  def swap(target):
    a = target.get(col_a, {})
    b = target.get(col_b, {})
    target[col_a], target[col_b] = b, a
    return target

  return map_variables(fn, (col_a, col_b), swap, swap, mutable=True)


# -- vmap ---------------------------------------------------------------------------


def vmap(fn: Callable[..., Any], variable_axes: Mapping, split_rngs: Mapping,
         in_axes=0, out_axes=0, axis_size: int | None = None,
         axis_name: str | None = None, spmd_axis_name: str | None = None,
         metadata_params: dict = {}):  # pylint: disable=dangerous-default-value
  """``jax.vmap`` for scope functions.

  ``variable_axes`` maps collection filters to the axis their variables are
  stacked on (``None``: shared by all batch elements). ``split_rngs`` maps
  rng filters to whether each batch element gets its own key (only the
  sequences listed are available inside). ``in_axes``/``out_axes``/
  ``axis_size``/``axis_name``/``spmd_axis_name`` are as in ``jax.vmap``.
  Boxed variables (``meta.AxisMetadata``) are told about the added axis via
  ``metadata_params``.
  """
  var_in, var_out = _split_in_out_axes(variable_axes)
  in_filters, var_in_axes = _unzip2(var_in.items())
  out_filters, var_out_axes = _unzip2(var_out.items())
  rng_filters, rng_splits = _unzip2(split_rngs.items())
  rng_axes = tuple(0 if split else None for split in rng_splits)

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    scopes = _outer_scopes(scope_fn)
    variable_groups = tuple(
        meta.remove_axis(group, axis, metadata_params) if axis is not None
        else group for group, axis in zip(variable_groups, var_in_axes))

    arg_sizes = set()

    def note_size(axis, arg):
      if axis is not None:
        leaves = jax.tree_util.tree_leaves(arg)
        if leaves:
          arg_sizes.add(_shape(leaves[0])[axis])

    jax.tree_util.tree_map(note_size, in_axes, args,
                           is_leaf=lambda x: x is None)
    if len(arg_sizes) > 1:
      raise ValueError(f'vmap: inconsistent batch sizes of the inputs: '
                       f'{sorted(arg_sizes)}')
    if axis_size is not None:
      size, source = axis_size, 'axis_size'
    elif arg_sizes:
      size, source = next(iter(arg_sizes)), 'the batch size of the inputs'
    else:
      size = _first_mapped_size(variable_groups, var_in_axes)
      source = 'the batch size of the other mapped variables'
      if size is None:
        raise ValueError('vmap: cannot tell the batch size; pass axis_size.')
    _check_variable_axes('vmap', scopes, variable_groups, var_in_axes, size,
                         source)

    reshard_to = None
    if spmd_axis_name is not None:
      flat_args = jax.tree_util.tree_leaves(args)
      for x, axis in zip(flat_args, _flat_axes(in_axes, args)):
        if axis is None:
          continue
        spec = getattr(getattr(jax.typeof(x), 'sharding', None), 'spec', ())
        if len(spec) > axis and spec[axis] == spmd_axis_name:
          reshard_to = spmd_axis_name
          break
    rng_groups = tuple(
        _split_keys(group, size, reshard_to) if split else group
        for group, split in zip(rng_groups, rng_splits))

    @functools.wraps(fn)
    def mapped(variable_groups, rng_groups, args):
      scope = scope_fn(variable_groups, rng_groups)
      y = fn(scope, *args)
      return y, repack_fn(scope)

    y, out_groups = jax.vmap(
        mapped, in_axes=(var_in_axes, rng_axes, in_axes),
        out_axes=(out_axes, var_out_axes), axis_name=axis_name,
        axis_size=axis_size, spmd_axis_name=spmd_axis_name)(
            variable_groups, rng_groups, args)
    out_groups = tuple(
        meta.add_axis(group, axis, metadata_params) if axis is not None
        else group for group, axis in zip(out_groups, var_out_axes))
    return y, out_groups

  return pack(inner, in_filters, out_filters, rng_filters, name='vmap')


# -- scan -----------------------------------------------------------------------------


def _abstract(x, scanned: bool):
  """The abstract value of ``x`` (of one slice of it, when ``scanned``)."""
  aval = jax.typeof(x)
  if not scanned:
    return aval
  sharding = getattr(aval, 'sharding', None)
  spec = tuple(getattr(sharding, 'spec', ()) or ())
  if spec and spec[0] is not None:
    raise ValueError('scan: the scanned axis of an input cannot be sharded '
                     f'(got spec {spec}).')
  if sharding is not None and spec:
    return aval.update(shape=aval.shape[1:], sharding=sharding.update(
        spec=jax.sharding.PartitionSpec(*spec[1:])))
  return aval.update(shape=aval.shape[1:])


def _to_front(axis, xs):
  if axis is broadcast:
    return ()
  if axis == 0:
    return xs
  return jax.tree_util.tree_map(lambda x: jax.numpy.moveaxis(x, axis, 0), xs)


def _from_front(axis, ys):
  if axis is broadcast:
    return ()
  if axis == 0:
    return ys
  return jax.tree_util.tree_map(lambda y: jax.numpy.moveaxis(y, 0, axis), ys)


class _ReplayMismatch(Exception):
  pass


class _RngReplay:
  """Replays the rng-counter effect of a scan's invariant trace.

  Linen traces a scan body twice, and the keys of the second (loop) trace
  depend on the counters the first one advanced. When the same site was
  traced before from the same counter state and nothing else needs the first
  trace, the counters jump to the recorded post-first-trace state and the
  body is traced once; the loop trace then checks that it advanced the
  counters exactly as recorded, or aborts (before the scan is emitted) so
  that the caller falls back to two traces.
  """

  _cache: dict = {}
  _LIMIT = 512

  def __init__(self, scopes, site):
    """``site``: what identifies the traced code and its inputs' structure
    (the scopes' paths and flags are added here)."""
    self.scopes = scopes
    self.before = self.state()
    self.key = (site, tuple(s.path for s in scopes),
                _hashable_flags(scopes[0].flags), self.before)
    self.hit = self._cache.get(self.key)

  def replayed(self, trace):
    """``(out,)`` of ``trace(verify)`` run from the recorded counters, or
    None (counters as before) when nothing is recorded or the trace moved
    them differently; ``trace`` calls ``verify()`` after its loop body."""
    if self.hit is None:
      return None
    self.set(self.hit[0])
    try:
      return (trace(self.verify),)
    except _ReplayMismatch:
      self.set(self.before)
      return None

  def state(self):
    return tuple(_counter_state(s.rng_counters) for s in self.scopes)

  def set(self, state):
    for scope, counters in zip(self.scopes, state):
      _set_counters(scope.rng_counters, counters)

  def record(self, after_first, after_loop):
    if len(self._cache) >= self._LIMIT:
      self._cache.pop(next(iter(self._cache)))
    self._cache[self.key] = (after_first, after_loop)

  def verify(self):
    if self.state() != self.hit[1]:
      raise _ReplayMismatch


def _set_counters(counters: dict, state: tuple):
  """Makes ``counters`` equal ``state`` in place (nested dicts kept)."""
  keep = set()
  for k, v in state:
    keep.add(k)
    if isinstance(v, tuple):
      sub = counters.get(k)
      if not isinstance(sub, dict):
        sub = counters[k] = {}
      _set_counters(sub, v)
    else:
      counters[k] = v
  for k in [k for k in counters if k not in keep]:
    del counters[k]


def _scan_with_broadcast(body, in_axes, out_axes, length, reverse, unroll,
                         split_transpose, check_invariants, explain,
                         writes_broadcast=True, rng_replay=None):
  """``lax.scan`` with vmap-style axes plus loop-invariant outputs.

  ``body(broadcast_in, carry, *xs) -> (broadcast_out, carry, ys)``. Inputs
  whose axis is ``broadcast`` are passed whole to every iteration; outputs
  whose axis is ``broadcast`` must not depend on the iteration and are
  returned once. ``broadcast_out`` is computed by running the body once
  outside the loop with the carry and the scanned inputs abstract; the loop
  then runs with it as ``broadcast_in``. Anything of ``broadcast_out`` that
  depends on the abstract part is an error, described by ``explain(path)``.
  When nothing broadcast can be written (``writes_broadcast`` False and no
  ``broadcast`` out axis) that extra trace can be skipped so the body is
  traced once. Callers pass ``writes_broadcast=True`` whenever rngs cross
  the loop: the extra trace advances rng counters, and Linen's keys depend
  on that; ``rng_replay`` (a _RngReplay) then lets a repeated trace of the
  same site skip it anyway.
  """
  out_broadcast = any(axis is broadcast for axis in jax.tree_util.tree_leaves(
      out_axes, is_leaf=lambda x: x is broadcast))

  def run(broadcast_in, init, *args):
    if rng_replay is not None and not out_broadcast:
      replayed = rng_replay.replayed(
          lambda verify: traced(broadcast_in, init, args, False, verify))
      if replayed is not None:
        return replayed[0]
    if rng_replay is None:
      return traced(broadcast_in, init, args, True, None)
    out = traced(broadcast_in, init, args, True, None)
    rng_replay.record(*out[3])
    return out[:3]

  def traced(broadcast_in, init, args, invariants, verify):
    xs = jax.tree_util.tree_map(_to_front, in_axes, args)

    def full_inputs(x_slice):
      return jax.tree_util.tree_map(
          lambda axis, arg, x: arg if axis is broadcast else x, in_axes,
          args, x_slice)

    consts_out = None
    if invariants and check_invariants and (writes_broadcast or out_broadcast):
      in_avals = (jax.tree_util.tree_map(lambda x: _abstract(x, False), init),
                  jax.tree_util.tree_map(lambda x: _abstract(x, True), xs))
      flat_avals, in_tree = jax.tree_util.tree_flatten(in_avals)
      out_trees = []

      def invariant_part(*flat):
        carry, x_slice = jax.tree_util.tree_unflatten(in_tree, flat)
        b_out, _, ys = body(broadcast_in, carry, *full_inputs(x_slice))
        ys = jax.tree_util.tree_map(
            lambda axis, y: y if axis is broadcast else (), out_axes, ys)
        flat_out, out_tree = jax.tree_util.tree_flatten((b_out, ys))
        out_trees.append(out_tree)
        return flat_out

      debug = jax.api_util.debug_info('liftmods scan (loop invariants)',
                                      invariant_part, tuple(flat_avals), {})
      _, out_pvals, _ = pe.trace_to_jaxpr_nounits(
          lu.wrap_init(invariant_part, debug_info=debug),
          [pe.PartialVal.unknown(a) for a in flat_avals])
      dependent = [i for i, pval in enumerate(out_pvals)
                   if not pval.is_known()]
      out_tree = out_trees[-1]
      if dependent:
        positions = jax.tree_util.tree_unflatten(
            out_tree, list(range(out_tree.num_leaves)))
        paths = {i: path for path, i in
                 jax.tree_util.tree_flatten_with_path(positions)[0]}
        raise errors.BroadcastVariableError(explain(paths[dependent[0]]))
      broadcast_in, consts_out = jax.tree_util.tree_unflatten(
          out_tree, [pval.get_known() for pval in out_pvals])
    elif out_broadcast and not check_invariants:
      raise ValueError('scan with check_constancy_invariants=False cannot '
                       'return outputs with out_axes=broadcast.')
    after_first = rng_replay.state() if rng_replay is not None else None

    def loop_body(carry, x_slice):
      _, carry, ys = body(broadcast_in, carry, *full_inputs(x_slice))
      if verify is not None:
        verify()
      ys = jax.tree_util.tree_map(
          lambda axis, y: () if axis is broadcast else y, out_axes, ys)
      return carry, ys

    carry, ys = lax.scan(loop_body, init, xs, length=length, reverse=reverse,
                         unroll=unroll, _split_transpose=split_transpose)
    ys = jax.tree_util.tree_map(_from_front, out_axes, ys)
    if consts_out is not None:
      ys = jax.tree_util.tree_map(
          lambda axis, const, y: const if axis is broadcast else y, out_axes,
          consts_out, ys)
    if rng_replay is not None and verify is None:
      return broadcast_in, carry, ys, (after_first, rng_replay.state())
    return broadcast_in, carry, ys

  return run


def _has_rngs(rng_groups) -> bool:
  return any(per_scope for group in rng_groups for per_scope in group)


def _carry_mismatch(kind, scopes, vars_in, vars_out, c_in, c_out):
  """Raises ScanCarryError if the carry changed structure, shape or dtype."""

  def leaf_problem(a, b):
    a_aval, b_aval = _typeof(a), _typeof(b)
    if a_aval is None or b_aval is None:
      return None
    if tuple(a_aval.shape) != tuple(b_aval.shape) or (
        a_aval.dtype != b_aval.dtype and not getattr(a_aval, 'weak_type', 0)):
      return (f'went in as {_describe_aval(a_aval)} and came out as '
              f'{_describe_aval(b_aval)}')
    return None

  for scope, cols_in, cols_out in zip(scopes, vars_in, vars_out):
    for col in sorted(set(cols_in) | set(cols_out)):
      flat_in = dict(jax.tree_util.tree_flatten_with_path(
          cols_in.get(col, {}))[0])
      flat_out = dict(jax.tree_util.tree_flatten_with_path(
          cols_out.get(col, {}))[0])
      added = [p for p in flat_out if p not in flat_in]
      removed = [p for p in flat_in if p not in flat_out]
      if added or removed:
        what = []
        if added:
          what.append('created ' + ', '.join(
              f'"{_var_name(p)}"' for p in added))
        if removed:
          what.append('dropped ' + ', '.join(
              f'"{_var_name(p)}"' for p in removed))
        raise errors.ScanCarryError(
            f'{kind} at {scope.path_text}: the body {" and ".join(what)} in '
            f'carried collection "{col}"; carried variables must exist '
            'before the loop and keep their structure. Initialize them '
            'outside the loop.')
      for path, leaf in flat_in.items():
        problem = leaf_problem(leaf, flat_out[path])
        if problem:
          raise errors.ScanCarryError(
              f'{kind} at {scope.path_text}: carried variable '
              f'"{_var_name(path)}" of collection "{col}" {problem}; a '
              'carry must keep its shape and dtype across iterations.')
  in_leaves, in_tree = jax.tree_util.tree_flatten_with_path(c_in)
  out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(c_out)
  if in_tree != out_tree:
    raise errors.ScanCarryError(
        f'{kind} at {scopes[0].path_text}: the body returned a carry with '
        f'structure {out_tree}, but it received {in_tree}; a carry must keep '
        'its structure.')
  for (path, a), (_, b) in zip(in_leaves, out_leaves):
    problem = leaf_problem(a, b)
    if problem:
      entry = jax.tree_util.keystr(path)
      what = f'carry entry {entry}' if entry else 'carry'
      raise errors.ScanCarryError(
          f'{kind} at {scopes[0].path_text}: the {what} {problem}; a carry '
          'must keep its shape and dtype across iterations.')


def scan(fn: Callable[..., Any], variable_axes: Mapping = {},  # pylint: disable=dangerous-default-value
         variable_broadcast=False, variable_carry=False,
         split_rngs: Mapping = {},  # pylint: disable=dangerous-default-value
         in_axes=0, out_axes=0, length: int | None = None,
         reverse: bool = False, unroll: int = 1,
         _split_transpose: bool = False,
         data_transform: Callable[..., Any] | None = None,
         metadata_params: dict = {},  # pylint: disable=dangerous-default-value
         check_constancy_invariants: bool = True):
  """``jax.lax.scan`` for scope functions ``fn(scope, carry, *xs) -> (carry,
  ys)``; returns ``f(scope, carry, *xs) -> (carry, ys)``.

  Collections in ``variable_axes`` get one slice per iteration (stacked on
  the given axis), ``variable_carry`` collections are threaded through the
  iterations, ``variable_broadcast`` collections are the same for all
  iterations and are created by one run of the body outside the loop, so
  they must not depend on the carry or the scanned inputs. ``split_rngs``
  says which sequences get a different key per iteration. ``in_axes`` may
  use ``broadcast`` for inputs passed whole to every iteration.
  """
  var_in, var_out = _split_in_out_axes(variable_axes)
  in_filters, var_in_axes = _unzip2(var_in.items())
  out_filters, var_out_axes = _unzip2(var_out.items())
  for axis in var_in_axes + var_out_axes:
    if not isinstance(axis, int):
      raise TypeError(f'scan: variable axes must be ints, got {axis!r}')
  rng_filters, rng_splits = _unzip2(split_rngs.items())
  rng_axes = tuple(0 if split else broadcast for split in rng_splits)

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, init, *args):
    scopes = _outer_scopes(scope_fn)
    lengths = set()

    def note_length(axis, arg):
      if axis is not broadcast:
        leaves = jax.tree_util.tree_leaves(arg)
        if leaves:
          lengths.add(_shape(leaves[0])[axis])
      return axis

    jax.tree_util.tree_map(note_length, in_axes, args)
    if len(lengths) > 1:
      raise ValueError(f'scan: inconsistent lengths of the scanned inputs: '
                       f'{sorted(lengths)}')
    if length is not None:
      n, source = length, 'length'
    elif lengths:
      n, source = next(iter(lengths)), 'the length of the scanned inputs'
    else:
      raise ValueError('scan: cannot tell the number of iterations; pass '
                       'length= or scanned inputs.')

    broadcast_vars, carry_vars = variable_groups[0], variable_groups[1]
    scan_vars = tuple(
        meta.remove_axis(group, axis, metadata_params)
        for group, axis in zip(variable_groups[2:], var_in_axes))
    _check_variable_axes('scan', scopes, scan_vars, var_in_axes, n, source)
    rng_groups = tuple(_split_keys(group, n) if split else group
                       for group, split in zip(rng_groups, rng_splits))

    def body(broadcast_in, carry, scan_in, rngs, xs):
      carry_in, c = carry
      groups = (broadcast_in, carry_in) + tuple(scan_in)
      if data_transform is not None:
        groups, rngs = data_transform(groups, rngs)
      scope = scope_fn(groups, rngs)
      result = fn(scope, c, *xs)
      if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise errors.ScanCarryError(
            f'scan at {scopes[0].path_text}: the body must return a pair '
            f'(carry, ys), got {type(result).__name__}.')
      c_out, ys = result
      out = repack_fn(scope)
      broadcast_out, carry_out, scan_out = out[0], out[1], out[2:]
      for group_in, group_out in zip(broadcast_in, broadcast_out):
        for col, collection in group_in.items():
          if col not in group_out:
            group_out[col] = collection  # read-only ones must stay available
      _carry_mismatch('scan', scopes, carry_in, carry_out, c, c_out)
      return broadcast_out, (carry_out, c_out), (ys, scan_out)

    def explain(path):
      if path[0].idx == 0 and len(path) >= 3:
        scope = scopes[path[1].idx]
        col = path[2].key
        return (f'scan at {scope.path_text}: broadcast variable '
                f'"{_var_name(path[3:])}" of collection "{col}" depends on the '
                'carry or on the scanned inputs (or split rngs). A broadcast '
                'collection must be the same for all iterations: do not '
                'write it from loop-dependent values, or list it in '
                'variable_axes/variable_carry instead.')
      return (f'scan at {scopes[0].path_text}: output '
              f'{jax.tree_util.keystr(path[1:])} has out_axes=broadcast but '
              'depends on the loop.')

    mutable_broadcast = any(
        not is_empty(intersect(s.mutable, variable_broadcast)) for s in scopes)
    has_rngs = _has_rngs(rng_groups)
    replay = None
    if has_rngs and not mutable_broadcast:
      site = (getattr(fn, '__code__', None),
              jax.tree_util.tree_structure((args, init)))
      replay = _RngReplay(scopes, site)
    looped = _scan_with_broadcast(
        body, in_axes=(var_in_axes, rng_axes, in_axes),
        out_axes=(out_axes, var_out_axes), length=length, reverse=reverse,
        unroll=unroll, split_transpose=_split_transpose,
        check_invariants=check_constancy_invariants, explain=explain,
        writes_broadcast=mutable_broadcast or has_rngs,
        rng_replay=replay)
    broadcast_vars, (carry_vars, c), (ys, scan_out) = looped(
        broadcast_vars, (carry_vars, init), scan_vars, rng_groups, args)
    scan_out = tuple(meta.add_axis(group, axis, metadata_params)
                     for group, axis in zip(scan_out, var_out_axes))
    return (c, ys), (broadcast_vars, carry_vars) + scan_out

  return pack(inner, (variable_broadcast, variable_carry) + in_filters,
              (variable_broadcast, variable_carry) + out_filters,
              rng_filters, name='scan')


# -- loops and branches -------------------------------------------------------------


_NOT_FOUND = (errors.ScopeParamNotFoundError, errors.ScopeCollectionNotFound,
              errors.ScopeVariableNotFoundError)


def while_loop(cond_fn: Callable[..., Any], body_fn: Callable[..., Any],
               scope, init, carry_variables=False, broadcast_variables=True,
               split_rngs: Mapping = {}):  # pylint: disable=dangerous-default-value
  """``jax.lax.while_loop`` over scopes: ``cond_fn(scope, c) -> bool``,
  ``body_fn(scope, c) -> c``; returns the final carry.

  ``carry_variables`` collections may be updated by the body (not created);
  ``broadcast_variables`` are read-only. Variables cannot be initialised in
  the loop: run the body once before the loop for that.
  """
  rng_filters, rng_splits = _unzip2(split_rngs.items())
  read_only = subtract(broadcast_variables, carry_variables)

  def inner(scope_fn, repack_fn, variable_groups, rng_groups):
    scopes = _outer_scopes(scope_fn)
    carry_vars, broadcast_vars = variable_groups

    def loop_rngs(i):
      return tuple(
          jax.tree_util.tree_map(lambda k: random.fold_in(k, i), group)
          if split else group
          for group, split in zip(rng_groups, rng_splits))

    def init_error(err, where):
      """Linen's lookup error, with a hint saying why the variable is
      missing, when it was (probably) meant to be created in the loop."""
      # Only a collection that could be created outside the loop counts.
      col = getattr(err, 'collection', None)
      if col is None or not in_filter(read_only, col):
        return None
      for s in scopes:
        if in_filter(s.mutable, col):
          return type(err)(*err.lookup, hint=(
              f'This lookup is in the {where} of the while_loop at '
              f'{s.path_text}, where variables cannot be created: run the '
              'body once before the loop so that they exist (e.g. during '
              'init, when self.is_mutable_collection("params")).'))
      return None

    def cond_wrapper(state):
      i, loop_vars, carry = state
      inner_scope = scope_fn((loop_vars, broadcast_vars), loop_rngs(-i),
                             mutable_filter=False)
      try:
        return cond_fn(inner_scope, carry)
      except _NOT_FOUND as err:
        better = init_error(err, 'condition')
        if better is None:
          raise
        raise better from err

    def body_wrapper(state):
      i, loop_vars, carry = state
      inner_scope = scope_fn((loop_vars, broadcast_vars), loop_rngs(i))
      try:
        carry = body_fn(inner_scope, carry)
      except _NOT_FOUND as err:
        better = init_error(err, 'body')
        if better is None:
          raise
        raise better from err
      (new_vars,) = repack_fn(inner_scope)
      _check_no_new_variables(scopes, loop_vars, new_vars)
      return i + 1, new_vars, carry

    _, carry_vars, carry = lax.while_loop(cond_wrapper, body_wrapper,
                                          (0, carry_vars, init))
    return carry, (carry_vars,)

  return pack(inner, (carry_variables, broadcast_variables),
              (carry_variables,), rng_filters, name='while_loop')(scope)


def _check_no_new_variables(scopes, vars_in, vars_out):
  for s, cols_in, cols_out in zip(scopes, vars_in, vars_out):
    for col, collection in cols_out.items():
      known = {p for p, _ in jax.tree_util.tree_flatten_with_path(
          cols_in.get(col, {}))[0]}
      new = [p for p, _ in jax.tree_util.tree_flatten_with_path(collection)[0]
             if p not in known]
      if new:
        raise errors.WhileLoopInitError(
            f'while_loop at {s.path_text}: the body created '
            + ', '.join(f'"{_var_name(p)}"' for p in new)
            + f' in carried collection "{col}". Variables cannot be '
            'initialised inside a while_loop; create them before the loop.')


def fori_loop(lower, upper, body_fn: Callable[..., Any], scope, init,
              carry_variables=False, broadcast_variables=True,
              split_rngs: Mapping = {}):  # pylint: disable=dangerous-default-value
  """``jax.lax.fori_loop`` over scopes: ``body_fn(scope, i, c) -> c``."""

  def cond_fn(_, state):
    return state[0] < upper

  def body(inner_scope, state):
    i, c = state
    return i + 1, body_fn(inner_scope, i, c)

  lower = jax.numpy.asarray(lower)
  _, carry = while_loop(cond_fn, body, scope, (lower, init),
                        carry_variables=carry_variables,
                        broadcast_variables=broadcast_variables,
                        split_rngs=split_rngs)
  return carry


def _branch_signature(out_groups):
  sig = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(out_groups)[0]:
    aval = _typeof(leaf)
    sig[path] = None if aval is None else (tuple(aval.shape), aval.dtype)
  return sig


def _branch_error(kind, scopes, signatures):
  """CondBranchVariablesError if the branches wrote different variables."""
  first = signatures[0]
  for index, other in enumerate(signatures[1:], start=1):
    if other == first:
      continue
    for path in sorted(set(first) | set(other), key=str):
      a, b = first.get(path, 'missing'), other.get(path, 'missing')
      if a == b:
        continue
      # path: (filter group, scope, collection, *name)
      scope = scopes[path[1].idx]
      col = path[2].key
      name = _var_name(path[3:])

      def show(x):
        if x == 'missing':
          return 'does not create it'
        return 'creates it' if x is None else f'creates it as {x[1]}{list(x[0])}'

      return errors.CondBranchVariablesError(
          f'{kind} at {scope.path_text}: variable "{name}" of collection '
          f'"{col}": branch 0 {show(a)}, branch {index} {show(b)}. All '
          'branches must create the same variables; run every branch once '
          'during initialization, before the conditional.')
  return None


def _branches(kind, branches, select, scope, operands, variables, rngs):
  def inner(scope_fn, repack_fn, variable_groups, rng_groups):
    scopes = _outer_scopes(scope_fn)
    signatures = [None] * len(branches)

    def make(index, branch_fn):
      def pure(*ops):
        inner_scope = scope_fn(variable_groups, rng_groups)
        y = branch_fn(inner_scope, *ops)
        out = repack_fn(inner_scope)
        signatures[index] = _branch_signature(out)
        return y, out
      return pure

    pure = [make(i, b) for i, b in enumerate(branches)]
    try:
      return select(pure, *operands)
    except TypeError as err:
      if all(s is not None for s in signatures):
        better = _branch_error(kind, scopes, signatures)
        if better is not None:
          raise better from err
      raise

  return pack(inner, (variables,), (variables,), (rngs,), name=kind)(scope)


def cond(pred, true_fun: Callable[..., Any], false_fun: Callable[..., Any],
         scope, *operands, variables=True, rngs=True):
  """``jax.lax.cond`` over scopes: ``true_fun(scope, *operands)`` or
  ``false_fun(scope, *operands)``. Both branches must create the same
  variables (their writes must have identical structure)."""
  return _branches(
      'cond', (true_fun, false_fun),
      lambda pure, *ops: lax.cond(pred, pure[0], pure[1], *ops),
      scope, operands, variables, rngs)


def switch(index, branches: Sequence[Callable[..., Any]], scope, *operands,
           variables=True, rngs=True):
  """``jax.lax.switch`` over scopes: ``branches[index](scope, *operands)``.
  All branches must create the same variables."""
  return _branches(
      'switch', tuple(branches),
      lambda pure, *ops: lax.switch(index, pure, *ops),
      scope, operands, variables, rngs)


# -- remat ------------------------------------------------------------------------------


def checkpoint(fn: Callable[..., Any], variables=True, rngs=True,
               concrete: bool = False, prevent_cse: bool = True,
               static_argnums: int | tuple = (),
               policy: Callable[..., bool] | None = None):
  """``jax.checkpoint`` for scope functions: intermediates of ``fn`` are
  recomputed in the backward pass instead of stored. ``static_argnums``
  count the arguments after the scope from 0."""

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args,
            **kwargs):
    if concrete:
      raise NotImplementedError(
          'checkpoint(concrete=True) is not supported by JAX any more; use '
          'static_argnums.')
    shifted = jax.tree_util.tree_map(lambda i: i + 2, static_argnums)

    @functools.wraps(fn)
    def rematted(variable_groups, rng_groups, *args, **kwargs):
      scope = scope_fn(variable_groups, rng_groups)
      y = fn(scope, *args, **kwargs)
      return y, repack_fn(scope)

    return jax.checkpoint(rematted, prevent_cse=prevent_cse, policy=policy,
                          static_argnums=shifted)(
                              variable_groups, rng_groups, *args, **kwargs)

  return pack(inner, (variables,), (variables,), (rngs,), name='remat',
              enable_kwargs=True)


remat = checkpoint


def remat_scan(body_fn: Callable[..., Any], lengths: Sequence[int],
               policy: Callable[..., bool] | None = None,
               variable_broadcast=False, variable_carry=False,
               variable_axes: Mapping = {True: 0},  # pylint: disable=dangerous-default-value
               split_rngs: Mapping = {True: True}):  # pylint: disable=dangerous-default-value
  """Repeats ``body_fn(scope, carry) -> carry`` ``prod(lengths)`` times as
  nested scans, each level rematerialised, so memory grows like
  ``n ** (1 / len(lengths))``. Variables get one leading axis per level."""
  level = functools.partial(scan, variable_broadcast=variable_broadcast,
                            variable_carry=variable_carry,
                            variable_axes=variable_axes,
                            split_rngs=split_rngs)
  if len(lengths) == 1:
    def once(scope, carry):
      return body_fn(scope, carry), ()
    return lambda scope, c: level(once, length=lengths[0])(scope, c)[0]

  @functools.partial(remat, policy=policy, prevent_cse=False)
  def nested(scope, carry):
    carry = remat_scan(body_fn, lengths[1:], policy, variable_broadcast,
                       variable_carry, variable_axes, split_rngs)(scope, carry)
    return carry, ()

  return lambda scope, c: level(nested, length=lengths[0])(scope, c)[0]


# -- jit ------------------------------------------------------------------------------------


def _counter_state(counters: dict) -> tuple:
  """A hashable snapshot of a (nested) rng counter dict."""
  return tuple((k, _counter_state(v) if isinstance(v, dict) else v)
               for k, v in counters.items())


def _restore_counters(counters: dict, state: tuple):
  for k, v in state:
    if isinstance(v, tuple):
      sub = counters.get(k)
      if sub is None:
        sub = counters[k] = {}
      _restore_counters(sub, v)
    else:
      counters[k] = v


def _all_zero(state: tuple) -> bool:
  return all(_all_zero(v) if isinstance(v, tuple) else v == 0
             for _, v in state)


def _counter_changes(before: tuple, after: tuple) -> tuple:
  """What a call changed in a counter snapshot, as a state to restore.

  New child entries whose counters are all zero are left out: a later push
  creates exactly those, so replaying them changes nothing.
  """
  old = dict(before)
  changes = []
  for k, v in after:
    prev = old.get(k)
    if isinstance(v, tuple):
      if prev is None:
        if not _all_zero(v):
          changes.append((k, v))
      elif prev != v:
        sub = _counter_changes(prev, v)
        if sub:
          changes.append((k, sub))
    elif prev != v:
      changes.append((k, v))
  return tuple(changes)


def _without_zero_children(state: tuple) -> tuple:
  """A counter snapshot with all-zero child entries dropped: a push creates
  exactly those, so states differing only in them behave the same."""
  out = []
  for k, v in state:
    if isinstance(v, tuple):
      if _all_zero(v):
        continue
      v = _without_zero_children(v)
    out.append((k, v))
  return tuple(out)


class _JitContext(threading.local):

  def __init__(self):
    super().__init__()
    self.stack = []


class _JitEntry:
  __slots__ = ('call', 'changes')

  def __init__(self, call):
    self.call = call
    self.changes = None  # per scope, set after the first (tracing) call


_JIT_CACHE_LIMIT = 128


def jit(fn: Callable[..., Any], variables=True, rngs=True,
        static_argnums: int | Iterable[int] = (),
        static_argnames: str | Iterable[str] = (),
        donate_argnums: int | Iterable[int] = (), device=None,
        backend: str | None = None):
  """``jax.jit`` for scope functions.

  As in Flax, the result is called as ``f(scope, hash_key, *args)`` and runs
  ``fn(scope, hash_key, *args)``; ``hash_key`` is any hashable value telling
  apart calls that need different traces (modules pass a fingerprint of
  themselves). Argument numbers count the scope as 0 and skip ``hash_key``.

  Compiled functions are cached per ``hash_key``, scope position, mutability,
  flags and rng counter state; a call that hits the cache runs without
  tracing and advances the rng counters as the traced call did. Inside,
  rng sequences start from the bare keys (the scope names already folded
  into them lazily are dropped, as in Flax).
  """
  if not isinstance(static_argnums, Iterable):
    static_argnums = (static_argnums,)
  if not isinstance(donate_argnums, Iterable):
    donate_argnums = (donate_argnums,)
  # Inside: (variable_groups, rng_groups, *args); user arg i>0 is args[i-1].
  jit_kwargs = dict(
      static_argnums=tuple(i + 1 for i in static_argnums if i > 0),
      static_argnames=static_argnames,
      donate_argnums=tuple(i + 1 for i in donate_argnums if i > 0))
  if device is not None:
    jit_kwargs['device'] = device
  if backend is not None:
    jit_kwargs['backend'] = backend
  context = _JitContext()
  cache = {}

  def new_entry():
    # A fresh function object per entry so that JAX's own caches (which key
    # on the function) never mix up traces of different fingerprints.
    def traced(variable_groups, rng_groups, *args, **kwargs):
      scope_fn, repack_fn, hash_key = context.stack[-1]
      scope = scope_fn(variable_groups, rng_groups, keep_rng_suffix=False)
      y = fn(scope, hash_key, *args, **kwargs)
      return y, repack_fn(scope)

    functools.update_wrapper(traced, fn)
    return _JitEntry(jax.jit(traced, **jit_kwargs))

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, hash_key,
            *args, **kwargs):
    packing = scope_fn.__self__
    scopes = packing.scopes
    # Not the scopes' paths: the traced computation sees only the variable
    # groups and bare keys, so identical modules at different paths share
    # one compiled function (as in Linen).
    if len(scopes) == 1:
      s = scopes[0]
      state = _counter_state(s.rng_counters) if s.rng_counters else ()
      before = (state,)
      where = ((_hashable_filter(s.mutable), _hashable_flags(s.flags)),)
      counters = (_without_zero_children(state) if state else (),)
    else:
      before = tuple(_counter_state(s.rng_counters) for s in scopes)
      where = tuple((_hashable_filter(s.mutable), _hashable_flags(s.flags))
                    for s in scopes)
      counters = tuple(_without_zero_children(b) for b in before)
    fingerprint = (hash_key, where, packing.links, packing.treedef, counters)
    entry = cache.get(fingerprint)
    if entry is None:
      if len(cache) >= _JIT_CACHE_LIMIT:
        cache.pop(next(iter(cache)))
      entry = cache[fingerprint] = new_entry()
    context.stack.append((scope_fn, repack_fn, hash_key))
    try:
      result = entry.call(variable_groups, rng_groups, *args, **kwargs)
    finally:
      context.stack.pop()
    if entry.changes is None:
      changes = tuple(_counter_changes(b, _counter_state(s.rng_counters))
                      for s, b in zip(scopes, before))
      entry.changes = changes if any(changes) else ()
    else:
      for s, state in zip(scopes, entry.changes):
        _restore_counters(s.rng_counters, state)
    return result

  return pack(inner, (variables,), (variables,), (rngs,), name='jit',
              enable_kwargs=True)


def fold_rngs(fn: Callable[..., Any], variables=True, rngs=True):
  """Calls ``fn(scope, hash_key, *args)`` on a scope whose rng sequences
  start from their bare keys (the lazily folded scope names dropped), like
  the inside of ``jit`` but without compiling."""

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, hash_key,
            *args, **kwargs):
    scope = scope_fn(variable_groups, rng_groups, keep_rng_suffix=False)
    y = fn(scope, hash_key, *args, **kwargs)
    return y, repack_fn(scope)

  return pack(inner, (variables,), (variables,), (rngs,), name='fold_rngs',
              enable_kwargs=True)


# -- differentiation -----------------------------------------------------------------------


def _bwd_with_tree(treedef, bwd, cotangent):
  var_grads, *input_grads = bwd(cotangent)
  return (treedef.unflatten(var_grads), *input_grads)


def _scope_treedef(scope):
  return jax.tree_util.tree_structure(
      scope, is_leaf=lambda x: isinstance(x, Scope))


def vjp(fn: Callable[..., Any], scope, *primals, has_aux: bool = False,
        reduce_axes=(), vjp_variables='params', variables=True, rngs=True):
  """``jax.vjp`` of ``fn(scope, *primals)`` with respect to the primals and
  the ``vjp_variables`` collections.

  Returns ``(y, vjp_fn)`` (``(y, vjp_fn, aux)`` with ``has_aux``);
  ``vjp_fn(cotangent)`` returns ``(variable_grads, *primal_grads)`` where
  ``variable_grads`` has the structure of ``scope``.
  """
  if reduce_axes:
    raise NotImplementedError('vjp: reduce_axes is no longer supported.')

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    vjp_vars, other_vars = variable_groups

    @functools.wraps(fn)
    def pure(vjp_vars, *args):
      inner_scope = scope_fn((vjp_vars, other_vars), rng_groups)
      if has_aux:
        y, aux = fn(inner_scope, *args)
      else:
        y, aux = fn(inner_scope, *args), ()
      return y, (aux, repack_fn(inner_scope))

    y, bwd, (aux, out_vars) = jax.vjp(pure, vjp_vars, *args, has_aux=True)
    bwd = jax.tree_util.Partial(
        functools.partial(_bwd_with_tree, _scope_treedef(scope)), bwd)
    if has_aux:
      return (y, bwd, aux), out_vars
    return (y, bwd), out_vars

  return pack(inner, (vjp_variables, variables), (variables,), (rngs,),
              name='vjp')(scope, *primals)


def value_and_grad(fn: Callable[..., Any], scope, *primals,
                   has_aux: bool = False, reduce_axes=(), variables=True,
                   rngs=True):
  """Value of the scalar ``fn(scope, *primals)`` and its gradient with
  respect to the primals (not the variables). Returns ``(y, grads)`` or
  ``(y, aux, grads)`` with ``has_aux``."""
  if reduce_axes:
    raise NotImplementedError(
        'value_and_grad: reduce_axes is no longer supported.')

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    @functools.wraps(fn)
    def pure(*args):
      inner_scope = scope_fn(variable_groups, rng_groups)
      if has_aux:
        y, aux = fn(inner_scope, *args)
      else:
        y, aux = fn(inner_scope, *args), ()
      return y, (aux, repack_fn(inner_scope))

    y, bwd, (aux, out_vars) = jax.vjp(pure, *args, has_aux=True)
    grads = bwd(jax.numpy.ones_like(y))
    if has_aux:
      return (y, aux, grads), out_vars
    return (y, grads), out_vars

  return pack(inner, (variables,), (variables,), (rngs,),
              name='value_and_grad')(scope, *primals)


def jvp(fn: Callable[..., Any], scope, primals, tangents, variable_tangents,
        variables=True, rngs=True):
  """``jax.jvp`` of ``fn(scope, *primals)``; ``variable_tangents`` gives
  ``{collection: tangents}`` per scope (collections left out have zero
  tangent). Returns ``(y, y_tangent)``."""
  treedef = _scope_treedef(scope)
  variable_tangents = tuple(
      {col: t for col, t in per_scope.items() if t}
      for per_scope in treedef.flatten_up_to(variable_tangents))
  target = tuple(variable_tangents[0].keys()) if variable_tangents else ()

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    jvp_vars, other_vars = variable_groups

    @functools.wraps(fn)
    def pure(jvp_vars, args):
      inner_scope = scope_fn((jvp_vars, other_vars), rng_groups)
      y = fn(inner_scope, *args)
      return y, repack_fn(inner_scope)

    (y, out_vars), (y_tangent, _) = jax.jvp(
        pure, (jvp_vars, args), (variable_tangents, tangents))
    return (y, y_tangent), out_vars

  return pack(inner, (target, variables), (variables,), (rngs,),
              name='jvp')(scope, *primals)


def custom_vjp(fn: Callable[..., Any], forward_fn: Callable[..., Any],
               backward_fn: Callable[..., Any], grad_vars='params',
               nondiff_argnums=()):
  """``jax.custom_vjp`` for scope functions.

  ``forward_fn(scope, *args) -> (y, residuals)`` runs when a gradient is
  taken; ``backward_fn(*nondiff_args, residuals, y_cotangent)`` returns
  ``(variable_cotangents, *arg_cotangents)``, the first shaped like the
  ``grad_vars`` collections of the scope(s). ``nondiff_argnums`` count the
  scope as 0.
  """

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    grad_variables, other_variables = variable_groups
    treedef_box = []

    def primal(grad_variables, *args):
      inner_scope = scope_fn((grad_variables, other_variables), rng_groups)
      y = fn(inner_scope, *args)
      return y, repack_fn(inner_scope)

    def forward(grad_variables, *args):
      scopes = scope_fn((grad_variables, other_variables), rng_groups)
      treedef_box.append(_scope_treedef(scopes))
      y, residuals = forward_fn(scopes, *args)
      return (y, repack_fn(scopes)), residuals

    def backward(*args):
      nondiff, (residuals, (y_cotangent, _)) = args[:-2], args[-2:]
      var_cotangents, *arg_cotangents = backward_fn(*nondiff, residuals,
                                                    y_cotangent)
      var_cotangents = tuple(treedef_box[-1].flatten_up_to(var_cotangents))
      return (var_cotangents, *arg_cotangents)

    wrapped = jax.custom_vjp(primal, nondiff_argnums=nondiff_argnums)
    wrapped.defvjp(forward, backward)
    return wrapped(grad_variables, *args)

  return pack(inner, (grad_vars, True), (grad_vars, True), (True,),
              name='custom_vjp')
