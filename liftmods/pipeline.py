"""Pipeline parallelism for layer stacks: ``nn.Stack(..., pipeline=...)``.

A pipelined stack splits its ``L`` layers into ``S`` stages laid along one
mesh axis and its batch into ``M`` microbatches. Every stage runs its share
of the layers on one microbatch per iteration and hands the result to the
next stage with a collective permute; ``M·R + S − 1`` iterations run every
microbatch through every layer. With ``repeats=R > 1`` (circular schedule)
each stage owns ``R`` interleaved groups of layers and the microbatches go
round the ring of stages ``R`` times, which shrinks the idle fraction.

The layers of stage ``s`` in repeat ``r`` are ``(r·S + s)·K + l`` for
``l < K = L / (R·S)``. The stack stores its ``(L, ...)`` variables
*stage-major* (all of stage 0's layers first), so that the ordinary rule
``('layers', 'stage')`` gives every stage exactly its own layers; with
``R = 1`` that is the natural layer order and a checkpoint moves between
the pipelined and the unpipelined stack unchanged. For ``R > 1`` use
:meth:`Pipeline.to_pipeline_layout` / :meth:`Pipeline.to_stack_layout`.

>>> p = Pipeline(stages=2, microbatches=4, repeats=2)
>>> p.iterations, round(p.bubble_fraction, 3)
(9, 0.111)
>>> p.schedule()[:3].tolist()   # work item per (iteration, stage); -1 idle
[[0, -1], [1, 0], [2, 1]]
"""
import contextlib
import dataclasses
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from liftmods import errors


class PipelineError(errors.StackError):
  """A pipelined stack cannot run as configured or on the given inputs."""


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """How an ``nn.Stack`` is pipelined over a mesh axis.

  Attributes:
    stages: ``S``, the number of stages; the size of mesh axis ``axis``.
    microbatches: ``M``, the number of microbatches the batch (leading axis
      of the carry) is split into; microbatch ``m`` holds rows ``m, m + M,
      m + 2M, ...`` (so a batch sharded over a data axis stays sharded
      within every microbatch).
    repeats: ``R``; ``1`` is GPipe, ``R > 1`` the circular schedule (needs
      ``M >= S``).
    axis: the mesh axis the stages are laid along.
    remat_iterations: rematerialize each iteration of the schedule, keeping
      only its input for the backward pass. Exclusive with the stack's
      ``policy`` (remat at both levels recomputes every layer twice).
    per_microbatch: names of mutable collections the blocks may update
      (e.g. a counter). Such a collection is updated once per microbatch,
      in microbatch order, never on an idle iteration. Any other mutable
      collection is an error: e.g. BatchNorm statistics would become a
      running average over microbatches, not the unpipelined full-batch
      update.
    mesh: the mesh; ``None`` takes the one set with ``jax.set_mesh`` /
      ``jax.sharding.use_mesh``.
  """
  stages: int
  microbatches: int
  repeats: int = 1
  axis: str = 'stage'
  remat_iterations: bool = False
  per_microbatch: Sequence[str] = ()
  mesh: Any = None

  def __post_init__(self):
    for name in ('stages', 'microbatches', 'repeats'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'Pipeline.{name} must be a positive int; got '
                         f'{value!r}.')
    if self.repeats > 1 and self.microbatches < self.stages:
      raise ValueError(
          f'Pipeline: the circular schedule (repeats={self.repeats}) needs '
          f'at least as many microbatches as stages; got microbatches='
          f'{self.microbatches} < stages={self.stages}.')
    names = self.per_microbatch
    object.__setattr__(self, 'per_microbatch',
                       (names,) if isinstance(names, str) else tuple(names))

  @property
  def iterations(self) -> int:
    """``M·R + S − 1``: the length of the loop over iterations."""
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    """``(S − 1) / (M·R + S − 1)``: the share of idle stage-iterations."""
    return (self.stages - 1) / self.iterations

  def schedule(self) -> np.ndarray:
    """``(iterations, stages)`` work items: ``j = r·M + m`` (repeat ``r``,
    microbatch ``m``) that stage ``s`` runs at iteration ``t``, or -1."""
    t = np.arange(self.iterations)[:, None]
    j = t - np.arange(self.stages)[None, :]
    return np.where((j >= 0) & (j < self.microbatches * self.repeats), j, -1)

  def layers_per_stage(self, length: int, path: str = '') -> int:
    """``K = L / (R·S)``, or a PipelineError when that does not divide."""
    groups = self.repeats * self.stages
    if length % groups:
      raise PipelineError(
          f'Stack at {path}: {length} layers cannot be pipelined over '
          f'stages={self.stages} x repeats={self.repeats}: the number of '
          f'layers must be divisible by stages·repeats = {groups}.')
    return length // groups

  def stage_major(self, tree):
    """Reorders the leading (layer) axis of every array from layer order to
    the stored order (stage-major); the identity for ``R = 1``."""
    return self._permute(tree, (self.repeats, self.stages))

  def layer_order(self, tree):
    """Inverse of :meth:`stage_major`."""
    return self._permute(tree, (self.stages, self.repeats))

  def to_pipeline_layout(self, variables):
    """An unpipelined stack's variables (layer order) as this pipelined
    stack stores them. Give it the stack's own subtree (every array has the
    leading layer axis); boxed values keep their boxes.

    >>> p = Pipeline(stages=2, microbatches=2, repeats=2)
    >>> p.to_pipeline_layout({'w': jnp.arange(8)})['w'].tolist()
    [0, 1, 4, 5, 2, 3, 6, 7]
    >>> p.to_stack_layout(p.to_pipeline_layout({'w': jnp.arange(8)}))[
    ...     'w'].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    return self.stage_major(variables)

  def to_stack_layout(self, variables):
    """Inverse of :meth:`to_pipeline_layout`."""
    return self.layer_order(variables)

  def _permute(self, tree, outer):
    if self.repeats == 1:
      return tree

    def move(a):
      length, rest = a.shape[0], a.shape[1:]
      inner = length // (self.repeats * self.stages)
      a = a.reshape(outer + (inner,) + rest)
      return jnp.swapaxes(a, 0, 1).reshape((length,) + rest)

    return jax.tree_util.tree_map(move, tree)

  def resolve_mesh(self, path: str = ''):
    """The mesh to run on; a PipelineError when it lacks the stage axis or
    its size is not ``stages``."""
    mesh = self.mesh
    if mesh is None:
      mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, 'axis_names', ()) or ())
    if self.axis not in names:
      raise PipelineError(
          f'Stack at {path}: the pipeline runs its stages along mesh axis '
          f'{self.axis!r}, but the mesh has axes {names or "(no mesh set)"}.'
          ' Set a mesh with that axis (jax.set_mesh(mesh)) or pass '
          'Pipeline(mesh=...).')
    size = dict(zip(names, mesh.axis_sizes))[self.axis]
    if size != self.stages:
      raise PipelineError(
          f'Stack at {path}: mesh axis {self.axis!r} has {size} devices, but '
          f'the pipeline has stages={self.stages}; they must be equal.')
    return mesh


# -- where a pipelined stack's variables live ----------------------------------------


class _StackAxes(threading.local):
  record: dict | None = None


_stack_axes = _StackAxes()


@contextlib.contextmanager
def record_stage_axes():
  """Collects ``{module path: stage mesh axis}`` for every pipelined stack
  this thread calls inside the ``with`` block. ``nn.init_sharded`` reads
  it: every variable of a pipelined stack has its layer axis (axis 0) on
  the stage axis, whatever its annotations say.

  >>> import jax, jax.numpy as jnp, liftmods as nn
  >>> class Block(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return x + nn.Dense(x.shape[-1])(x)
  >>> stack = nn.Stack(Block, 2, pipeline=Pipeline(stages=2, microbatches=2))
  >>> with record_stage_axes() as seen:
  ...   _ = jax.eval_shape(stack().init, jax.random.key(0), jnp.ones((2, 4)))
  >>> seen   # the stack is the root module here: path ()
  {(): 'stage'}
  """
  outer, _stack_axes.record = _stack_axes.record, {}
  try:
    yield _stack_axes.record
  finally:
    seen, _stack_axes.record = _stack_axes.record, outer
    if outer is not None:
      outer.update(seen)


def note_stack(path: Sequence[str], pipeline: Pipeline) -> None:
  """Records that the stack at module ``path`` is pipelined (for
  :func:`record_stage_axes`; nothing when no recording is active)."""
  if _stack_axes.record is not None:
    _stack_axes.record[tuple(path)] = pipeline.axis


def stage_spec(where: str, spec: PartitionSpec, ndim: int,
               axis: str) -> PartitionSpec:
  """``spec`` (a variable's placement from its annotations) with the
  variable's layer axis (axis 0) on the stage mesh axis ``axis``; a
  PipelineError when the annotations put the layer axis on another mesh
  axis or use ``axis`` for another dimension.

  >>> stage_spec('v', PartitionSpec(), 2, 'stage')
  P('stage', None)
  >>> stage_spec('v', PartitionSpec('stage', 'model'), 3, 'stage')
  P('stage', 'model', None)
  """
  entries = list(spec) + [None] * (ndim - len(spec))
  if not entries:
    raise PipelineError(f'{where} belongs to a pipelined stack but is a '
                        'scalar; every variable of a stack has a leading '
                        'layer axis.')
  def axes(entry):
    return set(entry) if isinstance(entry, tuple) else (
        set() if entry is None or entry is PartitionSpec.UNCONSTRAINED
        else {entry})
  first = axes(entries[0])
  if first and first != {axis}:
    raise PipelineError(
        f'{where} belongs to a stack pipelined over mesh axis {axis!r}, but '
        f'its annotations place its layer axis on {entries[0]!r} (spec '
        f'{spec}); a pipelined stack puts every layer on its stage. Map the '
        f"layer axis to {axis!r} (rule ('layers', {axis!r})) or to nothing.")
  for dim, entry in enumerate(entries[1:], 1):
    if axis in axes(entry):
      raise PipelineError(
          f'{where} belongs to a stack pipelined over mesh axis {axis!r}, '
          f'but its annotations also shard dimension {dim} over {axis!r} '
          f'(spec {spec}); the stage axis holds the layers. Map that '
          'dimension to another mesh axis.')
  return PartitionSpec(axis, *entries[1:])


# -- the schedule -------------------------------------------------------------------


def _microbatches(c, m, path):
  """``(B, ...) -> (M, B/M, ...)``, microbatch ``i`` holding rows ``i::M``."""
  def split(x):
    shape = jnp.shape(x)
    if not shape or shape[0] % m:
      raise PipelineError(
          f'Stack at {path}: the batch (leading axis of the carry) must be '
          f'divisible by microbatches={m}; got a carry of shape '
          f'{tuple(shape)}.')
    return jnp.swapaxes(x.reshape((shape[0] // m, m) + shape[1:]), 0, 1)
  return jax.tree_util.tree_map(split, c)


def _join(c):
  """Inverse of :func:`_microbatches`."""
  def join(x):
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
  return jax.tree_util.tree_map(join, c)


def _staged(tree, pipeline):
  """``(L, ...)`` stage-major -> ``(S, R, K, ...)``."""
  s, r = pipeline.stages, pipeline.repeats
  return jax.tree_util.tree_map(
      lambda a: a.reshape((s, r, a.shape[0] // (s * r)) + a.shape[1:]), tree)


def _unstaged(tree):
  return jax.tree_util.tree_map(
      lambda a: a.reshape((-1,) + a.shape[3:]), tree)


def _at(tree, i):
  return jax.tree_util.tree_map(lambda a: a[i], tree)


def _select(pred, a, b):
  return jax.tree_util.tree_map(lambda x, y: jnp.where(pred, x, y), a, b)


def initializing(scopes, stacked) -> bool:
  """Whether the stack is creating its parameters (``init``)."""
  return scopes[0].is_mutable_collection('params') and not (
      jax.tree_util.tree_leaves([v.get('params', {}) for v in stacked]))


def _split_collections(pipeline, stacked, is_mutable, path):
  """``stacked`` (one dict of collections per scope) -> (read-only,
  updated), with a PipelineError for a collection that cannot be
  pipelined."""
  for cols in stacked:
    for col in cols:
      if not is_mutable(col) or col in pipeline.per_microbatch:
        continue
      raise PipelineError(
          f'Stack at {path}: collection {col!r} is mutable, and a pipelined '
          'stack runs each layer once per microbatch, so it would be '
          'updated microbatch by microbatch rather than once on the whole '
          'batch (BatchNorm statistics, for one, would differ from the '
          "unpipelined stack's). If one update per microbatch is what the "
          f'block means (a counter), declare Pipeline(per_microbatch='
          f"({col!r},)); otherwise do not make it mutable here.")
  fixed = tuple({c: v for c, v in cols.items() if not is_mutable(c)}
                for cols in stacked)
  mutable = tuple({c: v for c, v in cols.items() if is_mutable(c)}
                  for cols in stacked)
  return fixed, mutable


_SLICING = frozenset({'dynamic_slice', 'gather', 'slice', 'squeeze',
                      'reshape'})


def _save_all_but_slices(prim, *_, **__):
  return prim.name not in _SLICING


def run(pipeline: Pipeline, layer, policy, c, stacked, keys, per_layer, *,
        is_mutable, length: int, path: str):
  """Runs ``L`` layers on the carry ``c`` with the pipeline's schedule.

  ``layer(c, (variables, keys, per_layer)) -> (c, (ys, mutable_out))`` is
  one layer of the stack and ``policy`` its ``jax.checkpoint`` policy (or
  None); ``stacked`` holds
  the stack's variables (one dict of collections per scope) in stored
  (stage-major) order, ``keys`` and ``per_layer`` are in layer order and
  ``is_mutable(collection)`` says which collections the layers update.
  Returns ``(c, mutable collections)``, the latter stage-major.
  """
  pipeline.layers_per_stage(length, path)
  mesh = pipeline.resolve_mesh(path)
  fixed, mutable = _split_collections(pipeline, stacked, is_mutable, path)
  n_stages, n_micro = pipeline.stages, pipeline.microbatches
  n_work = n_micro * pipeline.repeats
  micro = _microbatches(c, n_micro, path)
  staged = (_staged(fixed, pipeline), _staged(mutable, pipeline),
            _staged(pipeline.stage_major(keys), pipeline),
            _staged(pipeline.stage_major(per_layer), pipeline))

  n_layers = length // (n_stages * pipeline.repeats)

  def stage(x, fixed, r, mutable, keys, per_layer):
    """The stage's ``K`` layers of repeat ``r`` on one microbatch."""

    # The parameters are sliced inside the checkpoint: the backward pass
    # slices them again instead of keeping a copy per iteration.
    def one(x, sliced):
      l, mutable, keys, per_layer = sliced
      own = _at(_at(fixed, r), l)
      variables = tuple({**f, **m} for f, m in zip(own, mutable))
      return layer(x, (variables, keys, per_layer))

    one = jax.checkpoint(one, policy=policy or _save_all_but_slices,
                         prevent_cse=False)
    x, (_, updated) = lax.scan(
        one, x, (jnp.arange(n_layers), mutable, keys, per_layer))
    if (jax.tree_util.tree_structure(updated) !=
        jax.tree_util.tree_structure(mutable)):
      raise PipelineError(
          f'Stack at {path}: the blocks wrote mutable variables '
          f'{jax.tree_util.tree_structure(updated)} but the stack holds '
          f'{jax.tree_util.tree_structure(mutable)}; a pipelined stack can '
          'only update variables that already exist (create them in init).')
    return x, updated

  def per_stage(micro, fixed, mutable, keys, per_layer):
    fixed, mutable, keys, per_layer = _at((fixed, mutable, keys, per_layer), 0)
    s = lax.axis_index(pipeline.axis)
    fill = jax.tree_util.tree_map(lax.stop_gradient, _at(micro, 0))
    # What arrives before a stage has real work is garbage; NaN makes any
    # leak of it into outputs or gradients visible.
    garbage = jax.tree_util.tree_map(
        lambda a: jnp.full_like(a, jnp.nan), fill)
    ring = [(i, (i + 1) % n_stages) for i in range(n_stages)]
    # remat_iterations: the backward pass keeps each iteration's input
    # microbatch (not the batch buffers the loop carries) and reruns the
    # stage from it.
    run_stage = (jax.checkpoint(
        stage, policy=jax.checkpoint_policies.nothing_saveable,
        prevent_cse=False) if pipeline.remat_iterations else stage)

    def store(buffer, arrived, t):
      done = t - n_stages  # the work item the last stage finished at t - 1
      slot = jnp.mod(done, n_micro)
      ok = (done >= 0) & (done < n_work)
      return jax.tree_util.tree_map(
          lambda b, a: b.at[slot].set(jnp.where(ok, a, b[slot])), buffer,
          arrived)

    def iteration(carry, t):
      arrived, buffer, mutable = carry
      buffer = store(buffer, arrived, t)
      j = t - s
      valid = (j >= 0) & (j < n_work)
      r = jnp.clip(j, 0, n_work - 1) // n_micro
      x = _select(s == 0, _at(buffer, jnp.mod(t, n_micro)), arrived)
      x = _select(valid, x, fill)
      y, updated = run_stage(x, fixed, r, _at(mutable, r), _at(keys, r),
                             _at(per_layer, r))
      mutable = jax.tree_util.tree_map(
          lambda old, new: old.at[r].set(jnp.where(valid, new, old[r])),
          mutable, updated)
      arrived = lax.ppermute(y, pipeline.axis, ring)
      return (arrived, buffer, mutable), None

    (arrived, buffer, mutable), _ = lax.scan(
        iteration, (garbage, micro, mutable),
        jnp.arange(pipeline.iterations))
    buffer = store(buffer, arrived, jnp.asarray(pipeline.iterations))
    return _lead(buffer), _lead(mutable)

  spec = PartitionSpec(pipeline.axis)
  out, mutable = jax.shard_map(
      per_stage, mesh=mesh, in_specs=(PartitionSpec(),) + (spec,) * 4,
      out_specs=(spec, spec), axis_names={pipeline.axis},
      check_vma=False)(micro, *staged)
  return _join(_at(out, 0)), _unstaged(mutable)


def _lead(tree):
  return jax.tree_util.tree_map(lambda a: a[None], tree)


def check_stack(pipeline, length: int, policy, mode: str):
  """Raises for a stack configuration the pipeline cannot run."""
  if pipeline is None:
    return
  if not isinstance(pipeline, Pipeline):
    raise TypeError(f'Stack: pipeline must be an nn.Pipeline or None; got '
                    f'{pipeline!r}.')
  pipeline.layers_per_stage(length, '<Stack>')
  if mode != 'scan':
    raise ValueError(f"Stack: a pipelined stack runs its own loop; mode must "
                     f"be 'scan', got {mode!r}.")
  if policy is not None and policy.nested is not False:
    raise ValueError('Stack: a nested policy groups layers across the whole '
                     'stack, which a pipeline splits into stages; use a '
                     'per-layer policy.')
  if policy is not None and pipeline.remat_iterations:
    raise ValueError(
        'Stack: remat_iterations=True rematerializes whole iterations; a '
        'stack policy on top would recompute every layer twice. Use one of '
        'the two.')
