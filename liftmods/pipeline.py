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

``Pipeline(mode='1f1b')`` with :func:`value_and_grad` (in place of
``jax.value_and_grad``) runs the one-forward-one-backward schedule: each
iteration a stage runs one microbatch's forward and another's backward, so
its activation memory does not grow with ``M``.

>>> p = Pipeline(stages=2, microbatches=4, repeats=2)
>>> p.iterations, round(p.bubble_fraction, 3)
(9, 0.111)
>>> p.schedule()[:3].tolist()   # work item per (iteration, stage); -1 idle
[[0, -1], [1, 0], [2, 1]]
"""
import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from liftmods import call_context, errors, spmd
from liftmods.call_context import split_arrays


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
    mode: ``'gpipe'`` (a forward loop; ``jax.grad`` runs the backward loop
      after it) or ``'1f1b'``: under :func:`value_and_grad` each iteration
      runs one microbatch's forward and another's backward, so a stage
      holds at most ``2(S − s) − 1`` microbatch inputs whatever ``M`` is.
      Outside :func:`value_and_grad` (evaluation) a ``'1f1b'`` stack runs
      the GPipe forward loop. ``'1f1b'`` needs ``repeats=1``.
  """
  stages: int
  microbatches: int
  repeats: int = 1
  axis: str = 'stage'
  remat_iterations: bool = False
  per_microbatch: Sequence[str] = ()
  mesh: Any = None
  mode: str = 'gpipe'

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
    if self.mode not in ('gpipe', '1f1b'):
      raise ValueError(f"Pipeline.mode must be 'gpipe' or '1f1b'; got "
                       f'{self.mode!r}.')
    if self.mode == '1f1b' and self.repeats != 1:
      raise ValueError(
          f"Pipeline: mode='1f1b' runs repeats=1 (the interleaved 1F1B "
          f'schedule is not implemented); got repeats={self.repeats}.')
    if self.mode == '1f1b' and self.remat_iterations:
      raise ValueError(
          "Pipeline: mode='1f1b' already recomputes each stage from its "
          'stored input in the backward pass; remat_iterations applies to '
          "mode='gpipe' only.")
    names = self.per_microbatch
    object.__setattr__(self, 'per_microbatch',
                       (names,) if isinstance(names, str) else tuple(names))

  @property
  def iterations(self) -> int:
    """The length of the loop over iterations: ``M·R + S − 1`` (GPipe,
    circular; each iteration a forward, ``jax.grad`` adds as many backward
    iterations), ``M + 2S − 2`` for ``'1f1b'`` (each iteration a forward
    and a backward)."""
    if self.mode == '1f1b':
      return self.microbatches + 2 * self.stages - 2
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    """The share of idle stage-iterations, ``(S − 1) / (M·R + S − 1)``.
    For ``'1f1b'`` the share of idle forward (and of idle backward) slots
    among those the loop runs: its first ``S − 1`` iterations run no
    backward and its last ``S − 1`` no forward on any stage, and skip them,
    so each stage runs ``M + S − 1`` forward and ``M + S − 1`` backward
    slots, ``S − 1`` of each idle: GPipe's fraction."""
    return (self.stages - 1) / (
        self.microbatches * self.repeats + self.stages - 1)

  def schedule(self) -> np.ndarray:
    """``(iterations, stages)`` work items: ``j = r·M + m`` (repeat ``r``,
    microbatch ``m``) that stage ``s`` runs forward at iteration ``t``, or
    -1."""
    t = np.arange(self.iterations)[:, None]
    j = t - np.arange(self.stages)[None, :]
    return np.where((j >= 0) & (j < self.microbatches * self.repeats), j, -1)

  def backward_schedule(self) -> np.ndarray:
    """For ``'1f1b'``: the ``(iterations, stages)`` microbatches whose
    backward pass stage ``s`` runs at iteration ``t`` (``t − 2S + 2 + s``),
    or -1. The last stage runs a microbatch's backward in the iteration of
    its forward, and each cotangent takes one iteration per stage back.

    >>> p = Pipeline(stages=2, microbatches=3, mode='1f1b')
    >>> p.schedule().T.tolist(), p.backward_schedule().T.tolist()
    ([[0, 1, 2, -1, -1], [-1, 0, 1, 2, -1]], [[-1, -1, 0, 1, 2], \
[-1, 0, 1, 2, -1]])
    """
    if self.mode != '1f1b':
      raise ValueError("backward_schedule: the backward pass of mode="
                       f"{self.mode!r} is jax.grad's loop, not a schedule.")
    t = np.arange(self.iterations)[:, None]
    b = t - (2 * self.stages - 2) + np.arange(self.stages)[None, :]
    return np.where((b >= 0) & (b < self.microbatches), b, -1)

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


def record_stage_axes() -> contextlib.AbstractContextManager[dict]:
  """Collects ``{module path: stage mesh axis}`` for every pipelined stack
  this thread calls inside the ``with`` block. ``nn.init_sharded`` reads
  it: every variable of a pipelined stack has its layer axis (axis 0) on
  the stage axis, whatever its annotations say. A view on the call
  recorder (``call_context.record`` of ``STAGE_AXES``): nested blocks each
  see the stacks of the blocks inside them.

  Returns:
    A context manager yielding the dict, filled as the block runs.

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
  return call_context.record(call_context.STAGE_AXES)


def note_stack(path: Sequence[str], pipeline: Pipeline) -> None:
  """Records that the stack at module ``path`` is pipelined (for
  :func:`record_stage_axes`; nothing when no recording is active)."""
  call_context.note(call_context.STAGE_AXES, (tuple(path), pipeline.axis))


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


@dataclasses.dataclass(frozen=True)
class StackSchedule:
  """A pipeline's schedule as the loop of a stack (a ``Schedule`` of
  ``core.layer_scan``). It runs every call but ``init``, which creates the
  variables as the unpipelined stack does and stores them in the
  pipeline's (stage-major) order.

  Attributes:
    pipeline: the pipeline.
    path: the stack's path, for errors.
  """
  pipeline: 'Pipeline'
  path: str

  def takes_over(self, scopes, stacked) -> bool:
    """False in ``init``: the plain loop creates the variables."""
    return not initializing(scopes, stacked)

  def run_layers(self, layer, policy, c, stacked, keys, per_layer, length,
                 scopes):
    """The layers on the schedule (see :func:`run_schedule`)."""
    return run_schedule(self.pipeline, layer, policy, c, stacked, keys,
                        per_layer, length=length,
                        is_mutable=scopes[0].is_mutable_collection,
                        path=self.path)

  def store(self, variables):
    """The plain loop's variables, stage-major."""
    return self.pipeline.stage_major(variables)


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


def _stage_fn(layer, policy, n_layers, path):
  """``stage(x, fixed, r, mutable, keys, per_layer) -> (x, updated)``: the
  stage's ``K`` layers of repeat ``r`` on one microbatch."""

  def stage(x, fixed, r, mutable, keys, per_layer):
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

  return stage


def _garbage(fill):
  """What arrives before a stage has real work: NaN, so that any leak of it
  into outputs or gradients is visible."""
  return jax.tree_util.tree_map(lambda a: jnp.full_like(a, jnp.nan), fill)


def _neighbours(n_stages, step):
  return [(i, (i + step) % n_stages) for i in range(n_stages)]


def run_schedule(pipeline: Pipeline, layer, policy, c, stacked, keys,
                 per_layer, *, is_mutable, length: int, path: str):
  """Runs ``L`` layers on the carry ``c`` with the pipeline's schedule.

  ``layer(c, (variables, keys, per_layer)) -> (c, (ys, mutable_out))`` is
  one layer of the stack and ``policy`` its ``jax.checkpoint`` policy (or
  None); ``stacked`` holds
  the stack's variables (one dict of collections per scope) in stored
  (stage-major) order, ``keys`` and ``per_layer`` are in layer order and
  ``is_mutable(collection)`` says which collections the layers update.
  Returns ``(c, mutable collections)``, the latter stage-major.

  A ``'1f1b'`` pipeline inside :func:`value_and_grad` runs the
  one-forward-one-backward schedule (:func:`_run_1f1b`); anywhere else
  every schedule runs this forward loop.
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
  stage = _stage_fn(layer, policy, length // (n_stages * pipeline.repeats),
                    path)
  training = _training.context
  if pipeline.mode == '1f1b' and training is not None:
    return _run_1f1b(pipeline, training, stage, mesh, micro, fixed, staged,
                     path)

  def per_stage(micro, fixed, mutable, keys, per_layer):
    fixed, mutable, keys, per_layer = _at((fixed, mutable, keys, per_layer), 0)
    s = lax.axis_index(pipeline.axis)
    fill = jax.tree_util.tree_map(lax.stop_gradient, _at(micro, 0))
    ring = _neighbours(n_stages, 1)
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

    iterations = n_work + n_stages - 1
    (arrived, buffer, mutable), _ = lax.scan(
        iteration, (_garbage(fill), micro, mutable), jnp.arange(iterations))
    buffer = store(buffer, arrived, jnp.asarray(iterations))
    return _lead(buffer), _lead(mutable)

  spec = PartitionSpec(pipeline.axis)
  out, mutable = jax.shard_map(
      per_stage, mesh=mesh, in_specs=(PartitionSpec(),) + (spec,) * 4,
      out_specs=(spec, spec), axis_names={pipeline.axis},
      check_vma=False)(micro, *staged)
  return _join(_at(out, 0)), _unstaged(mutable)


# -- one forward, one backward ------------------------------------------------


class _Training(threading.local):
  context: Any = None      # the _TrainStep of value_and_grad, while it runs
  substitute: Any = None   # the stack output a microbatch's loss receives


_training = _Training()


@dataclasses.dataclass
class _TrainStep:
  """What the 1F1B loop needs from :func:`value_and_grad`'s call, and what
  it hands back."""
  loss_fn: Any
  has_aux: bool
  params: Any
  args: tuple
  shared: frozenset
  loss: Any = None
  path: Any = None


def value_and_grad(loss_fn: Callable[..., Any], *, has_aux: bool = False,
                   shared_argnums: Sequence[int] = ()) -> Callable[..., Any]:
  """``jax.value_and_grad(loss_fn)`` for a model whose pipelined stack has
  ``Pipeline(mode='1f1b')``: the loss and the gradients of every variable
  in ``params`` (the stack's, and those of the layers before and after it),
  computed with the one-forward-one-backward schedule.

  ``loss_fn(params, *args)`` is the ordinary loss: it applies the model
  (which calls the stack once) and reduces to a scalar that is a **mean
  over the batch rows**. Inside the stack's loop ``loss_fn`` runs one
  microbatch at a time, on microbatch ``m`` of every array in ``args``
  (rows ``m, m + M, ...``; each array's leading axis is the batch, except
  scalars and the arguments in ``shared_argnums``, passed whole): on stage
  0 up to the stack (the layers before it, for the stage's input), on the
  last stage from the stack's output for that microbatch to the loss, both
  differentiated there. The loss returned is the mean over microbatches of
  those losses, which is ``loss_fn`` of the whole batch up to float32
  rounding. The layers outside the stack see the model's rngs on every
  microbatch (so dropout masks there repeat from microbatch to
  microbatch); the stack's layers draw GPipe's keys. See
  ``docs/pipeline.md``.

  Args:
    loss_fn: ``loss_fn(params, *args) -> loss`` (``(loss, aux)`` with
      ``has_aux``); it must call exactly one ``'1f1b'`` stack.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes from one
      call of ``loss_fn`` on the whole batch (e.g. updated collections).
    shared_argnums: positions in ``loss_fn``'s signature (``params`` is 0)
      of arguments without a batch axis, passed whole to every
      microbatch's call (a PRNG key array is a scalar and needs no entry).

  Returns:
    ``fn(params, *args) -> (loss, grads)`` (``((loss, aux), grads)`` with
    ``has_aux``), ``grads`` shaped like ``params``; trace it under
    ``jax.jit`` and a mesh with the pipeline's stage axis.

  Example::

    >>> import jax, jax.numpy as jnp, liftmods as nn
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + jnp.tanh(nn.Dense(x.shape[-1])(x))
    >>> class Model(nn.Module):
    ...   pipeline: nn.Pipeline
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     x = nn.Dense(8)(x)                                # embedding
    ...     x = nn.Stack(Block, 2, pipeline=self.pipeline)()(x)
    ...     return nn.Dense(1)(x)                             # head
    >>> pipe = nn.Pipeline(stages=1, microbatches=2, mode='1f1b')
    >>> x, y = jnp.ones((4, 3)), jnp.arange(4.)[:, None]
    >>> params = Model(None).init(jax.random.key(0), x)['params']
    >>> def loss_of(model):
    ...   def loss_fn(params, x, y):
    ...     return jnp.mean((model.apply({'params': params}, x) - y) ** 2)
    ...   return loss_fn
    >>> mesh = jax.make_mesh((1,), ('stage',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> with jax.set_mesh(mesh):
    ...   loss, grads = jax.jit(nn.pipeline.value_and_grad(
    ...       loss_of(Model(pipe))))(params, x, y)
    >>> ref_loss, ref = jax.value_and_grad(loss_of(Model(None)))(params, x, y)
    >>> bool(jnp.allclose(loss, ref_loss)), sorted(grads)
    (True, ['Dense_0', 'Dense_1', 'StackBlock_0'])
    >>> all(bool(jnp.allclose(a, b, atol=1e-6)) for a, b in zip(
    ...     jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)))
    True
  """

  shared = frozenset(shared_argnums)
  if 0 in shared:
    raise ValueError('pipeline.value_and_grad: shared_argnums counts params '
                     'as 0; it is differentiated, not shared.')

  def fn(params, *args):
    def total(params):
      step = _TrainStep(loss_fn, has_aux, params, args, shared)
      outer, _training.context = _training.context, step
      try:
        out = loss_fn(params, *args)
      finally:
        _training.context = outer
      if step.loss is None:
        raise PipelineError(
            "pipeline.value_and_grad: loss_fn called no stack with "
            "Pipeline(mode='1f1b'); for other stacks use "
            'jax.value_and_grad.')
      return (step.loss, out[1]) if has_aux else step.loss

    return jax.value_and_grad(total, has_aux=has_aux)(params)

  return fn


def substituted(pipeline: Pipeline, path: Sequence[str], x):
  """Inside the 1F1B loop's call of ``loss_fn`` on one microbatch: the
  stack output the loop computed for it (the stack at ``path`` returns it
  without running); otherwise None."""
  y = _training.substitute
  if y is None or pipeline.mode != '1f1b':
    return None
  if isinstance(y, _Capture):
    y.value = x
    return x
  if (jax.tree_util.tree_structure(x) != jax.tree_util.tree_structure(y) or
      [jnp.shape(a) for a in jax.tree_util.tree_leaves(x)] !=
      [jnp.shape(a) for a in jax.tree_util.tree_leaves(y)]):
    raise PipelineError(
        f"Stack at /{'/'.join(path)}: on one microbatch, loss_fn gave the "
        'stack an input of shapes '
        f'{[jnp.shape(a) for a in jax.tree_util.tree_leaves(x)]}, but the '
        'microbatch of its whole-batch input has shapes '
        f'{[jnp.shape(a) for a in jax.tree_util.tree_leaves(y)]}; every '
        'array argument of loss_fn after params must have the batch as its '
        'leading axis.')
  return y


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
  ids = {id(a) for a in jax.tree_util.tree_leaves(dropped)}
  return jax.tree_util.tree_map(lambda a: None if id(a) in ids else a, tree)


def _surrogate(loss, pairs):
  """``loss`` with the gradient ``g`` for each ``(value, g)`` in ``pairs``:
  ``loss + Σ g·(v − v)``, every term exactly zero, and the only path
  ``jax.grad`` can take (the loop's inputs are behind stop_gradient)."""
  total = lax.stop_gradient(loss)
  for value, grad in pairs:
    total = total + jnp.sum(lax.stop_gradient(grad) *
                            (value - lax.stop_gradient(value)))
  return total


class _Capture:
  """While the loop runs ``loss_fn`` up to the stack on one microbatch: the
  stack's input, which the stack records and returns unchanged."""
  value: Any = None


def _run_1f1b(pipeline, step, stage, mesh, micro, fixed, staged, path):
  """The one-forward-one-backward loop: sets ``step.loss`` (the mean
  microbatch loss, carrying every gradient) and returns the stack's
  ``(c, mutable collections)`` as :func:`run` does (``c`` is the real
  output only with ``has_aux``; otherwise nothing reads it).

  Each iteration, stage ``s`` runs forward microbatch ``f = t − s`` and
  backward microbatch ``b = t − 2S + 2 + s``, the latter's vjp recomputed
  from the stage input it stored (a ring of ``2S − 1`` slots). Stage 0 runs
  ``loss_fn`` up to the stack on microbatch ``f`` for the stage's input,
  and its vjp on microbatch ``b``; the last stage runs ``loss_fn`` from the
  stack's output on (and the vjp of) microbatch ``f = b``.
  """
  if step.path not in (None, path):
    raise PipelineError(
        f"pipeline.value_and_grad: loss_fn calls two stacks with Pipeline("
        f"mode='1f1b'), at {step.path} and {path}; it runs exactly one.")
  step.path = path
  n_stages, n_micro = pipeline.stages, pipeline.microbatches
  last = n_stages - 1
  window = 2 * n_stages - 1  # microbatch inputs a stage holds at most
  arrays, rebuild_args = split_arrays(step.args)
  batched = [jnp.ndim(a) > 0 and i + 1 not in step.shared
             for i, arg in enumerate(step.args)
             for a in split_arrays(arg)[0]]
  for a, is_batch in zip(arrays, batched):
    if is_batch and jnp.shape(a)[0] % n_micro:
      raise PipelineError(
          f'pipeline.value_and_grad: every array argument of loss_fn after '
          f'params is split into microbatches=M={n_micro} along its leading '
          f'(batch) axis; got one of shape {jnp.shape(a)}. Declare '
          'arguments without a batch axis in shared_argnums.')
  # (B/M, M, ...): microbatch b is [:, b], rows b, b + M, ...; a view of
  # the batch, where _microbatches' (M, B/M, ...) would be a copy of it.
  batches = [a.reshape((a.shape[0] // n_micro, n_micro) + a.shape[1:])
             if is_batch else a for a, is_batch in zip(arrays, batched)]
  # The other layers' parameters travel into the loop; the stack's own
  # (which loss_fn's calls in the loop never read) must not, or every stage
  # would get all of them.
  outer = _without(step.params, fixed)
  if len(jax.tree_util.tree_leaves(outer)) == len(
      jax.tree_util.tree_leaves(step.params)):
    raise PipelineError(
        f'Stack at {path}: pipeline.value_and_grad cannot find the stack\'s '
        'variables in the params given to loss_fn; loss_fn must pass them '
        'to model.apply unchanged.')
  sg = lambda tree: jax.tree_util.tree_map(lax.stop_gradient, tree)
  zeros = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)
  shape = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), micro)

  def per_stage(batches, outer, fixed, mutable, keys, per_layer):
    fixed, mutable, keys, per_layer = _at((fixed, mutable, keys, per_layer), 0)
    outer_diff, rebuild_outer = _inexact(outer)
    fixed_diff, rebuild_fixed = _inexact(fixed)
    s = lax.axis_index(pipeline.axis)
    fill = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype),
                                  shape)

    def call(outer_diff, b, given):
      """``loss_fn`` on microbatch ``b``, the stack replaced by ``given``."""
      args = rebuild_args([a[:, b] if is_batch else a
                           for a, is_batch in zip(batches, batched)])
      saved, _training.substitute = _training.substitute, given
      try:
        return step.loss_fn(rebuild_outer(outer_diff), *args)
      finally:
        _training.substitute = saved

    def embed(outer_diff, b):
      """The stack's input on microbatch ``b`` (layers before the stack)."""
      capture = _Capture()
      call(outer_diff, b, capture)
      got = jax.tree_util.tree_map(jnp.shape, capture.value)
      if got != jax.tree_util.tree_map(lambda a: a.shape, shape):
        raise PipelineError(
            f'Stack at {path}: on one microbatch, loss_fn gave the stack an '
            f'input of shape {got}, not the microbatch\'s '
            f'{jax.tree_util.tree_map(lambda a: a.shape, shape)}: pass the '
            'batch to loss_fn as an argument (after params), not in a '
            'closure, so that pipeline.value_and_grad can split it.')
      return capture.value

    def head(outer_diff, b, y):
      """The loss of microbatch ``b`` from the stack's output ``y``."""
      out = call(outer_diff, b, y)
      return (out[0] if step.has_aux else out) / n_micro

    def stage_once(x, fixed_diff, mutable):
      return stage(x, rebuild_fixed(fixed_diff), 0, mutable, _at(keys, 0),
                   _at(per_layer, 0))

    # The stage is traced once, and its program run by the forward and by
    # the backward's recomputation: tracing the blocks again would move
    # their rng counters, and the recomputation would draw other dropout
    # masks than the forward did.
    traced, out_shape = jax.make_jaxpr(stage_once, return_shape=True)(
        fill, fixed_diff, _at(mutable, 0))
    out_tree = jax.tree_util.tree_structure(out_shape)
    program = jax.extend.core.jaxpr_as_fun(traced)

    def forward(x, fixed_diff, mutable):
      return out_tree.unflatten(program(
          *jax.tree_util.tree_leaves((x, fixed_diff, mutable))))

    def head_vjp(b, y):
      loss, pull = jax.vjp(lambda o, y: head(o, b, y), outer_diff, y)
      return (loss,) + pull(jnp.ones_like(loss))

    def embed_vjp(b, d_x):
      _, pull = jax.vjp(lambda o: embed(o, b), outer_diff)
      return pull(d_x)[0]

    put = lambda buf, i, v, ok: jax.tree_util.tree_map(
        lambda b, a: b.at[i].set(jnp.where(ok, a, b[i])), buf, v)
    add = lambda acc, d, ok: jax.tree_util.tree_map(
        lambda a, g: a + jnp.where(ok, g, jnp.zeros_like(g)), acc, d)
    stack_of = lambda tree, n: jax.tree_util.tree_map(
        lambda a: jnp.broadcast_to(a, (n,) + a.shape), tree)

    def forward_half(t, arrived, inputs, states, mutable, outputs):
      """Forward of microbatch f = t - s (as in GPipe)."""
      f = t - s
      f_ok = (f >= 0) & (f < n_micro)
      f_at = jnp.clip(f, 0, n_micro - 1)
      x = lax.cond(s == 0, lambda: embed(outer_diff, f_at), lambda: arrived)
      x = _select(f_ok, x, fill)
      state = _at(mutable, 0)
      y, updated = forward(x, fixed_diff, state)
      inputs = put(inputs, jnp.mod(f, window), x, f_ok)
      states = put(states, jnp.mod(f, window), state, f_ok)
      mutable = jax.tree_util.tree_map(
          lambda old, new: old.at[0].set(jnp.where(f_ok, new, old[0])),
          mutable, updated)
      if step.has_aux:
        outputs = put(outputs, f_at, y, f_ok & (s == last))
      return y, inputs, states, mutable, outputs

    def backward_half(t, y, cotangent, inputs, states, grads, outer_grads,
                      loss):
      """Backward of microbatch b = t - (2S - 2 - s): on the last stage the
      one just run forward, its cotangent from the loss; elsewhere the
      cotangent the next stage sent."""
      b = t - (2 * n_stages - 2) + s
      b_ok = (b >= 0) & (b < n_micro)
      b_at = jnp.clip(b, 0, n_micro - 1)
      l_b, d_head, d_y = lax.cond(
          s == last, head_vjp,
          lambda b, y: (jnp.zeros(()), zeros(outer_diff), zeros(y)), b_at, y)
      ct = _select(s == last, d_y, cotangent)
      ct = _select(b_ok, ct, zeros(ct))
      slot = jnp.mod(b, window)
      stored = _at(states, slot)
      _, pull = jax.vjp(lambda x, p: forward(x, p, stored)[0],
                        _at(inputs, slot), fixed_diff)
      d_x, d_fixed = pull(ct)
      d_embed = lax.cond(s == 0, embed_vjp,
                         lambda b, d_x: zeros(outer_diff), b_at, d_x)
      grads = add(grads, d_fixed, b_ok)
      outer_grads = add(outer_grads, d_head, b_ok & (s == last))
      outer_grads = add(outer_grads, d_embed, b_ok & (s == 0))
      loss = loss + jnp.where(b_ok & (s == last), l_b, 0.)
      return d_x, grads, outer_grads, loss

    def iteration(carry, t, forwards, backwards):
      (arrived, cotangent, inputs, states, mutable, grads, outer_grads, loss,
       outputs) = carry
      y = d_x = _garbage(fill)
      if forwards:
        y, inputs, states, mutable, outputs = forward_half(
            t, arrived, inputs, states, mutable, outputs)
      if backwards:
        d_x, grads, outer_grads, loss = backward_half(
            t, y, cotangent, inputs, states, grads, outer_grads, loss)
      arrived = lax.ppermute(y, pipeline.axis, _neighbours(n_stages, 1))
      cotangent = lax.ppermute(d_x, pipeline.axis, _neighbours(n_stages, -1))
      return (arrived, cotangent, inputs, states, mutable, grads, outer_grads,
              loss, outputs), None

    carry = (_garbage(fill), _garbage(fill), stack_of(fill, window),
             stack_of(_at(mutable, 0), window), mutable, zeros(fixed_diff),
             zeros(outer_diff), jnp.zeros(()),
             stack_of(fill, n_micro if step.has_aux else 0))
    # In the first S - 1 iterations no stage has a backward to run, in the
    # last S - 1 none a forward: three loops (fill, steady, drain) leave
    # those halves out, so the step takes M + S - 1 forwards and as many
    # backwards of time, as GPipe's. (A lax.cond on t would do it in one
    # loop, but kept XLA:TPU from updating the gradient sums in place: a
    # copy of the stage's parameters in temp memory.)
    for start, stop, forwards, backwards in (
        (0, n_stages - 1, True, False),
        (n_stages - 1, n_micro + n_stages - 1, True, True),
        (n_micro + n_stages - 1, pipeline.iterations, False, True)):
      if stop > start:
        carry, _ = lax.scan(
            functools.partial(iteration, forwards=forwards,
                              backwards=backwards),
            carry, jnp.arange(start, stop))
    _, _, _, _, mutable, grads, outer_grads, loss, outputs = carry
    return _lead((outputs, mutable, grads, outer_grads, loss))

  spec = PartitionSpec(pipeline.axis)
  outputs, mutable, grads, outer_grads, loss = jax.shard_map(
      per_stage, mesh=mesh, in_specs=(PartitionSpec(),) * 2 + (spec,) * 4,
      out_specs=spec, axis_names={pipeline.axis}, check_vma=False)(
          batches, sg(outer), *sg(staged))
  # The gradients enter jax.grad's trace through the stack's variables (in
  # stored order: (L, ...)) and the other layers' parameters (stage 0 holds
  # those of the layers before the stack, the last stage those after).
  leaves = jax.tree_util.tree_leaves
  step.loss = _surrogate(
      loss[last],
      list(zip(_inexact(fixed)[0], leaves(_unstaged(grads)))) +
      list(zip(_inexact(outer)[0],
               [g.sum(0) for g in leaves(outer_grads)])))
  out = _join(_at(outputs, last)) if step.has_aux else _join(micro)
  return out, _unstaged(mutable)


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
