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
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from liftmods import call_context, errors, spmd
from liftmods.call_context import split_arrays
from liftmods.core import explicit, pipeline_loop


MODES = ('gpipe', '1f1b', 'zero_bubble')
TRAINED = ('1f1b', 'zero_bubble')  # the loops that compute the gradients


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
      after it), ``'1f1b'`` or ``'zero_bubble'``. Under
      :func:`value_and_grad` ``'1f1b'`` runs each iteration one
      microbatch's forward and another's backward, so a stage holds a
      number of microbatch inputs that does not grow with ``M``; with
      ``repeats=v > 1`` it is interleaved 1F1B (``v`` chunks per stage,
      the circular layer layout; needs ``M`` divisible by ``S``).
      ``'zero_bubble'`` (ZB-H1) splits each backward into the input
      gradient and the weight gradient and runs the latter later, in slots
      1F1B leaves idle. Outside :func:`value_and_grad` (evaluation) these
      stacks run the GPipe (circular) forward loop. See :meth:`table`.
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
    if self.mode not in MODES:
      raise ValueError(f'Pipeline.mode must be one of '
                       f"{', '.join(map(repr, MODES))}; got {self.mode!r}.")
    if (self.mode in TRAINED and self.repeats > 1 and
        self.microbatches % self.stages):
      raise ValueError(
          f'Pipeline: interleaved mode={self.mode!r} (repeats={self.repeats}) '
          'sends microbatches through the chunks in groups of stages, so '
          'microbatches must be a multiple of stages; got microbatches='
          f'{self.microbatches}, stages={self.stages}. Use microbatches='
          f'{-(-self.microbatches // self.stages) * self.stages}, or '
          'repeats=1.')
    if self.repeats > 1 and self.microbatches < self.stages:
      raise ValueError(
          f'Pipeline: the circular schedule (repeats={self.repeats}) needs '
          f'at least as many microbatches as stages; got microbatches='
          f'{self.microbatches} < stages={self.stages}.')
    if self.mode in TRAINED and self.remat_iterations:
      raise ValueError(
          f'Pipeline: mode={self.mode!r} already recomputes each stage from '
          'its stored input in the backward pass; remat_iterations applies '
          "to mode='gpipe' only.")
    names = self.per_microbatch
    object.__setattr__(self, 'per_microbatch',
                       (names,) if isinstance(names, str) else tuple(names))

  @property
  def split_backward(self) -> bool:
    """Whether the training loop splits each backward into an input- and
    a weight-gradient slot (``'zero_bubble'``)."""
    return self.mode == 'zero_bubble'

  def table(self) -> pipeline_loop.Table:
    """The training loop's schedule (``'1f1b'``, ``'zero_bubble'``), the
    table the loop itself reads: per iteration and stage, which chunk and
    microbatch each kind of slot (F, B, W) runs."""
    if self.mode not in TRAINED:
      raise ValueError(f"table: mode={self.mode!r} trains with jax.grad's "
                       'loop, not a schedule table; see schedule().')
    return pipeline_loop.training_table(self.stages, self.microbatches,
                                        self.repeats, self.split_backward)

  @property
  def iterations(self) -> int:
    """The length of the loop over iterations: ``M·R + S − 1`` (GPipe,
    circular; each iteration a forward, ``jax.grad`` adds as many backward
    iterations), ``M·v + v·S + S − 2`` for ``'1f1b'`` and
    ``'zero_bubble'`` (``v = repeats``; the first and last run only some
    kinds of slot, see :meth:`table`)."""
    if self.mode in TRAINED:
      return self.microbatches * self.repeats + (
          self.repeats + 1) * self.stages - 2
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    """The share of idle slot time, each forward, input-gradient and
    weight-gradient slot costing the same. GPipe, circular, 1F1B and
    interleaved 1F1B: ``(S − 1) / (M·R + S − 1)`` (the training loops
    leave out the halves no stage uses, so each stage runs ``M·v + S − 1``
    forward and as many backward slots, ``S − 1`` of each idle).
    ``'zero_bubble'``: ``2(S − 1) / (3M·R + 2(S − 1))``: the weight
    gradients fill every W slot, and only the forward and input-gradient
    slots keep their ``S − 1`` idle each (``Table.idle_fraction`` measures
    it on the table).

    >>> Pipeline(4, 8, mode='zero_bubble').bubble_fraction
    0.2
    """
    s, work = self.stages, self.microbatches * self.repeats
    if self.split_backward:
      return 2 * (s - 1) / (3 * work + 2 * (s - 1))
    return (s - 1) / (work + s - 1)

  def _items(self, kind):
    kind = self.table().kinds[kind]
    return np.where(kind['ok'] == 1,
                    kind['repeat'] * self.microbatches + kind['micro'], -1)

  def schedule(self) -> np.ndarray:
    """``(iterations, stages)`` work items: ``j = r·M + m`` (repeat ``r``,
    microbatch ``m``) that stage ``s`` runs forward at iteration ``t``, or
    -1."""
    if self.mode in TRAINED:
      return self._items('F')
    t = np.arange(self.iterations)[:, None]
    j = t - np.arange(self.stages)[None, :]
    return np.where((j >= 0) & (j < self.microbatches * self.repeats), j, -1)

  def backward_schedule(self) -> np.ndarray:
    """For ``'1f1b'`` and ``'zero_bubble'``: the ``(iterations, stages)``
    work items ``r·M + m`` whose backward pass (input gradient, for
    ``'zero_bubble'``) stage ``s`` runs at iteration ``t``, or -1. The
    last stage runs the last chunk's backward in the iteration of its
    forward, and each cotangent takes one iteration per stage back.

    >>> p = Pipeline(stages=2, microbatches=3, mode='1f1b')
    >>> p.schedule().T.tolist(), p.backward_schedule().T.tolist()
    ([[0, 1, 2, -1, -1], [-1, 0, 1, 2, -1]], [[-1, -1, 0, 1, 2], \
[-1, 0, 1, 2, -1]])
    """
    if self.mode not in TRAINED:
      raise ValueError("backward_schedule: the backward pass of mode="
                       f"{self.mode!r} is jax.grad's loop, not a schedule.")
    return self._items('B')

  def weight_schedule(self) -> np.ndarray:
    """For ``'zero_bubble'``: the work items whose weight gradient stage
    ``s`` runs at iteration ``t``, or -1."""
    if not self.split_backward:
      raise ValueError('weight_schedule: only mode=\'zero_bubble\' splits '
                       'the weight gradient from the backward.')
    return self._items('W')

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

    def reorder(a):
      if explicit.explicit_mesh(a) is None or not any(explicit.spec_of(a)):
        return move(a)
      # On Explicit axes (a pipelined stack's gradients split over the stage
      # axis) JAX cannot type the reshapes: the reordered array is laid out
      # as the given one, the compiler moving the layers.
      return explicit.as_first('Pipeline', 'a change of layer order', move,
                               a)

    return jax.tree_util.tree_map(reorder, tree)

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


@dataclasses.dataclass(frozen=True)
class _StackErrors:
  """The pipeline loops' errors (``pipeline_loop.Explain``), worded for the
  stack at ``path``."""
  path: str
  mode: str = 'gpipe'

  def batch(self, shape, microbatches):
    return PipelineError(
        f'Stack at {self.path}: the batch (leading axis of the carry) must '
        f'be divisible by microbatches={microbatches}; got a carry of shape '
        f'{shape}.')

  def mutable(self, collection):
    return PipelineError(
        f'Stack at {self.path}: collection {collection!r} is mutable, and a '
        'pipelined stack runs each layer once per microbatch, so it would be '
        'updated microbatch by microbatch rather than once on the whole '
        'batch (BatchNorm statistics, for one, would differ from the '
        "unpipelined stack's). If one update per microbatch is what the "
        f'block means (a counter), declare Pipeline(per_microbatch='
        f"({collection!r},)); otherwise do not make it mutable here.")

  def wrote(self, updated, held):
    new = _leaf_paths(updated) - _leaf_paths(held)
    cols = sorted({path.split("'")[1] for path in new if "'" in path})
    what = (f'created {", ".join(sorted(new))}, which the stack does not '
            'hold' if new else f'wrote variables shaped {updated}, but the '
            f'stack holds {held}')
    return PipelineError(
        f'Stack at {self.path}: the blocks {what}; a pipelined stack runs '
        'each layer once per microbatch and can only update variables that '
        'already exist (create them in init). Sown intermediates cannot be '
        'collected from a pipelined stack: do not make '
        f'{", ".join(map(repr, cols)) or "that collection"} mutable here.')

  def argument(self, shape, microbatches):
    return PipelineError(
        f'pipeline.value_and_grad: every array argument of loss_fn after '
        f'params is split into microbatches=M={microbatches} along its '
        f'leading (batch) axis; got one of shape {shape}. Declare arguments '
        'without a batch axis in shared_argnums.')

  def not_in_params(self):
    return PipelineError(
        f"Stack at {self.path}: pipeline.value_and_grad cannot find the "
        "stack's variables in the params given to loss_fn; loss_fn must "
        'pass them to model.apply unchanged.')

  def uneven_microbatch(self, rows, axes, devices):
    return PipelineError(
        f'Stack at {self.path}: Pipeline(mode={self.mode!r}) gives each '
        f'microbatch {rows} rows of a batch sharded over {", ".join(map(repr, axes))} '
        f'({devices} devices); the rows must divide evenly over them, or '
        "XLA's compiled training loop waits forever on its collectives. "
        f'Choose microbatches so that batch/microbatches is a multiple of '
        f'{devices}.')

  def input_shape(self, got, want):
    return PipelineError(
        f'Stack at {self.path}: on one microbatch, loss_fn gave the stack an '
        f"input of shape {got}, not the microbatch's {want}: pass the batch "
        'to loss_fn as an argument (after params), not in a closure, so '
        'that pipeline.value_and_grad can split it.')


def _leaf_paths(treedef) -> set:
  """The paths of a tree structure's leaves, without the scope index the
  stack puts first (``['intermediates']['h1'][0]``)."""
  tree = treedef.unflatten([0] * treedef.num_leaves)
  return {jax.tree_util.keystr(path[1:])
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def run_schedule(pipeline: Pipeline, layer, policy, c, stacked, keys,
                 per_layer, *, is_mutable, length: int, path: str):
  """Runs ``L`` layers on the carry ``c`` with the pipeline's schedule
  (``core.pipeline_loop.run_pipeline``; see there for the arguments) and
  returns ``(c, mutable collections)``, the latter stage-major.

  A ``'1f1b'`` pipeline inside :func:`value_and_grad` runs the
  one-forward-one-backward loop, and hands its surrogate loss to that
  call; anywhere else every schedule runs the forward loop.
  """
  pipeline.layers_per_stage(length, path)
  mesh = pipeline.resolve_mesh(path)
  step = _training.context if pipeline.mode in TRAINED else None
  if step is not None:
    if step.path not in (None, path):
      raise PipelineError(
          f"pipeline.value_and_grad: loss_fn calls two stacks with Pipeline("
          f"mode={pipeline.mode!r}), at {step.path} and {path}; it runs "
          'exactly one.')
    step.path = path
  c, mutable, loss = pipeline_loop.run_pipeline(
      pipeline, mesh, layer, policy, c, stacked, keys, per_layer,
      length=length, is_mutable=is_mutable,
      explain=_StackErrors(path, pipeline.mode),
      training=step)
  if step is not None:
    step.loss = loss
  return c, mutable


# -- one forward, one backward ------------------------------------------------


class _Training(threading.local):
  context: Any = None      # the _TrainStep of value_and_grad, while it runs
  substitute: Any = None   # the stack output a microbatch's loss receives


_training = _Training()


@dataclasses.dataclass
class _TrainStep:
  """One call of :func:`value_and_grad`'s loss: what the 1F1B loop needs
  (a ``pipeline_loop.Training``), and the loss it hands back."""
  loss_fn: Any
  has_aux: bool
  params: Any
  args: tuple
  shared: frozenset
  loss: Any = None
  path: Any = None

  def __post_init__(self):
    self.arrays, self._rebuild_args = split_arrays(self.args)
    self.batched = [jnp.ndim(a) > 0 and i + 1 not in self.shared
                    for i, arg in enumerate(self.args)
                    for a in split_arrays(arg)[0]]

  def call(self, params, arrays, given):
    """``loss_fn`` on ``arrays``, the stack answered by ``given``."""
    saved, _training.substitute = _training.substitute, given
    try:
      return self.loss_fn(params, *self._rebuild_args(list(arrays)))
    finally:
      _training.substitute = saved


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
            "Pipeline(mode='1f1b') (or 'zero_bubble'); for other stacks "
            'use jax.value_and_grad.')
      return (step.loss, out[1]) if has_aux else step.loss

    return jax.value_and_grad(total, has_aux=has_aux)(params)

  return fn


def substituted(pipeline: Pipeline, path: Sequence[str], x):
  """Inside the 1F1B loop's call of ``loss_fn`` on one microbatch: the
  stack output the loop computed for it (the stack at ``path`` returns it
  without running); otherwise None."""
  y = _training.substitute
  if y is None or pipeline.mode not in TRAINED:
    return None
  if isinstance(y, pipeline_loop.Capture):
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
