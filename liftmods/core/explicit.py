"""Output shardings on meshes with Explicit axes.

On an ``AxisType.Explicit`` mesh axis an array's sharding is part of its
type, and JAX asks the program for an operation's output sharding wherever
it cannot infer one: a contraction over a dimension sharded on both sides,
a gather from a sharded table, a convolution with a sharded kernel. The
built-in layers answer for their users with one rule, ``out_spec``:

  Every output dimension the activation (the first operand) has keeps the
  activation's sharding; every other output dimension (the weight's
  features) takes the weight's sharding, unless one of its mesh axes is
  one the activation's dimensions already use: then it is gathered whole
  (an axis of size 1, which splits nothing, is only dropped).

The weight's sharding is its type, which on Explicit axes is its logical
names through the active rules (a logically partitioned box reshards the
value it hands out). So a kernel sharded for FSDP (``embed -> data``, the
batch also on ``data``) is gathered for the contraction while the
activation keeps its batch split, and a contraction over a dimension
sharded on both sides gives the reduced result laid out by the rule; the
next logical constraint then lays it out as the model says. Where JAX can
infer a sharding, the rule gives the sharding JAX would infer.

A contraction over a dimension the activation splits over other mesh axes
than the weight is aligned first (``_contraction_aligned``): a weight
held whole there is sliced as the activation, and the product summed over
those axes, where the summed output is smaller than the gathered
activation; otherwise the activation is gathered. One the weight splits
over other axes is split as the weight instead (an all-to-all), or gathered
where the activation's other dimensions hold those axes. Done in the
program JAX differentiates, the backward pass reuses what the forward pass
moved.

A weight that splits a contracted dimension the activation holds whole
(FSDP over an axis the batch does not use, or any split contraction of a
weight) is gathered for the product. That gather, and an activation moved
for a weight that splits its output, are made under a derivative rule of
their own (``_aligning``, a ``custom_jvp``, so forward-mode
differentiation works) that takes each operand's gradient at its own
layout. Attention's products of two activations (``weight=False``) are
not gathered so.

Weights applied elementwise (biases, normalisation scales) take the
activation's sharding on the dimensions they share with it: ``match``.

Everything here is a no-op (one type lookup) unless an operand's type
carries Explicit mesh axes, so Auto meshes and single devices trace the
same programs as before.

>>> P = jax.sharding.PartitionSpec
>>> out_spec('bm', [('be', P('data', None)), ('em', P('data', 'model'))])
P('data', 'model')
>>> out_spec('be', [('bm', P('data', 'model')), ('me', P('model', 'data'))])
P('data', None)
>>> out_spec('bm', [('be', P('data', None)), ('em', P(None, ('data', 'model')))])
P('data', None)
"""
import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from liftmods import errors
from liftmods import jax_private
from liftmods.core import caching

PartitionSpec = jax.sharding.PartitionSpec
Labels = Sequence[Hashable]


@functools.lru_cache(maxsize=64)
def _explicit_axes(mesh) -> frozenset:
  return frozenset(
      name for name, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind == jax.sharding.AxisType.Explicit)


caching.register('core.explicit._explicit_axes', caching.Policy(
    holds="the names of a mesh's Explicit axes",
    keyed_on='the (abstract) mesh',
    bound='64 entries',
    cleared='on eviction'), clear=_explicit_axes.cache_clear)


def explicit_mesh(*arrays):
  """The mesh of the first of ``arrays`` whose type carries Explicit mesh
  axes, or None (no mesh, Auto axes only, or not arrays). Values of other
  types (a quantization library's wrapped kernel) carry no mesh."""
  for x in arrays:
    if not isinstance(x, jax.Array):
      continue
    sharding = getattr(jax.typeof(x), 'sharding', None)
    mesh = getattr(sharding, 'mesh', None)
    if mesh is not None and not mesh.empty and _explicit_axes(mesh):
      return mesh
  return None


def spec_of(x) -> tuple:
  """The entries of ``x``'s type's PartitionSpec, one per dimension."""
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (jnp.ndim(x) - len(spec))


def _axes(entry) -> tuple:
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: Sequence[str]):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def out_spec(out_labels: Labels,
             operands: Sequence[tuple[Labels, Sequence[Any]]],
             sizes: dict[str, int] | None = None) -> PartitionSpec:
  """The output sharding of a contraction, by the rule of this module.

  Args:
    out_labels: one label per output dimension.
    operands: ``(labels, spec)`` per operand, the activation first: one
      label and one PartitionSpec entry per operand dimension; a label
      names the same dimension in every operand and the output.
    sizes: the mesh's axis sizes, if known: an axis of size 1 splits
      nothing, so a weight dimension sharing only such axes with the
      activation keeps its other axes instead of being gathered whole.

  Returns:
    The PartitionSpec of the output.

  >>> weight = PartitionSpec(None, ('data', 'model'))
  >>> out_spec('bm', [('be', PartitionSpec('data')), ('em', weight)],
  ...          sizes={'data': 1, 'model': 8})
  P('data', 'model')
  """
  sizes = sizes or {}
  chosen = {}
  used = set()
  for labels, spec in operands:
    for label, entry in zip(labels, spec):
      if label in chosen or label not in out_labels:
        continue
      axes = _axes(entry)
      shared = used.intersection(axes)
      kept = (() if _splitting(shared, sizes) else
              tuple(a for a in axes if a not in shared))
      chosen[label] = kept
      used.update(kept)
  return PartitionSpec(*(_entry(chosen.get(label, ())) for label in
                         out_labels))


def _sizes(mesh) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes))


def _splitting(axes, sizes: dict[str, int]) -> tuple:
  """Those of ``axes`` that split a dimension: an axis of size 1 splits
  nothing (one missing from ``sizes`` counts as splitting)."""
  return tuple(a for a in axes if sizes.get(a) != 1)


def _split(entry, sizes: dict[str, int]) -> tuple:
  """The axes of a PartitionSpec ``entry`` that split its dimension:
  ('data', 'model') over a data axis of 1 is the same split as 'model'."""
  return _splitting(_axes(entry), sizes)


def _sharding(mesh, spec):
  return jax.sharding.NamedSharding(mesh, spec)


def _where(where) -> str:
  """``where`` as text: a string as it is, a module as its class and path."""
  if isinstance(where, str):
    return where
  scope = getattr(where, 'scope', None)
  name = type(where).__name__
  return f'{name} at {scope.path_text}' if scope is not None else name


def _conflict(where, what: str, specs: dict, cause: Exception):
  """JAX's sharding type error, said of ``where``."""
  listed = ', '.join(f'{name} {spec}' for name, spec in specs.items())
  return errors.ExplicitShardingError(_where(where), what, listed, cause)


def given(where, what: str, out_sharding, mesh, ndim: int) -> PartitionSpec:
  """A user's ``out_sharding`` (PartitionSpec or NamedSharding) as a
  PartitionSpec, checked against ``mesh`` and the output's rank."""
  spec = getattr(out_sharding, 'spec', out_sharding)
  if not isinstance(spec, PartitionSpec):
    problem = f'expected a PartitionSpec or NamedSharding, got {spec!r}'
  elif len(spec) > ndim:
    problem = f'it has {len(spec)} entries for an output of rank {ndim}'
  else:
    axes = [a for entry in spec for a in _axes(entry)]
    wrong = [a for a in axes if a not in _explicit_axes(mesh)]
    twice = {a for a in axes if axes.count(a) > 1}
    problem = (f'mesh axis {wrong[0]!r} is not an Explicit axis of the mesh '
               f'{dict(zip(mesh.axis_names, mesh.axis_types))}' if wrong else
               f'mesh axis {sorted(twice)[0]!r} appears twice' if twice
               else None)
  if problem:
    raise errors.ExplicitShardingError(
        _where(where), what, f'out_sharding {out_sharding}', problem)
  return spec


def run(where, what: str, fn: Callable[..., Any], args: Sequence[Any],
        spec: PartitionSpec, mesh, native: bool):
  """``fn(*args)`` with its output laid out as ``spec`` on ``mesh``.

  ``native``: ``fn`` takes ``out_sharding=`` itself (JAX's own ops);
  otherwise it runs under ``jax.sharding.auto_axes``, so any op (an
  injected ``dot_general``, a convolution, a gather) works, the partitioner
  choosing its collectives as on an Auto mesh.
  """
  out = _sharding(mesh, spec)
  try:
    if native:
      return fn(*args, out_sharding=out)
    return jax.sharding.auto_axes(fn, out_sharding=out)(*args)
  except jax_private.ShardingTypeError as e:
    raise _conflict(where, what, {f'operand {i}': jax.typeof(a).sharding.spec
                                  for i, a in enumerate(args)}, e) from e


def _native(op, jax_op) -> bool:
  """Whether ``op`` is ``jax_op`` (or a partial of it), which takes
  ``out_sharding=`` itself."""
  return op is jax_op or getattr(op, 'func', None) is jax_op


def _dot_labels(lhs_ndim: int, rhs_ndim: int, dimension_numbers):
  """Labels of a ``dot_general``'s lhs, rhs and output dimensions."""
  (lc, rc), (lb, rb) = dimension_numbers
  lhs = [('l', i) for i in range(lhs_ndim)]
  rhs = [('r', i) for i in range(rhs_ndim)]
  for l, r in zip(tuple(lc) + tuple(lb), tuple(rc) + tuple(rb)):
    rhs[r] = lhs[l]
  out = ([lhs[i] for i in lb] +
         [lhs[i] for i in range(lhs_ndim) if i not in lc and i not in lb] +
         [rhs[i] for i in range(rhs_ndim) if i not in rc and i not in rb])
  return lhs, rhs, out


def dot_general(where, lhs, rhs, dimension_numbers, *,
                op: Callable[..., Any] | None = None, out_sharding=None,
                weight: bool = True, **kwargs):
  """``op(lhs, rhs, dimension_numbers, **kwargs)`` (``lax.dot_general`` by
  default), its output sharding chosen by ``out_spec`` on Explicit axes.

  Args:
    where: the module (or a text naming the place), for errors.
    lhs: the activation.
    rhs: the weight.
    dimension_numbers: as ``lax.dot_general``'s.
    op: the dot-product op (an injected one need not take
      ``out_sharding``).
    out_sharding: a PartitionSpec or NamedSharding that overrides the rule
      (ignored off Explicit axes, where JAX chooses).
    weight: ``rhs`` is a weight (False: a second activation, as attention's
      keys), which is gathered where it alone splits a contracted dimension.
    **kwargs: passed to ``op`` (``precision``, ``preferred_element_type``).

  Returns:
    The product.
  """
  op = lax.dot_general if op is None else op
  mesh = explicit_mesh(lhs, rhs)
  if mesh is None:
    return op(lhs, rhs, dimension_numbers, **kwargs)
  labels = _dot_labels(jnp.ndim(lhs), jnp.ndim(rhs), dimension_numbers)
  fn = functools.partial(op, dimension_numbers=dimension_numbers, **kwargs)
  return _contract(where, 'dot_general', fn, (lhs, rhs), labels, mesh,
                   out_sharding, native=_native(op, lax.dot_general),
                   weight=weight)


def _contraction_aligned(lhs, rhs, labels, sizes, out_labels):
  """The specs ``(lhs, rhs)`` take so that each dimension they contract is
  split alike: where the activation ``lhs`` splits one over mesh axes the
  weight ``rhs`` does not, either the weight is split as the activation (a
  local slice of a replicated weight; the product is then summed over
  those axes) or the activation is gathered whole, whichever moves fewer
  elements per device (the summed output's shard against the gathered
  activation's); where the weight splits it over other axes, the
  activation is split as the weight (an all-to-all, each device keeping as
  many elements) unless its other dimensions use those axes, and gathered
  then. A weight split where the activation is whole (FSDP) is gathered by
  ``_contract``.

  The partitioner moves the same data for the product anyway; moved in the
  program JAX differentiates (``_contract``), the backward pass reuses it
  where a collective inside the product would be done again."""
  (l, r), lhs_spec, rhs_spec = labels, list(spec_of(lhs)), list(spec_of(rhs))
  where_r = {label: j for j, label in enumerate(r)}

  def summing_moves_less(axes):
    gathered = (_shard_size(jnp.shape(lhs), lhs_spec, sizes) *
                math.prod(sizes[a] for a in axes))
    summed = (_shard_size(jnp.shape(lhs), lhs_spec, sizes,
                          [x in out_labels for x in l]) *
              _shard_size(jnp.shape(rhs), rhs_spec, sizes,
                          [x in out_labels and x not in l for x in r]))
    return summed < gathered

  for i, label in enumerate(l):
    axes = _split(lhs_spec[i], sizes)
    j = where_r.get(label)
    if label in out_labels or j is None or not axes:
      continue
    weight_axes = _split(rhs_spec[j], sizes)
    if weight_axes == axes:
      continue
    used_r = {a for entry in rhs_spec for a in _axes(entry)}
    others = {a for k, entry in enumerate(lhs_spec) if k != i
              for a in _axes(entry)}
    if (not weight_axes and not used_r.intersection(axes) and
        summing_moves_less(axes)):
      rhs_spec[j] = _entry([a for a in _axes(lhs_spec[i]) if a not in used_r])
    elif weight_axes and not others.intersection(weight_axes):
      lhs_spec[i] = _entry([a for a in _axes(rhs_spec[j]) if a not in others])
    else:
      lhs_spec[i] = None
  return PartitionSpec(*lhs_spec), PartitionSpec(*rhs_spec)


def _contract(where, what: str, fn, args, labels, mesh, out_sharding,
              native: bool, weight: bool):
  """``run`` for a contraction of ``args`` (activation, weight) with the
  dimension ``labels`` ``(lhs, rhs, out)``: the operands aligned
  (``_contraction_aligned``), a weight that splits a contracted dimension
  the activation holds whole gathered (``_weight_gathered``), the output
  laid out by ``out_spec`` unless ``out_sharding`` says otherwise. Where
  that gather is made, or where the activation is moved for a weight that
  splits its output (so the activation's gradient is a sum over those
  axes), the product goes through ``_aligning``; otherwise the operands
  are resharded before it."""
  l, r, out = labels
  sizes = _sizes(mesh)
  lhs_spec, rhs_spec = _contraction_aligned(*args, (l, r), sizes, out)
  if out_sharding is None:
    spec = out_spec(out, [(l, lhs_spec), (r, rhs_spec)], sizes)
  else:
    spec = given(where, what, out_sharding, mesh, len(out))
  gathered = native and weight and _weight_gathered(
      lhs_spec, rhs_spec, (l, r), sizes, out, spec)
  rhs_spec = gathered or rhs_spec
  moved_into_a_sum = tuple(lhs_spec) != spec_of(args[0]) and any(
      _split(entry, sizes) for entry, label in zip(rhs_spec, r)
      if label in out and label not in l)
  if native and (gathered or moved_into_a_sum):
    fn = _aligning(fn, lhs_spec, rhs_spec, mesh)
  else:
    args = (_resharded(args[0], lhs_spec, mesh),
            _resharded(args[1], rhs_spec, mesh))
  return run(where, what, fn, args, spec, mesh, native=native)


def _weight_gathered(lhs_spec, rhs_spec, labels, sizes, out_labels, out):
  """Where the weight splits a contracted dimension the activation holds
  whole (FSDP): the layout the product needs it in, those dimensions
  gathered and its output features gathered as far as the output ``out``
  is; else None."""
  (l, r), rhs_spec = labels, list(rhs_spec)
  where_l = {label: i for i, label in enumerate(l)}
  where_out = {label: k for k, label in enumerate(out_labels)}
  found = False
  for j, label in enumerate(r):
    i, k = where_l.get(label), where_out.get(label)
    if i is None and k is not None:
      kept = _axes(out[k]) if k < len(out) else ()
      if set(kept) <= set(_axes(rhs_spec[j])):
        rhs_spec[j] = _entry(kept)
    elif (i is not None and k is None and
          _split(rhs_spec[j], sizes) and not _split(lhs_spec[i], sizes)):
      rhs_spec[j], found = None, True
  return PartitionSpec(*rhs_spec) if found else None


def _aligning(fn, lhs_spec, rhs_spec, mesh):
  """``fn`` (a product taking ``out_sharding``) on its operands laid out
  as ``lhs_spec`` and ``rhs_spec``, under a derivative rule of its own
  (a ``custom_jvp``, so forward-mode differentiation works): each
  operand's tangent enters the product at the operand's own layout, the
  other operand as laid out for the product. So each gradient is taken
  at its operand's layout, the partitioner choosing how, as on an Auto
  mesh. Differentiating the resharding instead gives a gradient the
  moved layout: a gathered weight's gradient reduced whole over the
  batch's axes and then sliced, a gathered activation's reduced whole over
  the weight's output axes and then sliced."""

  def aligning(x, w, out_sharding):
    laid_out = lambda x, w: (_resharded(x, lhs_spec, mesh),
                             _resharded(w, rhs_spec, mesh))
    product = jax.custom_jvp(
        lambda x, w: fn(*laid_out(x, w), out_sharding=out_sharding))

    def jvp(primals, tangents):
      (xa, wa), (dx, dw) = laid_out(*primals), tangents
      y = fn(xa, wa, out_sharding=out_sharding)
      terms = [fn(*pair, out_sharding=out_sharding)
               for pair in ((dx, wa), (xa, dw))
               if not any(isinstance(t, SymbolicZero) for t in pair)]
      # JAX calls this rule only with some tangent not a symbolic zero.
      return y, functools.reduce(jnp.add, terms)

    product.defjvp(jvp, symbolic_zeros=True)
    return product(x, w)

  return aligning


def _shard_size(shape, spec, sizes, kept=None) -> int:
  """Elements per device of an array laid out as ``spec``, counting only
  the dimensions ``kept`` marks (all by default)."""
  kept = [True] * len(shape) if kept is None else kept
  return math.prod(n // math.prod(sizes[a] for a in _axes(entry))
                   for n, entry, keep in zip(shape, spec, kept) if keep)


def _resharded(x, spec, mesh):
  """``x`` laid out as ``spec`` on ``mesh``; ``x`` where it already is."""
  if tuple(spec) == spec_of(x):
    return x
  return jax.sharding.reshard(x, _sharding(mesh, PartitionSpec(*spec)))


def _einsum_labels(subscripts: str, ndims: Sequence[int]):
  """Per operand and for the output, one label per dimension; the
  dimensions an ellipsis stands for are labelled by their distance from the
  right, as they broadcast."""
  inputs, output = subscripts.replace(' ', '').split('->')
  terms = inputs.split(',')

  def expand(term, ndim):
    if '...' not in term:
      return list(term)
    head, tail = term.split('...')
    n = ndim - len(head) - len(tail)
    return list(head) + [('...', n - i) for i in range(n)] + list(tail)

  operands = [expand(t, n) for t, n in zip(terms, ndims)]
  longest = max((sum(isinstance(l, tuple) for l in ls) for ls in operands),
                default=0)
  return operands, expand(output, len(output.replace('...', '')) + longest)


def einsum(where, subscripts: str, lhs, rhs, *,
           op: Callable[..., Any] | None = None, out_sharding=None,
           weight: bool = True, **kwargs):
  """``op(subscripts, lhs, rhs, **kwargs)`` (``jnp.einsum`` by default),
  its output sharding chosen by ``out_spec`` on Explicit axes.

  ``subscripts`` must name its output (``'...->...'``). Arguments as
  ``dot_general``'s.
  """
  op = jnp.einsum if op is None else op
  mesh = explicit_mesh(lhs, rhs)
  if mesh is None or '->' not in subscripts:
    return op(subscripts, lhs, rhs, **kwargs)
  (l, r), out = _einsum_labels(subscripts, (jnp.ndim(lhs), jnp.ndim(rhs)))
  fn = functools.partial(op, subscripts, **kwargs)
  return _contract(where, 'einsum', fn, (lhs, rhs), (l, r, out), mesh,
                   out_sharding, native=_native(op, jnp.einsum),
                   weight=weight)


def conv(where, fn: Callable[..., Any], lhs, rhs, out_sharding=None):
  """``fn(lhs, rhs)``, a channels-last convolution (batch first, features
  last, spatial dimensions between; the kernel's last dimension its output
  features), laid out by the rule on Explicit axes: the batch (and, where
  the output keeps the input's spatial size, the spatial dimensions) as
  ``lhs``, the features as the kernel's."""
  mesh = explicit_mesh(lhs, rhs)
  if mesh is None:
    return fn(lhs, rhs)
  if out_sharding is not None:
    spec = given(where, 'convolution', out_sharding, mesh, jnp.ndim(lhs))
  else:
    spatial = range(jnp.ndim(lhs) - 2)
    plain = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype)
    out_shape = jax.eval_shape(fn, plain(lhs), plain(rhs)).shape
    same_spatial = out_shape[1:-1] == jnp.shape(lhs)[1:-1]
    lhs_labels = ['b'] + [('s' if same_spatial else 'in', i)
                          for i in spatial] + ['c']
    rhs_labels = [('k', i) for i in range(jnp.ndim(rhs) - 2)] + ['c', 'o']
    out = ['b'] + [('s' if same_spatial else 'out', i) for i in spatial]
    spec = out_spec(out + ['o'], [(lhs_labels, spec_of(lhs)),
                                  (rhs_labels, spec_of(rhs))],
                    _sizes(mesh))
  return run(where, 'convolution', fn, (lhs, rhs), spec, mesh, native=False)


def take(where, table, indices, out_sharding=None):
  """``jnp.take(table, indices, axis=0)``, laid out by the rule on Explicit
  axes: the indices' dimensions as ``indices``, the features as the
  table's."""
  mesh = explicit_mesh(table, indices)
  fn = functools.partial(jnp.take, axis=0)
  if mesh is None:
    return fn(table, indices)
  if out_sharding is not None:
    spec = given(where, 'embedding lookup', out_sharding, mesh,
                 jnp.ndim(indices) + jnp.ndim(table) - 1)
  else:
    n = jnp.ndim(indices)
    idx = list(range(n))
    feats = [('f', i) for i in range(1, jnp.ndim(table))]
    spec = out_spec(idx + feats, [(idx, spec_of(indices)),
                                  ([('row',)] + feats, spec_of(table))],
                    _sizes(mesh))
  return run(where, 'embedding lookup', fn, (table, indices), spec, mesh,
             native=False)


def as_first(where, what: str, fn: Callable[..., Any], *args):
  """``fn(*args)``, whose output is shaped like ``args[0]`` (attention's
  output is the query's shape), laid out as ``args[0]`` on Explicit axes:
  the activation keeps its sharding, whatever the op does inside (run
  under ``auto_axes``, the partitioner chooses its collectives)."""
  mesh = explicit_mesh(*(a for a in args if a is not None))
  if mesh is None:
    return fn(*args)
  return run(where, what, fn, args, PartitionSpec(*spec_of(args[0])), mesh,
             native=False)


def windowed(fn: Callable[..., Any], x):
  """``fn(x)``, an op over windows of ``x`` (a pooling) whose output keeps
  ``x``'s rank: where ``x``'s type shards a dimension whose size the op
  changes (which JAX cannot lay out on Explicit axes unless the sizes
  divide), that dimension is gathered first; the others keep their
  layout."""
  mesh = explicit_mesh(x)
  if mesh is None:
    return fn(x)
  plain = jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)
  out_shape = jax.eval_shape(fn, plain).shape
  spec = spec_of(x)
  kept = tuple(e if n == m else None
               for e, n, m in zip(spec, jnp.shape(x), out_shape))
  if kept != spec:
    x = jax.sharding.reshard(x, _sharding(mesh, PartitionSpec(*kept)))
  return fn(x)


def sharding_like(x, shape):
  """The sharding of an array of ``shape`` (aligned with ``x`` at the
  right) laid out as ``x`` where the sizes agree and unsharded elsewhere,
  for an op that takes ``out_sharding=`` (random bits for a dropout mask:
  each device draws its own block, not the whole mask); None off Explicit
  axes."""
  mesh = explicit_mesh(x)
  if mesh is None:
    return None
  offset = jnp.ndim(x) - len(shape)
  spec = spec_of(x)
  return _sharding(mesh, PartitionSpec(*(
      spec[offset + i] if offset + i >= 0 and
      jnp.shape(x)[offset + i] == n else None
      for i, n in enumerate(shape))))


def match(w, x):
  """``w`` (broadcasting against ``x``, aligned at the right) laid out as
  ``x`` on the dimensions it shares with it, and unsharded where it
  broadcasts: a bias or scale takes its activation's sharding (an FSDP
  weight is gathered). ``w`` as it is off Explicit axes."""
  if w is None or jnp.ndim(w) == 0:
    return w
  target = sharding_like(x, jnp.shape(w))
  if target is None or spec_of(w) == tuple(target.spec):
    return w
  return jax.sharding.reshard(w, target)


def like(new, old):
  """``new`` (a tree) with each leaf laid out as the leaf of ``old`` in its
  place, where both are arrays on Explicit axes and the layouts differ: a
  loop's carry keeps the layout it entered with, as ``lax.scan`` requires
  of its type. ``new`` as it is off Explicit axes."""
  old_leaves, tree = jax.tree_util.tree_flatten(old)
  new_leaves, new_tree = jax.tree_util.tree_flatten(new)
  if new_tree != tree or explicit_mesh(*old_leaves, *new_leaves) is None:
    return new

  def one(n, o):
    want = getattr(jax.typeof(o), 'sharding', None)
    have = getattr(jax.typeof(n), 'sharding', None)
    if (want is None or have is None or jnp.shape(n) != jnp.shape(o) or
        explicit_mesh(o, n) is None or
        tuple(want.spec) == tuple(have.spec)):
      return n
    return jax.sharding.reshard(n, want)

  return jax.tree_util.tree_unflatten(
      tree, [one(n, o) for n, o in zip(new_leaves, old_leaves)])


def layout_as(x, ref):
  """``x`` laid out as ``ref`` (of the same rank), where both are on
  Explicit axes and differ: an update written into a stored buffer
  (``dynamic_update_slice`` wants one layout for both) takes the buffer's.
  ``x`` as it is off Explicit axes."""
  mesh = explicit_mesh(ref, x)
  return x if mesh is None else _resharded(x, spec_of(ref), mesh)


def unshard_leading(xs):
  """``xs`` (a tree) with each leaf's leading dimension unsharded where its
  type shards it on Explicit axes: ``lax.scan`` cannot slice a scanned axis
  that is split over devices (a sequence-parallel input to an RNN), which
  on an Auto mesh the partitioner gathers."""
  leaves, tree = jax.tree_util.tree_flatten(xs)
  if explicit_mesh(*leaves) is None:
    return xs

  def one(x):
    if jnp.ndim(x) == 0 or explicit_mesh(x) is None:
      return x
    spec = spec_of(x)
    if spec[0] is None:
      return x
    return jax.sharding.reshard(
        x, _sharding(jax.typeof(x).sharding.mesh,
                     PartitionSpec(None, *spec[1:])))

  return jax.tree_util.tree_unflatten(tree, [one(x) for x in leaves])


__all__ = ['as_first', 'conv', 'dot_general', 'einsum', 'explicit_mesh',
           'layout_as', 'like', 'match', 'out_spec', 'sharding_like',
           'spec_of', 'take', 'unshard_leading', 'windowed']
