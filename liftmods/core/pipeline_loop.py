"""The loops of a pipelined layer stack, over one layer function.

A pipeline lays ``S`` stages along one mesh axis; each holds ``K`` layers
per repeat (``R`` repeats, ``L = R·S·K``) and the batch is cut into ``M``
microbatches. Two loops run the layers:

- :func:`run_pipeline` without ``training``: the forward loop of GPipe (and
  of the circular schedule, ``R > 1``). Each iteration every stage runs its
  layers on one microbatch and passes the result to the next stage with a
  collective permute; ``jax.grad`` differentiates the whole loop.
- with ``training`` (a :class:`Training`): one forward and one backward
  (1F1B). Each iteration a stage runs one microbatch forward and another
  backward, recomputing the latter from the stage input it stored, so a
  stage holds at most ``2S − 1`` microbatch inputs whatever ``M`` is. The
  loop calls the loss itself, on stage 0 up to the stack and on the last
  stage from it, and returns a surrogate loss that carries every gradient.

The caller supplies the pipeline's shape (a :class:`Layout`), the mesh, the
layer function and the stacked variables in the layout's stored
(stage-major) order, and words the errors (an :class:`Explain`).

>>> import jax.numpy as jnp
>>> microbatches({'x': jnp.arange(6)}, 3, None)['x'].tolist()
[[0, 3], [1, 4], [2, 5]]
>>> joined({'x': jnp.array([[0, 3], [1, 4], [2, 5]])})['x'].tolist()
[0, 1, 2, 3, 4, 5]
"""
import dataclasses
import functools
import heapq
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.sharding import PartitionSpec

from liftmods import jax_private
from liftmods.core import caching, meta

tree_map = jax.tree_util.tree_map
leaves_of = jax.tree_util.tree_leaves


class Layout(Protocol):
  """What the loops read of a pipeline's configuration."""
  stages: int
  microbatches: int
  repeats: int
  axis: str
  remat_iterations: bool
  per_microbatch: Sequence[str]
  split_backward: bool  # the training loop splits B and W (zero bubble)

  @property
  def iterations(self) -> int:
    """The number of iterations the loop runs."""

  def stage_major(self, tree: Any) -> Any:
    """``tree``'s leading (layer) axis from layer order to stored order."""


class Explain(Protocol):
  """The errors of the pipeline loops, worded by their caller."""

  def batch(self, shape: tuple, microbatches: int) -> Exception:
    """A carry leaf of ``shape`` has no leading axis divisible by
    ``microbatches``."""

  def mutable(self, collection: str) -> Exception:
    """The layers may update ``collection``, which a pipeline would update
    once per microbatch."""

  def wrote(self, updated: Any, held: Any) -> Exception:
    """The layers wrote mutable variables of tree structure ``updated``
    where the stack holds ``held``."""

  def argument(self, shape: tuple, microbatches: int) -> Exception:
    """A batched argument of the loss has shape ``shape``, whose leading
    axis ``microbatches`` does not divide."""

  def not_in_params(self) -> Exception:
    """The loss's params do not hold the stack's variables."""

  def input_shape(self, got: Any, want: Any) -> Exception:
    """On one microbatch the stack got an input of shapes ``got``, not
    ``want``."""

  def uneven_microbatch(self, rows: int, axes: tuple, devices: int
                        ) -> Exception:
    """A training schedule's microbatch has ``rows`` rows of a batch
    sharded over mesh ``axes`` of ``devices`` devices, which do not divide
    them."""


class Training(Protocol):
  """What the 1F1B loop needs of the loss it differentiates.

  Attributes:
    params: the variables the loss is differentiated by (the stack's and
      the other layers').
    arrays: the array leaves of the loss's other arguments.
    batched: for each of ``arrays``, whether its leading axis is the batch
      (split into microbatches) or it is passed whole.
    has_aux: the loss returns ``(loss, aux)``.
  """
  params: Any
  arrays: Sequence[Any]
  batched: Sequence[bool]
  has_aux: bool

  def call(self, params: Any, arrays: Sequence[Any], given: Any) -> Any:
    """The loss on ``arrays`` (one microbatch's), with the stack's call
    answered by ``given``: a :class:`Capture` records the stack's input and
    the loss runs on; any other value is the stack's output."""


class Capture:
  """Given to :meth:`Training.call` to learn the stack's input on one
  microbatch: the stack stores it in ``value`` and returns it."""
  value: Any = None


def run_pipeline(layout: Layout, mesh: Any, layer: Callable[..., Any],
                 policy: Callable[..., Any] | None, c: Any,
                 stacked: Sequence[dict], keys: Any, per_layer: tuple, *,
                 length: int, is_mutable: Callable[[str], bool],
                 explain: Explain, training: Training | None = None):
  """Runs ``length`` layers on the carry ``c`` on the pipeline's schedule.

  Args:
    layout: the pipeline's shape.
    mesh: a mesh with the axis ``layout.axis`` of ``layout.stages`` devices.
    layer: ``layer(c, (variables, keys, per_layer)) -> (c, (ys, mutable))``,
      one layer of the stack.
    policy: the ``jax.checkpoint`` policy of a layer, or None.
    c: the carry; its leaves' leading axis is the batch.
    stacked: one dict of collections per scope, every array with a leading
      axis of ``length`` layers in stored (stage-major) order.
    keys: the layers' rng keys, in layer order.
    per_layer: the per-layer arguments, in layer order.
    length: the number of layers; divisible by ``stages·repeats``.
    is_mutable: whether the layers update a collection.
    explain: the errors' wording.
    training: the loss, to run one-forward-one-backward; None runs the
      forward loop.

  Returns:
    ``(c, mutable, loss)``: the carry after the layers (under ``training``
    without ``has_aux`` only the input, which nothing reads), the updated
    mutable collections (stage-major) and, under ``training``, the
    surrogate loss (see :func:`surrogate`), otherwise None.
  """
  run = functools.partial(_run_pipeline, layout, mesh, layer, policy,
                          length=length, is_mutable=is_mutable,
                          explain=explain, training=training)
  context = jax.sharding.get_abstract_mesh()
  explicit = tuple(name for name, kind in zip(context.axis_names,
                                              context.axis_types)
                   if kind == jax.sharding.AxisType.Explicit)
  if not explicit:
    return run(c, stacked, keys, per_layer)
  if training is not None:
    _check_rows(layout, c, training, context, explain)
  run = functools.partial(_run_pipeline, layout, None, layer, policy,
                          length=length, is_mutable=is_mutable,
                          explain=explain)
  # On Explicit axes an array's type carries its sharding, and the loops
  # slice and reshape along sharded axes (the stage axis, the batch into
  # microbatches), which JAX allows only where it can infer the result's
  # layout. So the loops run with those axes Auto (their shard_map on the
  # context's mesh, mesh=None), and the results come back laid out as the
  # inputs were.
  _, mutable = split_collections(layout, stacked, is_mutable, explain)
  out = (_specs(c), _specs(mutable), None if training is None else
         PartitionSpec())
  trees = (c, stacked, keys, per_layer)
  if training is not None:
    trees += (training.params, list(training.arrays))
  unique, rebuild = _distinct_leaves(trees)

  def region(*inner):
    c, stacked, keys, per_layer, *loss_inputs = rebuild(inner)
    inner_training = training and _Within(training, *loss_inputs)
    return run(c, stacked, keys, per_layer, training=inner_training)

  return jax.sharding.auto_axes(region, axes=explicit, out_sharding=out)(
      *unique)


def _check_rows(layout, c, training, mesh, explain):
  """Refuses microbatches whose rows do not divide over the mesh axes the
  batch is sharded on: XLA's compiled training loop then waits forever on
  collectives (seen on CPU, Auto and Explicit meshes alike). Only on
  Explicit axes do the types of the stack's input ``c`` and of the loss's
  batch say how they are sharded."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  batches = [(a, True) for a in leaves_of(c)]
  for a, batched in batches + list(zip(training.arrays, training.batched)):
    spec = tuple(jax.typeof(a).sharding.spec) if batched else ()
    axes = meta.spec_axes(spec[0] if spec else None)
    devices = int(np.prod([sizes[x] for x in axes]))
    rows = a.shape[0] // layout.microbatches
    if rows % devices:
      raise explain.uneven_microbatch(rows, axes, devices)


def _specs(tree):
  return tree_map(lambda a: jax.typeof(a).sharding.spec, tree)


def _distinct_leaves(trees):
  """The distinct leaves of ``trees`` (by identity), and a function making
  ``trees`` again from replacements for them: the 1F1B loop finds the
  stack's parameters among the loss's by identity, which a transform
  boundary keeps only if a leaf crosses it once."""
  leaves, treedef = jax.tree_util.tree_flatten(trees)
  index, unique = {}, []
  for leaf in leaves:
    if id(leaf) not in index:
      index[id(leaf)] = len(unique)
      unique.append(leaf)
  positions = [index[id(leaf)] for leaf in leaves]
  return unique, lambda new: jax.tree_util.tree_unflatten(
      treedef, [new[i] for i in positions])


class _Within:
  """A :class:`Training` whose params and arrays are those inside a
  transform boundary (the loss itself is the caller's)."""

  def __init__(self, outer, params, arrays):
    self.outer, self.params, self.arrays = outer, params, arrays
    self.batched, self.has_aux = outer.batched, outer.has_aux

  def call(self, params, arrays, given):
    return self.outer.call(params, arrays, given)


def _run_pipeline(layout, mesh, layer, policy, c, stacked, keys, per_layer, *,
                  length, is_mutable, explain, training):
  fixed, mutable = split_collections(layout, stacked, is_mutable, explain)
  micro = microbatches(c, layout.microbatches, explain)
  staged = tuple(_staged(tree, layout) for tree in (
      fixed, mutable, layout.stage_major(keys),
      layout.stage_major(per_layer)))
  per_chunk = length // (layout.stages * layout.repeats)
  stage = stage_fn(layer, policy, per_chunk, explain)
  if training is None:
    out, mutable = _shard(layout, mesh, functools.partial(
        _forward_stage, layout, stage), (micro,), staged)
    return joined(_at(out, 0)), _unstaged(mutable), None
  return _one_f_one_b(layout, training, stage, per_chunk, mesh, micro, fixed,
                      staged, explain)


# -- pieces ---------------------------------------------------------------------


def microbatches(c: Any, m: int, explain: Explain | None) -> Any:
  """``(B, ...) -> (M, B/M, ...)``, microbatch ``i`` holding rows ``i::M``
  (so a batch sharded over a data axis stays sharded in each)."""
  def split(x):
    shape = jnp.shape(x)
    if not shape or shape[0] % m:
      raise explain.batch(tuple(shape), m)
    return jnp.swapaxes(x.reshape((shape[0] // m, m) + shape[1:]), 0, 1)
  return tree_map(split, c)


def joined(c: Any) -> Any:
  """Inverse of :func:`microbatches`."""
  def join(x):
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
  return tree_map(join, c)


def _staged(tree, layout):
  """``(L, ...)`` stage-major -> ``(S, R, K, ...)``."""
  s, r = layout.stages, layout.repeats
  return tree_map(
      lambda a: a.reshape((s, r, a.shape[0] // (s * r)) + a.shape[1:]), tree)


def _unstaged(tree):
  return tree_map(lambda a: a.reshape((-1,) + a.shape[3:]), tree)


def _at(tree, i):
  return tree_map(lambda a: a[i], tree)


def _lead(tree):
  return tree_map(lambda a: a[None], tree)


def _select(pred, a, b):
  return tree_map(lambda x, y: jnp.where(pred, x, y), a, b)


def _put(buffer, i, value, ok):
  """``buffer`` with slot ``i`` set to ``value`` where ``ok``."""
  return tree_map(lambda b, a: b.at[i].set(jnp.where(ok, a, b[i])), buffer,
                  value)


def _garbage(fill):
  """What arrives before a stage has real work: NaN, so that any leak of it
  into outputs or gradients shows."""
  return tree_map(lambda a: jnp.full_like(a, jnp.nan), fill)


def _neighbours(n_stages, step):
  return [(i, (i + step) % n_stages) for i in range(n_stages)]


def split_collections(layout: Layout, stacked: Sequence[dict],
                      is_mutable: Callable[[str], bool],
                      explain: Explain) -> tuple[tuple, tuple]:
  """``stacked`` -> (read-only, updated) collections per scope; raises
  ``explain.mutable`` for an updated collection the layout does not allow
  to change once per microbatch."""
  for cols in stacked:
    for col in cols:
      if is_mutable(col) and col not in layout.per_microbatch:
        raise explain.mutable(col)
  fixed = tuple({c: v for c, v in cols.items() if not is_mutable(c)}
                for cols in stacked)
  mutable = tuple({c: v for c, v in cols.items() if is_mutable(c)}
                  for cols in stacked)
  return fixed, mutable


_SLICING = frozenset({'dynamic_slice', 'gather', 'slice', 'squeeze',
                      'reshape'})


def _save_all_but_slices(prim, *_, **__):
  return prim.name not in _SLICING


def stage_fn(layer: Callable[..., Any], policy: Callable[..., Any] | None,
             n_layers: int, explain: Explain) -> Callable[..., Any]:
  """``stage(x, fixed, r, mutable, keys, per_layer) -> (x, updated)``: a
  stage's ``n_layers`` layers of repeat ``r`` on one microbatch, each under
  ``jax.checkpoint`` with ``policy`` (by default: save all but the slices
  of the parameters). Given ``probes`` (one per layer, shaped like ``x``)
  each layer's output gets its probe added and the stage returns ``(x,
  updated, outputs)``, every layer's output; ``cut`` (a traced bool)
  stops the gradient between layers."""

  def stage(x, fixed, r, mutable, keys, per_layer, probes=None, cut=None):
    # The parameters are sliced inside the checkpoint: the backward pass
    # slices them again instead of keeping a copy per iteration.
    def one(x, sliced):
      l, mutable, keys, per_layer, probe = sliced
      if cut is not None:  # no gradient from a layer to the one before
        x = _select(cut, tree_map(lax.stop_gradient, x), x)
      own = _at(_at(fixed, r), l)
      variables = tuple({**f, **m} for f, m in zip(own, mutable))
      x, (ys, updated) = layer(x, (variables, keys, per_layer))
      if probe is None:
        return x, (ys, updated)
      x = tree_map(jnp.add, x, probe)  # its cotangent: the output's
      return x, (ys, updated, x)

    one = jax.checkpoint(one, policy=policy or _save_all_but_slices,
                         prevent_cse=False)
    x, (_, updated, *outputs) = lax.scan(
        one, x, (jnp.arange(n_layers), mutable, keys, per_layer, probes))
    held = jax.tree_util.tree_structure(mutable)
    if jax.tree_util.tree_structure(updated) != held:
      raise explain.wrote(jax.tree_util.tree_structure(updated), held)
    return (x, updated, *outputs)

  return stage


def _shard(layout, mesh, per_stage, whole, staged):
  """``per_stage(*whole, *staged)`` on every stage: ``whole`` replicated,
  ``staged`` split on its leading (stage) axis, outputs stacked on it.

  One stage needs no manual region: a vmap over the one-entry stage axis
  names it for the loop's collectives. (Under ``jax.grad``, a shard_map
  over a mesh axis of size 1 made XLA's SPMD partitioner fail a RET_CHECK
  on the all-reduce that transposes a replicated input, once the batch
  was sharded over another axis.)"""
  if layout.stages == 1:
    def one(*args):  # per_stage sees (and returns) the stage axis of one
      args = args[:len(whole)] + tuple(_lead(args[len(whole):]))
      return _at(per_stage(*args), 0)
    return jax.vmap(one, in_axes=(None,) * len(whole) + (0,) * len(staged),
                    axis_name=layout.axis, axis_size=1)(*whole, *staged)
  spec = PartitionSpec(layout.axis)
  return jax.shard_map(
      per_stage, mesh=mesh,
      in_specs=(PartitionSpec(),) * len(whole) + (spec,) * len(staged),
      out_specs=spec, axis_names={layout.axis},
      check_vma=False)(*whole, *staged)


# -- the forward loop (GPipe, circular) ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Forward:
  """The forward loop on one stage ``s`` (a traced index)."""
  layout: Any
  stage: Callable[..., Any]
  s: Any
  fill: Any
  fixed: Any
  keys: Any
  per_layer: Any

  @property
  def work(self):
    return self.layout.microbatches * self.layout.repeats

  def store(self, buffer, arrived, t):
    """The last stage's output of the work item it finished at ``t − 1``
    (what ``arrived`` on stage 0) into the batch buffer."""
    done = t - self.layout.stages
    ok = (done >= 0) & (done < self.work)
    return _put(buffer, jnp.mod(done, self.layout.microbatches), arrived, ok)

  def iteration(self, carry, t):
    arrived, buffer, mutable = carry
    buffer = self.store(buffer, arrived, t)
    j = t - self.s
    valid = (j >= 0) & (j < self.work)
    r = jnp.clip(j, 0, self.work - 1) // self.layout.microbatches
    x = _select(self.s == 0,
                _at(buffer, jnp.mod(t, self.layout.microbatches)), arrived)
    x = _select(valid, x, self.fill)
    # A microbatch reads the collections earlier ones updated as constants
    # (as gradient accumulation would, and the training loops do): no
    # gradient from one microbatch's loss to another's activations.
    state = tree_map(lax.stop_gradient, _at(mutable, r))
    y, updated = self.stage(x, self.fixed, r, state, _at(self.keys, r),
                            _at(self.per_layer, r))
    mutable = tree_map(
        lambda old, new: old.at[r].set(jnp.where(valid, new, old[r])),
        mutable, updated)
    arrived = lax.ppermute(y, self.layout.axis,
                           _neighbours(self.layout.stages, 1))
    return (arrived, buffer, mutable), None


def _forward_stage(layout, stage, micro, fixed, mutable, keys, per_layer):
  """The forward loop on this stage: every microbatch through its layers."""
  fixed, mutable, keys, per_layer = _at((fixed, mutable, keys, per_layer), 0)
  micro = _rows_split_evenly(micro)
  if layout.remat_iterations:
    # The backward pass keeps each iteration's input microbatch (not the
    # batch buffers the loop carries) and reruns the stage from it.
    stage = jax.checkpoint(
        stage, policy=jax.checkpoint_policies.nothing_saveable,
        prevent_cse=False)
  fill = tree_map(lax.stop_gradient, _at(micro, 0))
  loop = _Forward(layout, stage, lax.axis_index(layout.axis), fill, fixed,
                  keys, per_layer)
  iterations = loop.work + layout.stages - 1
  (arrived, buffer, mutable), _ = lax.scan(
      loop.iteration, (_garbage(fill), micro, mutable),
      jnp.arange(iterations))
  buffer = loop.store(buffer, arrived, jnp.asarray(iterations))
  return _lead(_rows_split_evenly(buffer)), _lead(mutable)


def _rows_split_evenly(micro):
  """Each ``(M, b, ...)`` leaf with its ``b`` rows split over the leading
  Auto mesh axes whose sizes divide ``b`` and held whole on the others;
  unconstrained where ``b`` divides over all of them.

  Since jax 0.11, XLA's SPMD partitioner aborts the process (a failed
  ``Check`` in ``spmd_partitioner_util.cc``) when it splits fewer rows than
  devices, as a batch sharded over 4 devices in microbatches of 2 rows
  asks, and differentiates the forward loop. The constraint makes that
  layout impossible; a batch whose microbatches divide is left alone."""
  mesh = jax.sharding.get_abstract_mesh()
  auto = [(name, size) for name, size, kind in zip(
      mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
          if kind == jax.sharding.AxisType.Auto]

  def constrain(a):
    rows = a.shape[1]
    if rows % int(np.prod([size for _, size in auto])) == 0:
      return a
    held, devices = [], 1
    for name, size in auto:
      if rows % (devices * size):
        break
      held.append(name)
      devices *= size
    spec = PartitionSpec(None, tuple(held) or None,
                         *[PartitionSpec.UNCONSTRAINED] * (a.ndim - 2))
    return lax.with_sharding_constraint(a, spec)

  return tree_map(constrain, micro)


# -- training schedules as tables ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Table:
  """A training schedule (1F1B, interleaved 1F1B, zero-bubble) as the loop
  runs it: for every iteration ``t`` and stage ``s``, which work item each
  kind of slot holds. The loop reads its rows; the pictures of the
  schedules (``benchmarks/pipeline.py``) read the same arrays.

  Attributes:
    stages, microbatches, repeats: ``S``, ``M`` and ``v`` (chunks, or
      virtual stages, per device).
    split: the backward is split into ``B`` (input gradient) and ``W``
      (weight gradient); otherwise ``B`` computes both.
    kinds: ``{'F': ..., 'B': ..., 'W': ...}`` (no ``'W'`` unless ``split``),
      each a dict of ``(T, S)`` int arrays: ``ok`` (1 where the slot does
      work), ``repeat`` (the chunk ``r``), ``micro`` (the microbatch) and
      ``slot`` (where its stage input is stored); ``'B'`` and ``'W'`` also
      ``cot`` (where ``B`` stores the per-layer cotangents ``W`` reads).
    inputs: stage inputs a device holds at most (the ring's size).
    cotangents: per-layer cotangent sets a device holds at most.
  """
  stages: int
  microbatches: int
  repeats: int
  split: bool
  kinds: dict
  inputs: int
  cotangents: int

  @property
  def iterations(self) -> int:
    return self.kinds['F']['ok'].shape[0]

  def phases(self) -> list:
    """``[(start, stop, kinds)]``: runs of iterations in which the same
    kinds of slot do work on some stage (a loop each; a kind no stage
    uses in a run is left out of its body)."""
    busy = {k: cells['ok'].any(axis=1) for k, cells in self.kinds.items()}
    out = []
    for t in range(self.iterations):
      kinds = tuple(k for k in self.kinds if busy[k][t])
      if out and out[-1][2] == kinds:
        out[-1] = (out[-1][0], t + 1, kinds)
      else:
        out.append((t, t + 1, kinds))
    return out

  def slots(self) -> dict:
    """``{kind: iterations whose loop body holds that kind of slot}``."""
    return {k: sum(stop - start for start, stop, kinds in self.phases()
                   if k in kinds) for k in self.kinds}

  def idle_fraction(self, cost=None) -> float:
    """Idle share of the slot time every stage runs, each slot weighted by
    ``cost[kind]`` (default 1 for F, B and W; a backward that is not split
    counts 2, B and W together)."""
    cost = cost or {'F': 1, 'B': 1 if self.split else 2, 'W': 1}
    work = self.microbatches * self.repeats
    total = sum(cost[k] * n * self.stages for k, n in self.slots().items())
    busy = sum(cost[k] * work * self.stages for k in self.kinds)
    return 1 - busy / total


@functools.lru_cache(maxsize=64)
def training_table(stages: int, microbatches: int, repeats: int = 1,
                   split: bool = False) -> Table:
  """The schedule of the training loop (built once per arguments; its
  arrays are read-only).

  Forward work item ``j`` (chunk ``r``, microbatch ``m``) runs on stage
  ``s`` at ``t = j + s``; items go in groups of ``S`` microbatches through
  every chunk (``r = (j mod vS) div S``, ``m = (j div vS)·S + j mod S``), so
  a microbatch leaving the last stage in chunk ``r`` enters stage 0 in
  chunk ``r + 1`` the next iteration (Megatron's interleaved order; needs
  ``M`` divisible by ``S`` when ``v > 1``). Backward item ``k`` runs the
  chunks in reverse, on stage ``s`` at ``t = k + vS − 1 + S − 1 − s``: the
  last stage runs the last chunk's backward in the iteration of its
  forward. With ``split``, ``W`` of item ``k`` runs on every stage at
  ``t = k + vS + S − 2``, the iteration of stage 0's ``B``: ``W`` lags ``B``
  by ``s`` iterations and fills the slots 1F1B leaves idle at the end.

  >>> t = training_table(2, 2)
  >>> t.kinds['F']['micro'].T.tolist(), t.kinds['F']['ok'].T.tolist()
  ([[0, 1, 1, 1], [0, 0, 1, 1]], [[1, 1, 0, 0], [0, 1, 1, 0]])
  >>> t.phases(), t.inputs
  ([(0, 1, ('F',)), (1, 3, ('F', 'B')), (3, 4, ('B',))], 2)
  """
  s_, m_, v = stages, microbatches, repeats
  work = m_ * v
  n = work + v * s_ + s_ - 2
  t = np.arange(n)[:, None]
  s = np.arange(s_)[None, :]
  group = s_ * v

  def kind(item, reverse):
    ok = (item >= 0) & (item < work)
    item = np.clip(item, 0, work - 1)
    chunk = (item % group) // s_
    return {'ok': ok.astype(np.int32),
            'repeat': (v - 1 - chunk if reverse else chunk).astype(np.int32),
            'micro': ((item // group) * s_ + item % s_).astype(np.int32)}

  kinds = {'F': kind(t - s + 0 * s, False),
           'B': kind(t - (v * s_ - 1) - (s_ - 1 - s), True)}
  if split:
    kinds['W'] = kind(t - (v * s_ + s_ - 2) + 0 * s, True)
  inputs = _allocate(kinds, 'F', 'W' if split else 'B', 'slot')
  cotangents = _allocate(kinds, 'B', 'W', 'cot') if split else 0
  for cells in kinds.values():
    for a in cells.values():
      a.flags.writeable = False
  return Table(stages, microbatches, repeats, split, kinds, inputs,
               cotangents)


caching.register('core.pipeline_loop.training_table', caching.Policy(
    holds='the schedule table of a training loop (1F1B, interleaved, '
          'zero-bubble), its arrays read-only',
    keyed_on='stages, microbatches, repeats, split backward',
    bound='64 entries',
    cleared='on eviction'), clear=training_table.cache_clear)


def _allocate(kinds, first, last, name):
  """Gives every work item a storage slot from its ``first`` kind of slot
  to its ``last`` (free again the iteration after), lowest free first;
  writes ``kinds[k][name]`` for the kinds between and returns the number
  of slots a stage needs."""
  order = [k for k in kinds][list(kinds).index(first):
                             list(kinds).index(last) + 1]
  shape = kinds[first]['ok'].shape
  for k in order:
    kinds[k][name] = np.zeros(shape, np.int32)
  size = 0
  for s in range(shape[1]):
    free, held, used, later = [], {}, 0, []
    for t in range(shape[0]):
      for slot in later:
        heapq.heappush(free, slot)
      later = []
      for k in order:
        if not kinds[k]['ok'][t, s]:
          continue
        key = (kinds[k]['repeat'][t, s], kinds[k]['micro'][t, s])
        if k == first:
          if free:
            held[key] = heapq.heappop(free)
          else:
            held[key], used = used, used + 1
        kinds[k][name][t, s] = held[key]
        if k == last:
          later.append(held.pop(key))
    size = max(size, used)
  return size


# -- one forward, one backward --------------------------------------------------


def _inexact(tree):
  """``(floating leaves, rebuild)``: the leaves gradients are taken of, and
  ``rebuild(leaves)`` -> ``tree`` with them put back."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  where = [i for i, a in enumerate(leaves)
           if jnp.issubdtype(jnp.result_type(a), jnp.inexact)]

  def rebuild(new):
    out = list(leaves)
    for i, a in zip(where, new):
      out[i] = a
    return treedef.unflatten(out)

  return [leaves[i] for i in where], rebuild


def _without(tree, dropped):
  """``tree`` with None for every leaf that is one of the arrays in
  ``dropped`` (compared by identity)."""
  ids = {id(a) for a in leaves_of(dropped)}
  return tree_map(lambda a: None if id(a) in ids else a, tree)


def surrogate(loss: Any, pairs: Sequence[tuple[Any, Any]]) -> Any:
  """``loss`` whose gradient by ``v`` is ``g``, for each ``(v, g)`` in
  ``pairs``: ``loss + Σ g·(v − v)``, each term exactly zero and the only
  path ``jax.grad`` can take (the loop's inputs are behind stop_gradient).
  """
  total = lax.stop_gradient(loss)
  for value, grad in pairs:
    total = total + jnp.sum(lax.stop_gradient(grad) *
                            (value - lax.stop_gradient(value)))
  return total


def _one_f_one_b(layout, training, stage, per_chunk, mesh, micro, fixed,
                 staged, explain):
  """A training schedule across the stages: ``(c, mutable, surrogate
  loss)`` (see :func:`run_pipeline`); ``per_chunk`` layers a chunk."""
  m = layout.microbatches
  for a, is_batch in zip(training.arrays, training.batched):
    if is_batch and jnp.shape(a)[0] % m:
      raise explain.argument(tuple(jnp.shape(a)), m)
  batches = [_by_row(a, m) if is_batch else a
             for a, is_batch in zip(training.arrays, training.batched)]
  rows = [jnp.shape(a)[1:] for a in training.arrays]
  # The other layers' parameters travel into the loop; the stack's own
  # (which the loss's calls in the loop never read) must not, or every
  # stage would get all of them.
  outer = _without(training.params, fixed)
  own = leaves_of([cols.get('params', {}) for cols in fixed])
  if own and len(leaves_of(outer)) == len(leaves_of(training.params)):
    raise explain.not_in_params()
  sg = lambda tree: tree_map(lax.stop_gradient, tree)
  shape = tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                   micro)
  table = training_table(layout.stages, m, layout.repeats,
                         layout.split_backward)
  per_stage = functools.partial(_one_f_one_b_stage, layout, training, stage,
                                per_chunk, shape, explain, table, rows)
  outputs, mutable, grads, outer_grads, loss = _shard(
      layout, mesh, per_stage, (batches, sg(outer)), sg(staged))
  # The gradients enter jax.grad's trace through the stack's variables (in
  # stored order: (L, ...)) and the other layers' parameters (stage 0 holds
  # those of the layers before the stack, the last stage those after).
  last = layout.stages - 1
  total = surrogate(
      loss[last],
      list(zip(_inexact(fixed)[0], leaves_of(_unstaged(grads)))) +
      list(zip(_inexact(outer)[0], [g.sum(0) for g in leaves_of(outer_grads)])))
  out = joined(_at(outputs, last)) if training.has_aux else joined(micro)
  return out, _unstaged(mutable), total


def _by_row(a, m):
  """``(B, ...) -> (B/M, M·n)``, ``n`` the size of a row: a view of the
  batch (no copy) whose row ``i`` holds rows ``i·M ... i·M + M − 1``, so
  that microbatch ``b`` (rows ``b, b + M, ...``, as in :func:`microbatches`)
  is the ``n`` columns from ``b·n``."""
  a = jnp.asarray(a)
  return a.reshape((a.shape[0] // m, m * int(np.prod(a.shape[1:]))))


def _microbatch(view, b, m):
  """Microbatch ``b``, ``(B/M, ...)``, of a :func:`_by_row` view and the
  shape of a row: one dynamic slice of the columns, so the loops read one
  microbatch at a time and the compiler has no ``M``-strided axis to stage
  (XLA:TPU copied or prefetched the whole ``(B/M, M, ...)`` view to read
  ``[:, b]``)."""
  flat, row = view
  n = flat.shape[1] // m
  return lax.dynamic_slice_in_dim(flat, b * n, n, axis=1).reshape(
      (flat.shape[0],) + row)


def _zeros(tree):
  return tree_map(jnp.zeros_like, tree)


def _repeated(tree, n):
  return tree_map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), tree)


def _one_f_one_b_stage(layout, training, stage, per_chunk, shape, explain,
                       table, rows, batches, outer, fixed, mutable, keys,
                       per_layer):
  """The training loop on this stage: ``(outputs, mutable, grads, outer
  grads, loss)``, each with a leading stage axis of one."""
  fixed, mutable, keys, per_layer = _at((fixed, mutable, keys, per_layer), 0)
  outer_diff, rebuild_outer = _inexact(outer)
  fill = tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shape)
  loop_class = _ZeroBubble if table.split else _OneFOneB

  def stage_once(x, chunk, state, keys, per_layer, *extra):
    return stage(x, _lead(chunk), 0, state, keys, per_layer, *extra)

  # The stage is traced once, and its program run by the forward and by
  # the backward's recomputation: tracing the blocks again would move
  # their rng counters, and the recomputation would draw other dropout
  # masks than the forward did.
  traced, out_shape = jax.make_jaxpr(stage_once, return_shape=True)(
      fill, _at(fixed, 0), _at(mutable, 0), _at(keys, 0), _at(per_layer, 0),
      *loop_class.extra_arguments(fill, per_chunk))
  s = lax.axis_index(layout.axis)
  loop = loop_class(
      layout, training, explain, s, s == 0, s == layout.stages - 1, fill,
      shape, list(zip(batches, rows)), outer_diff, rebuild_outer, fixed,
      keys, per_layer,
      jax_private.jaxpr_as_fun(traced),
      jax.tree_util.tree_structure(out_shape), table, per_chunk)
  carry = loop.start(mutable)
  # Each run of iterations with the same kinds of work is a loop of its
  # own, whose body leaves out the kinds no stage runs there (1F1B: no
  # backward in the first S - 1 iterations, no forward in the last S - 1):
  # a lax.cond on t would do it in one loop, but kept XLA:TPU from
  # updating the gradient sums in place (a copy of the stage's parameters
  # in temp memory).
  rows = {k: {name: jnp.asarray(a) for name, a in v.items()}
          for k, v in table.kinds.items()}
  for start, stop, kinds in table.phases():
    xs = {k: {name: a[start:stop] for name, a in rows[k].items()}
          for k in kinds}
    carry, _ = lax.scan(functools.partial(loop.iteration, kinds=kinds),
                        carry, xs)
  return _lead(loop.result(carry))


@dataclasses.dataclass(frozen=True)
class _Slot:
  """One kind of work on this stage in one iteration (a row of the
  table, this stage's column)."""
  ok: Any
  repeat: Any
  micro: Any
  slot: Any
  cot: Any = None

  @classmethod
  def of(cls, row, s):
    if row is None:
      return None
    return cls(**{name: a[s] for name, a in row.items()})


@dataclasses.dataclass(frozen=True)
class _OneFOneB:
  """The training loop on one stage ``s`` (a traced index), driven by a
  :class:`Table`: each iteration a forward slot (``F``: the stage's chunk
  ``r`` on a microbatch, its input stored in a ring) and a backward slot
  (``B``: the vjp of a chunk, recomputed from the stored input, on the
  cotangent the next stage sent), either left out where no stage has one.
  1F1B is ``v = 1`` chunk per stage; interleaved 1F1B ``v > 1``. Stage 0
  runs the loss up to the stack for chunk 0's input (and that part's vjp),
  the last stage the loss from the last chunk's output (and its vjp)."""
  layout: Any
  training: Any
  explain: Any
  s: Any
  first: Any  # s == 0, computed once outside the loops
  last: Any   # s == S - 1
  fill: Any
  shape: Any
  batches: Sequence[Any]  # (array, shape of a row); by row if batched
  outer_diff: list
  rebuild_outer: Callable[..., Any]
  fixed: Any      # (R, K, ...): the stage's chunks
  keys: Any
  per_layer: Any
  program: Callable[..., Any]
  out_tree: Any
  table: Table
  per_chunk: int  # layers in a chunk (a block may have no variables)

  def start(self, mutable):
    """The loop's carry before the first iteration."""
    fixed_diff, _ = _inexact(self.fixed)
    return {'arrived': _garbage(self.fill), 'cotangent': _garbage(self.fill),
            'inputs': _repeated(self.fill, self.table.inputs),
            'states': _repeated(_at(mutable, 0), self.table.inputs),
            'mutable': mutable, 'grads': _zeros(fixed_diff),
            'outer_grads': _zeros(self.outer_diff), 'loss': jnp.zeros(()),
            'outputs': _repeated(self.fill, self.layout.microbatches
                                 if self.training.has_aux else 0)}

  def result(self, carry):
    return tuple(carry[k] for k in ('outputs', 'mutable', 'grads',
                                    'outer_grads', 'loss'))

  def call(self, outer_diff, b, given):
    """The loss on microbatch ``b``, the stack answered by ``given``."""
    arrays = [_microbatch(a, b, self.layout.microbatches) if is_batch
              else a[0]
              for a, is_batch in zip(self.batches, self.training.batched)]
    return self.training.call(self.rebuild_outer(outer_diff), arrays, given)

  def embed(self, outer_diff, b):
    """The stack's input on microbatch ``b`` (the layers before it)."""
    capture = Capture()
    self.call(outer_diff, b, capture)
    got = tree_map(jnp.shape, capture.value)
    want = tree_map(lambda a: a.shape, self.shape)
    if got != want:
      raise self.explain.input_shape(got, want)
    return capture.value

  def head(self, outer_diff, b, y):
    """The loss of microbatch ``b`` from the stack's output ``y``."""
    out = self.call(outer_diff, b, y)
    return (out[0] if self.training.has_aux else out) / (
        self.layout.microbatches)

  def run(self, x, chunk, r, state, *extra):
    """The stage's chunk ``r`` (whose variables are ``chunk``) on ``x``."""
    args = (x, chunk, state, _at(self.keys, r), _at(self.per_layer, r))
    return self.out_tree.unflatten(self.program(*leaves_of(args + extra)))

  def head_vjp(self, b, y):
    loss, pull = jax.vjp(lambda o, y: self.head(o, b, y), self.outer_diff, y)
    return (loss,) + pull(jnp.ones_like(loss))

  def embed_vjp(self, b, d_x):
    _, pull = jax.vjp(lambda o: self.embed(o, b), self.outer_diff)
    return pull(d_x)[0]

  @property
  def final(self):
    return self.layout.repeats - 1

  @staticmethod
  def extra_arguments(fill, per_chunk):
    """The program's arguments after the chunk's own."""
    del fill, per_chunk
    return ()

  def extra(self):
    return self.extra_arguments(self.fill, self.per_chunk)

  def forward_half(self, f, carry):
    """Forward of chunk ``f.repeat`` on microbatch ``f.micro``: stage 0's
    chunk 0 reads the loss up to the stack, the rest what arrived."""
    x = lax.cond(self.first & (f.repeat == 0),
                 lambda: self.embed(self.outer_diff, f.micro),
                 lambda: carry['arrived'])
    x = _select(f.ok, x, self.fill)
    state = _at(carry['mutable'], f.repeat)
    y, updated = self.run(x, _at(self.fixed, f.repeat), f.repeat, state,
                          *self.extra())[:2]
    carry = dict(carry, inputs=_put(carry['inputs'], f.slot, x, f.ok),
                 states=_put(carry['states'], f.slot, state, f.ok))
    carry['mutable'] = tree_map(
        lambda old, new: old.at[f.repeat].set(
            jnp.where(f.ok, new, old[f.repeat])), carry['mutable'], updated)
    if self.training.has_aux:
      carry['outputs'] = _put(carry['outputs'], f.micro, y,
                              f.ok & self.last & (f.repeat == self.final))
    return y, carry

  def cotangent_of(self, b, y, carry):
    """``(cotangent, carry)`` of chunk ``b.repeat``'s output: on the last
    stage's last chunk (whose forward ran this iteration, giving ``y``)
    from the loss, with the loss and the head's gradients added; elsewhere
    what the next stage sent."""
    at_head = b.ok & self.last & (b.repeat == self.final)
    l_b, d_head, d_y = lax.cond(
        at_head, self.head_vjp,
        lambda b, y: (jnp.zeros(()), _zeros(self.outer_diff), _zeros(y)),
        b.micro, y)
    ct = _select(at_head, d_y, carry['cotangent'])
    carry = dict(carry, loss=carry['loss'] + jnp.where(at_head, l_b, 0.),
                 outer_grads=_added(carry['outer_grads'], d_head, at_head))
    return _select(b.ok, ct, _zeros(ct)), carry

  def embedded(self, b, d_x, carry):
    """The gradients of the layers before the stack, on stage 0's chunk
    0."""
    at_embed = b.ok & self.first & (b.repeat == 0)
    d_embed = lax.cond(at_embed, self.embed_vjp,
                       lambda b, d_x: _zeros(self.outer_diff), b.micro, d_x)
    return dict(carry, outer_grads=_added(carry['outer_grads'], d_embed,
                                          at_embed))

  def stored(self, slot, carry):
    return _at(carry['inputs'], slot.slot), _at(carry['states'], slot.slot)

  def backward_half(self, b, y, carry):
    """Backward of chunk ``b.repeat`` on microbatch ``b.micro``: the vjp
    by the input and the chunk's variables, recomputed from the stored
    input."""
    ct, carry = self.cotangent_of(b, y, carry)
    x, state = self.stored(b, carry)
    chunk_diff, rebuild = _inexact(_at(self.fixed, b.repeat))
    _, pull = jax.vjp(
        lambda x, p: self.run(x, rebuild(p), b.repeat, state)[0], x,
        chunk_diff)
    d_x, d_chunk = pull(ct)
    carry = dict(carry, grads=_added_at(carry['grads'], b.repeat, d_chunk,
                                        b.ok))
    return d_x, self.embedded(b, d_x, carry)

  def iteration(self, carry, rows, kinds):
    y = d_x = _garbage(self.fill)
    slots = {k: _Slot.of(rows.get(k), self.s) for k in ('F', 'B', 'W')}
    # (Named scopes: benchmarks.pipeline reads which slots a loop holds.)
    if 'F' in kinds:
      with jax.named_scope('pipeline_slot_F'):
        y, carry = self.forward_half(slots['F'], carry)
    if 'B' in kinds:
      with jax.named_scope('pipeline_slot_B'):
        d_x, carry = self.backward_half(slots['B'], y, carry)
    if 'W' in kinds:
      with jax.named_scope('pipeline_slot_W'):
        carry = self.weight_half(slots['W'], carry)
    n_stages = self.layout.stages
    carry = dict(
        carry,
        arrived=lax.ppermute(y, self.layout.axis, _neighbours(n_stages, 1)),
        cotangent=lax.ppermute(d_x, self.layout.axis,
                               _neighbours(n_stages, -1)))
    return carry, None

  def weight_half(self, w, carry):
    raise NotImplementedError('only the zero-bubble loop has W slots')


class _ZeroBubble(_OneFOneB):
  """The zero-bubble (ZB-H1) loop: 1F1B's with the backward split. ``B``
  (on the critical path) takes the vjp by the stage input only, with a
  zero probe added to every layer's output whose cotangent it keeps (the
  cotangent of each layer's output); ``W``, ``s`` iterations later on
  stage ``s``, recomputes the layers with the gradient cut between them
  and takes the vjp by the chunk's variables of every layer's output on
  those cotangents: each layer's weight gradient, exactly the one 1F1B's
  backward computes."""

  def start(self, mutable):
    cots = _repeated(_repeated(self.fill, self.per_chunk),
                     self.table.cotangents)
    return dict(super().start(mutable), cots=cots)

  @staticmethod
  def extra_arguments(fill, per_chunk):
    """Zero probes on every layer's output, and whether to cut the
    gradient between layers (no)."""
    return _repeated(fill, per_chunk), jnp.zeros((), bool)

  def probes(self):
    return self.extra()[0]

  def backward_half(self, b, y, carry):
    ct, carry = self.cotangent_of(b, y, carry)
    x, state = self.stored(b, carry)
    chunk = _at(self.fixed, b.repeat)
    _, pull = jax.vjp(
        lambda x, probes: self.run(x, chunk, b.repeat, state, probes,
                                   jnp.zeros((), bool))[0], x, self.probes())
    d_x, d_layers = pull(ct)
    carry = dict(carry, cots=_put(carry['cots'], b.cot, d_layers, b.ok))
    return d_x, self.embedded(b, d_x, carry)

  def weight_half(self, w, carry):
    x, state = self.stored(w, carry)
    chunk_diff, rebuild = _inexact(_at(self.fixed, w.repeat))
    _, pull = jax.vjp(
        lambda p: self.run(x, rebuild(p), w.repeat, state, self.probes(),
                           jnp.ones((), bool))[2], chunk_diff)
    d_chunk, = pull(_at(carry['cots'], w.cot))
    return dict(carry, grads=_added_at(carry['grads'], w.repeat, d_chunk,
                                       w.ok))


def _added(acc, d, ok):
  """``acc + d`` where ``ok``."""
  return tree_map(lambda a, g: a + jnp.where(ok, g, jnp.zeros_like(g)), acc, d)


def _added_at(acc, r, d, ok):
  """``acc`` with ``d`` added to its entry ``r`` where ``ok``."""
  return tree_map(
      lambda a, g: a.at[r].add(jnp.where(ok, g, jnp.zeros_like(g))), acc, d)
