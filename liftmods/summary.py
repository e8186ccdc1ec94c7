"""Module summaries: ``tabulate`` shows one row per module method call.

The model is initialized abstractly (``jax.eval_shape`` over ``init``, so no
FLOPs are spent and no memory is allocated) while every wrapped module method
call is recorded: its path, class, method, and the shapes of its inputs and
outputs. Each row then lists the variables the module owns, per collection,
and the table ends with per-collection totals.

>>> import jax, jax.numpy as jnp
>>> import liftmods as nn
>>> class Affine(nn.Module):
...   features: int
...   @nn.compact
...   def __call__(self, x):
...     ones = jax.nn.initializers.ones
...     w = self.param('w', ones, (x.shape[-1], self.features))
...     return x @ w
>>> class Model(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     h = Affine(4)(x)
...     return Affine(2)(h)
>>> print(Model().tabulate(jax.random.key(0), jnp.ones((1, 3))))
                            Model Summary
┌──────────┬────────┬──────────────┬──────────────┬─────────────────┐
│ path     │ module │ inputs       │ outputs      │ params          │
╞══════════╪════════╪══════════════╪══════════════╪═════════════════╡
│          │ Model  │ float32[1,3] │ float32[1,2] │                 │
├──────────┼────────┼──────────────┼──────────────┼─────────────────┤
│ Affine_0 │ Affine │ float32[1,3] │ float32[1,4] │ w: float32[3,4] │
│          │        │              │              │                 │
│          │        │              │              │ 12 (48 B)       │
├──────────┼────────┼──────────────┼──────────────┼─────────────────┤
│ Affine_1 │ Affine │ float32[1,4] │ float32[1,2] │ w: float32[4,2] │
│          │        │              │              │                 │
│          │        │              │              │ 8 (32 B)        │
├──────────┼────────┼──────────────┼──────────────┼─────────────────┤
│          │        │              │        Total │ 20 (80 B)       │
└──────────┴────────┴──────────────┴──────────────┴─────────────────┘
<BLANKLINE>
                     Total Parameters: 20 (80 B)
"""
import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax

from liftmods import spmd
from liftmods.call_context import ModuleCall, record_calls, split_arrays
from liftmods.core import meta
from liftmods.core.filters import DenyList
from liftmods.core.frozen_dict import unfreeze  # nn.summary.unfreeze, as Linen's
from liftmods.module import Module
from liftmods.typing import CollectionFilter, PRNGKey, RNGSequences

# Keyword arguments of ``tabulate`` that ``Module.tabulate`` routes here
# (everything else goes to ``init``).
TABULATE_OPTIONS = frozenset((
    'depth', 'show_repeated', 'mutable', 'console_kwargs', 'table_kwargs',
    'column_kwargs', 'compute_flops', 'compute_vjp_flops'))


def tabulate(module: Module, rngs: PRNGKey | RNGSequences,
             depth: int | None = None,
             show_repeated: bool = False,
             mutable: CollectionFilter = DenyList('intermediates'),
             console_kwargs: Mapping[str, Any] | None = None,
             table_kwargs: Mapping[str, Any] = MappingProxyType({}),
             column_kwargs: Mapping[str, Any] = MappingProxyType({}),
             compute_flops: bool = False, compute_vjp_flops: bool = False,
             **init_kwargs: Any) -> Callable[..., str]:
  """A function that tabulates ``module``'s calls, shapes and parameters.

  The returned ``fn(*args, **kwargs)`` passes its arguments (and
  ``init_kwargs``) to ``module.init(rngs, ...)`` and returns the table as
  plain text.

  Args:
    module: the module to tabulate.
    rngs: a key (for ``'params'``) or ``{sequence name: key}``, for init.
    depth: rows deeper than this are hidden; a row at exactly ``depth``
      counts the variables of its whole subtree, so the rows still add up.
    show_repeated: also show second and later calls of a module (with no
      variables, which the first call already counted).
    mutable: as for ``init``.
    console_kwargs: accepted and ignored (``rich`` options in Linen).
    table_kwargs: ``title`` and ``show_lines`` are honoured; other keys are
      ignored.
    column_kwargs: ``justify`` ('left', 'center', 'right') is honoured;
      other keys are ignored.
    compute_flops: add a column with the XLA cost estimate of each call's
      forward pass (compiles every call).
    compute_vjp_flops: add a column with the estimate of each call's VJP.
    **init_kwargs: further keyword arguments of ``module.init`` (e.g.
      ``method``).

  Returns:
    ``fn(*args, **kwargs) -> str``.
  """
  del console_kwargs  # no console: plain text

  def tabulate_fn(*args, **kwargs) -> str:
    kwargs = {'mutable': mutable, **init_kwargs, **kwargs}
    calls, variables = _record_init(module, rngs, args, kwargs)
    rows = _rows(calls, variables, depth, show_repeated)
    _local.layout = _Layout.of(variables)
    extra = [name for name, on in (('flops', compute_flops),
                                   ('vjp_flops', compute_vjp_flops)) if on]
    for row in rows:
      row.extra = [_call_flops(row.call, rngs, name == 'vjp_flops',
                               variables)
                   for name in extra]
    try:
      return _render(type(module).__name__, rows, variables, extra,
                     dict(table_kwargs), dict(column_kwargs))
    finally:
      _local.layout = None

  return tabulate_fn


# -- recording calls -----------------------------------------------------------


def _record_init(module, rngs, args, kwargs):
  arrays, rebuild = split_arrays((rngs, args, kwargs))

  def init(arrays):
    rngs, args, kwargs = rebuild(arrays)
    return module.init(rngs, *args, **kwargs)

  with record_calls() as calls:
    variables = jax.eval_shape(init, arrays)
  return calls, variables


def module_calls(module: Module, rngs: PRNGKey | RNGSequences, args: tuple,
                 kwargs: dict, show_repeated: bool = False) -> list:
  """The method calls recorded while ``module.init`` runs under ``jax.eval_shape``.

  Args:
    module: the module.
    rngs: a key or ``{sequence name: key}``.
    args: the positional arguments of init's call.
    kwargs: its keyword arguments.
    show_repeated: keep every call, not only the first per path.

  Returns:
    The ``ModuleCall`` records, parents first.
  """
  calls, _ = _record_init(module, rngs, args, kwargs)
  if show_repeated:
    return calls
  seen = set()
  first = []
  for c in calls:
    if c.path not in seen:
      seen.add(c.path)
      first.append(c)
  return first


# -- Linen's Row and Table: the table as data ----------------------------------


@dataclasses.dataclass
class Row:
  """One row of the table as data, with the fields of Linen's ``Row``.

  Code that builds its own columns or reports reads these (through
  :func:`module_table`, or Linen's private ``_get_module_table``).

  Attributes:
    path: the module's path.
    module_copy: an unbound copy of the module.
    method: the name of the method called.
    inputs: the call's inputs (one argument alone, several as a tuple, the
      keyword arguments as a dict at the end), arrays as
      ``jax.ShapeDtypeStruct``.
    outputs: the call's output, arrays as ``jax.ShapeDtypeStruct``.
    module_variables: ``{collection: variables}`` of the module itself
      (submodules' left out), as ``jax.ShapeDtypeStruct``.
    counted_variables: the variables the row counts: ``module_variables``,
      or at the ``depth`` cut the whole subtree's.
    flops: the forward pass's FLOP estimate; -1 when not computed.
    vjp_flops: the VJP's FLOP estimate; -1 when not computed.
  """
  path: tuple[str, ...]
  module_copy: Module
  method: str
  inputs: Any
  outputs: Any
  module_variables: dict[str, dict[str, Any]]
  counted_variables: dict[str, dict[str, Any]]
  flops: int
  vjp_flops: int

  def size_and_bytes(self,
                     collections: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Counted parameters and bytes per collection.

    Args:
      collections: the collections to count (absent ones count ``(0, 0)``).

    Returns:
      ``{collection: (number of parameters, bytes)}``.
    """
    return {col: _size_and_bytes(self.counted_variables.get(col, {}))
            for col in collections}


class Table(list):
  """The rows of a table (a ``list`` of :class:`Row`), as Linen's ``Table``.

  Args:
    module: the module tabulated.
    collections: the variable collections of its ``init``.
    rows: the rows.
  """

  def __init__(self, module: Module, collections: Sequence[str],
               rows: Iterable[Row]):
    super().__init__(rows)
    self.module = module
    self.collections = collections


def module_table(module: Module, depth: int | None = None,
                 show_repeated: bool = False, compute_flops: bool = False,
                 compute_vjp_flops: bool = False) -> Callable[..., Table]:
  """A function with ``init``'s signature that returns the :class:`Table`.

  The rows are those :func:`tabulate` draws (Linen's ``_get_module_table``,
  under that name too).

  Args:
    module: the module.
    depth: as for :func:`tabulate`.
    show_repeated: as for :func:`tabulate`.
    compute_flops: fill each row's ``flops`` (else -1).
    compute_vjp_flops: fill each row's ``vjp_flops`` (else -1).

  Returns:
    ``fn(rngs, *args, **kwargs) -> Table``.
  """

  def table_fn(rngs, *args, **kwargs) -> Table:
    calls, variables = _record_init(module, rngs, args, kwargs)
    rows = [Row(row.call.path, row.call.module.copy(parent=None),
                row.call.method, _inputs(row.call.args, row.call.kwargs),
                row.call.outputs, row.own, row.counted,
                *_row_flops(row.call, rngs, compute_flops, compute_vjp_flops,
                            variables))
            for row in _rows(calls, variables, depth, show_repeated)]
    return Table(module, tuple(variables), rows)

  return table_fn


def _row_flops(call, rngs, forward: bool, vjp: bool,
               variables) -> tuple[int, int]:
  return (_call_flops(call, rngs, False, variables) if forward else -1,
          _call_flops(call, rngs, True, variables) if vjp else -1)


def path_variables(path: tuple[str, ...], variables: Mapping) -> dict:
  """The variables at ``path``, per collection (Linen's
  ``_get_path_variables``).

  Args:
    path: a module path.
    variables: ``{collection: tree}``.

  Returns:
    ``{collection: plain-dict copy of the tree at path}`` for the
    collections that have it.
  """
  return {col: unfreeze(tree) for col, tree in _at_path(variables,
                                                         path).items()}


def module_variables(path: tuple[str, ...], variables: Mapping,
                     all_paths: set) -> tuple[dict, dict]:
  """The variables at ``path`` split into the module's own and its
  submodules' (Linen's ``_get_module_variables``).

  Args:
    path: a module path.
    variables: ``{collection: tree}``.
    all_paths: the paths of every module called; an entry under ``path``
      whose path is among them belongs to a submodule.

  Returns:
    ``(own, submodules)``, each ``{collection: {name: ...}}``.
  """
  own = path_variables(path, variables)
  subs = {col: {k: tree.pop(k) for k in list(tree) if path + (k,) in all_paths}
          for col, tree in own.items()}
  return own, subs


_FLOPS_MUTABLE = DenyList('intermediates')


def _module_arguments(tree) -> list:
  """The bound modules in ``tree`` (a call's arguments), in leaf order."""
  return [x for x in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, Module))
          if isinstance(x, Module) and x.scope is not None]


def _rebound_modules(tree, bound: list, values: list):
  """``tree`` with the modules of ``bound`` bound anew to ``values``: a
  module passed as an argument runs, as in Linen, on variables that are
  inputs of the compiled call but not differentiated."""
  fresh = {id(m): m.clone(parent=None).bind(v) for m, v in zip(bound, values)}
  return jax.tree_util.tree_map(lambda x: fresh.get(id(x), x), tree,
                                is_leaf=lambda x: isinstance(x, Module))


def _call_flops(call: ModuleCall, rngs, vjp: bool, recorded) -> int:
  """XLA's FLOP estimate for re-running ``call`` on its own module copy."""
  module = call.module.clone(parent=None, name=None, _deep_clone=True)
  arrays, rebuild = split_arrays((call.args, call.kwargs))
  apply_rngs = rngs if isinstance(rngs, Mapping) else {'params': rngs}
  bound = _module_arguments((call.args, call.kwargs))
  bound_vars = [_at_path(recorded, tuple(m.scope.path)) for m in bound]

  def inputs(arrays, bound_vars):
    return _rebound_modules(rebuild(arrays), bound, bound_vars)

  def init(arrays, bound_vars):
    args, kwargs = inputs(arrays, bound_vars)
    return module.init(rngs, *args, method=call.method, **kwargs)

  def forward(variables, apply_rngs, arrays, bound_vars):
    args, kwargs = inputs(arrays, bound_vars)
    return module.apply(variables, *args, rngs=apply_rngs, method=call.method,
                        mutable=_FLOPS_MUTABLE, **kwargs)

  def backward(variables, apply_rngs, arrays, bound_vars):
    # Linen's count: the pullback of the output and the updated state.
    out, pullback = jax.vjp(
        lambda *a: forward(*a, bound_vars), variables, apply_rngs, arrays)
    return pullback(out)

  variables = jax.eval_shape(init, arrays, bound_vars)
  cost = jax.jit(backward if vjp else forward).lower(
      variables, apply_rngs, arrays, bound_vars).cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return int(cost.get('flops', 0)) if cost else 0


# -- rows ----------------------------------------------------------------------


@dataclasses.dataclass
class _Row:
  call: ModuleCall
  own: dict      # {collection: this module's own variables}
  counted: dict  # {collection: the variables this row's counts cover}
  extra: list = dataclasses.field(default_factory=list)


def _rows(calls, variables, depth, show_repeated) -> list:
  called = {c.path for c in calls}
  seen = set()
  rows = []
  for c in calls:
    # A function run on a module (a map_variables target) is recorded under
    # its own name, which the module lacks: like a repeated call it is shown
    # only with show_repeated (and then, as in Linen, it takes the path's
    # variables away from the path's later rows).
    if c.path in seen or not hasattr(c.module, c.method):
      if show_repeated:
        seen.add(c.path)
        rows.append(_Row(c, {}, {}))
      continue
    if depth is not None and len(c.path) > depth:
      continue
    seen.add(c.path)
    subtree = _at_path(variables, c.path)
    own = {col: {k: v for k, v in tree.items() if c.path + (k,) not in called}
           for col, tree in subtree.items()}
    collapsed = depth is not None and len(c.path) == depth
    rows.append(_Row(c, own, subtree if collapsed else own))
  return rows


def _at_path(variables, path) -> dict:
  out = {}
  for col, tree in variables.items():
    for name in path:
      tree = tree.get(name) if isinstance(tree, Mapping) else None
    if isinstance(tree, Mapping):
      out[col] = tree
  return out


def _size_and_bytes(tree) -> tuple[int, int]:
  leaves = jax.tree_util.tree_leaves(tree)
  sizes = [(math.prod(x.shape), getattr(x.dtype, 'itemsize', 0))
           for x in leaves if hasattr(x, 'shape')]
  return sum(n for n, _ in sizes), sum(n * b for n, b in sizes)


# -- partitioned variables: per-device sizes ------------------------------------


_local = threading.local()  # .layout: this thread's table's _Layout, or None


@dataclasses.dataclass
class _Layout:
  """The mesh (a box's own, else the mesh context's) and logical rules under
  which partitioned variables are shown with their per-device bytes."""
  mesh: Any
  rules: tuple

  @classmethod
  def of(cls, variables):
    boxes = [x for x in jax.tree_util.tree_leaves(
        variables, is_leaf=meta.is_axis_metadata)
             if isinstance(x, meta.Partitioned)]
    mesh = meta.get_global_mesh()
    if mesh is None:
      mesh = next((b.mesh for b in boxes if b.mesh is not None), None)
    if not boxes or mesh is None:
      return None
    return cls(mesh, spmd.get_logical_axis_rules())

  def mesh_spec(self, box):
    if isinstance(box, spmd.LogicallyPartitioned):
      rules = box.rules if box.rules is not None else self.rules
      return spmd.logical_to_mesh_axes(box.names, rules)
    return box.get_partition_spec()

  def device_bytes(self, x) -> int:
    """Bytes of ``x`` held by one device (the largest shard)."""
    spec = self.mesh_spec(x) if isinstance(x, meta.Partitioned) else ()
    while isinstance(x, meta.AxisMetadata):
      x = x.value if isinstance(x, meta.Partitioned) else x.unbox()
    if not hasattr(x, 'shape'):
      return 0
    shape = list(x.shape)
    for dim, entry in enumerate(tuple(spec)[:len(shape)]):
      axes = entry if isinstance(entry, tuple) else (entry,)
      n = math.prod(self.mesh.shape.get(a, 1) for a in axes
                    if isinstance(a, str))
      shape[dim] = -(-shape[dim] // n)
    return math.prod(shape) * getattr(x.dtype, 'itemsize', 0)

  def tree_bytes(self, tree) -> int:
    return sum(self.device_bytes(x) for x in jax.tree_util.tree_leaves(
        tree, is_leaf=meta.is_axis_metadata))


# -- rendering -----------------------------------------------------------------


def _bytes_repr(n: int) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('KB', 1e3)):
    if n > scale:
      return f'{n / scale:,.1f} {unit}'
  return f'{n:,} B'


def _count_repr(size: int, num_bytes: int, tree=None) -> str:
  layout = getattr(_local, 'layout', None)
  if layout is None or tree is None:
    return f'{size:,} ({_bytes_repr(num_bytes)})'
  per_device = _bytes_repr(layout.tree_bytes(tree))
  return f'{size:,} ({_bytes_repr(num_bytes)}, {per_device} per device)'


def _leaf_repr(x) -> str:
  if isinstance(x, meta.Partitioned):
    names = ', '.join(map(repr, x.names))
    text = f'{_leaf_repr(x.value)} P({names})'
    layout = getattr(_local, 'layout', None)
    if layout is None:
      return text
    spec = layout.mesh_spec(x)
    if isinstance(x, spmd.LogicallyPartitioned):
      text += ' -> P(' + ', '.join(map(repr, spec)) + ')'
    return f'{text} {_bytes_repr(layout.device_bytes(x))}/device'
  if isinstance(x, meta.AxisMetadata):
    return _leaf_repr(x.unbox())
  if hasattr(x, 'shape') and hasattr(x, 'dtype'):
    return f'{x.dtype}[{",".join(map(str, x.shape))}]'
  return repr(x)


def _tree_lines(x) -> list:
  """A YAML-like rendering: ``key: leaf`` / ``- leaf``; nested structures
  are indented by two spaces (a list item starts on the dash's line)."""
  if isinstance(x, Mapping):
    items, inline = [(f'{k}:', v) for k, v in x.items()], False
  elif isinstance(x, (list, tuple)):
    items, inline = [('-', v) for v in x], True
  else:
    return [_leaf_repr(x)]
  lines = []
  for label, v in items:
    sub = _tree_lines(v) or ['']
    if isinstance(v, (Mapping, list, tuple)) and v and not inline:
      lines += [label] + ['  ' + line for line in sub]
    else:
      lines += [f'{label} {sub[0]}'.rstrip()] + ['  ' + l for l in sub[1:]]
  return lines


def _inputs(args, kwargs):
  if args and kwargs:
    return (*args, kwargs)
  if args:
    return args[0] if len(args) == 1 else args
  return kwargs or ()


def _render(name, rows, variables, extra, table_kwargs, column_kwargs) -> str:
  cols = sorted(variables, key=lambda col: col != 'params')  # params first
  header = ['path', 'module', 'inputs', 'outputs', *extra, *cols]
  body = []
  for row in rows:
    c = row.call
    method = '' if c.method == '__call__' else f' ({c.method})'
    cells = [['/'.join(c.path)], [type(c.module).__name__ + method],
             _tree_lines(_inputs(c.args, c.kwargs)),
             _tree_lines(c.outputs), *([str(n)] for n in row.extra)]
    for col in cols:
      lines = _tree_lines(row.own[col]) if row.own.get(col) else []
      counted = row.counted.get(col, {})
      size, num_bytes = _size_and_bytes(counted)
      if size:
        lines += ([''] if lines else []) + [
            _count_repr(size, num_bytes, counted)]
      cells.append(lines)
    body.append(cells)
  totals = {col: _size_and_bytes(variables[col]) for col in cols}
  n_labels = len(header) - len(cols)
  footer = [[''] for _ in range(n_labels - 1)] + [['Total']] + [
      [_count_repr(*totals[col], variables[col])] for col in cols]

  title = table_kwargs.get('title', f'{name} Summary')
  lines = _box(header, body, footer, n_labels,
               column_kwargs.get('justify', 'left'),
               table_kwargs.get('show_lines', True))
  width = len(lines[0])
  size = sum(s for s, _ in totals.values())
  num_bytes = sum(b for _, b in totals.values())
  caption = f'Total Parameters: {_count_repr(size, num_bytes, variables)}'
  return '\n'.join([title.center(width).rstrip(), *lines, '',
                    caption.center(width).rstrip()])


def _box(header, body, footer, n_labels, justify, show_lines) -> list:
  """Draws ``header``, ``body`` and ``footer`` rows (lists of cells, each a
  list of lines) as a box-drawn table; the footer's label cells are
  right-aligned."""
  all_rows = [[[h] for h in header], *body, footer]
  widths = [max(len(line) for r in all_rows for line in (r[i] or ['']))
            for i in range(len(header))]
  align = {'left': str.ljust, 'right': str.rjust, 'center': str.center}[
      justify]

  def rule(left, fill, mid, right):
    return left + mid.join(fill * (w + 2) for w in widths) + right

  def draw(cells, aligns):
    height = max(len(cell) for cell in cells) or 1
    return ['│' + '│'.join(
        f' {a(cell[i] if i < len(cell) else "", w)} '
        for cell, w, a in zip(cells, widths, aligns)) + '│'
            for i in range(height)]

  plain = [align] * len(header)
  footer_aligns = [str.rjust] * n_labels + plain[n_labels:]
  lines = [rule('┌', '─', '┬', '┐'), *draw(all_rows[0], plain),
           rule('╞', '═', '╪', '╡')]
  for i, cells in enumerate(body):
    if i and show_lines:
      lines.append(rule('├', '─', '┼', '┤'))
    lines += draw(cells, plain)
  lines += [rule('├', '─', '┼', '┤'), *draw(footer, footer_aligns),
            rule('└', '─', '┴', '┘')]
  return lines

# Type aliases Linen code imports from this module (flax.linen.summary).
from liftmods.typing import (  # pylint: disable=unused-import
    Array, CollectionFilter, FrozenVariableDict, LogicalNames,
    MutableVariableDict, PRNGKey, RNGSequences)

# -- the other names of flax.linen.summary -------------------------------------
# Code written for Linen reaches these as attributes of flax.linen.summary:
# the library and typing names are the objects Linen imports.
# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
import enum
import io
from abc import ABC, abstractmethod

import jax.numpy as jnp
import numpy as np

from liftmods import module as module_lib
# pylint: enable=g-import-not-at-top,wrong-import-position,unused-import

_NOT_A_DEPENDENCY = ('a dependency of flax that liftmods does not have (it '
                     'needs only jax, jaxlib, numpy and msgpack) and does not '
                     'use: liftmods draws its table itself')

# Names of flax.linen.summary that mean nothing in liftmods, and why.
from liftmods import linen_names  # pylint: disable=g-import-not-at-top,wrong-import-position

_LINEN_ONLY = {
    'rich': f'the rich module, {_NOT_A_DEPENDENCY}',
    'yaml': f'the yaml module (PyYAML), {_NOT_A_DEPENDENCY}',
    '_get_call_flops': "takes Linen's _CallInfo record of a call, which "
                       "liftmods' call recording does not make (its "
                       "ModuleCall has no rngs or mutable); module_table's "
                       'compute_flops fills each Row.flops instead',
}

# Linen's rng wrapper, which its summary imports (flax.core.scope.LazyRng).
from liftmods.core.rngs import LazyRng  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import

# Linen's private helpers that code building its own summaries imports, under
# their Linen names.
_get_module_table = module_table
_get_module_variables = module_variables
_get_path_variables = path_variables
_process_inputs = _inputs


__getattr__ = linen_names.not_provided(__name__, 'flax.linen.summary',
                                        _LINEN_ONLY)
