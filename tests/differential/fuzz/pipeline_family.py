"""Pipelined ``nn.Stack`` against the same stack unpipelined (8 devices).

A program is a random row-wise block (``programs.Generator``: layers that
never mix batch rows, and, in an impure block, dropout, BatchNorm, sown
intermediates and a ``state`` variable), a Dense before and after the
stack, and a random pipeline: stages ``S`` over a ``('stage', 'data')``
mesh of the 8 devices, microbatches ``M``, ``repeats``, schedule
(``gpipe``, ``1f1b``, ``zero_bubble``), ``remat_iterations``, the stack's
policy, the rows per microbatch, the batch replicated or sharded over
``'data'``, and the mesh's axis types (Auto, Explicit, or one of each);
for an impure block also ``train`` (dropout on, BatchNorm on the batch's
statistics), which of its collections the step makes mutable
and whether the pipeline declares them ``per_microbatch``. The loss is a
mean squared error; GPipe is differentiated with ``jax.value_and_grad``
and the training schedules with ``nn.pipeline.value_and_grad``, every step
with a dropout key and, with mutable collections, ``has_aux`` returning
the updated ones.

The reference is ``jax.value_and_grad`` of the unpipelined model on the
same parameters (``Pipeline.to_stack_layout``), as ``docs/pipeline.md``
promises: microbatch ``m`` (rows ``m, m + M, ...``) equals the unpipelined
model on that microbatch alone with the same rngs (its dropout keys, its
BatchNorm statistics), and a ``per_microbatch`` collection is updated once
per microbatch in microbatch order; so the reference runs the unpipelined
model on each microbatch in turn, carrying the updated collections, and
takes the mean of the losses and the gradients (a pure block, or one with
``train=False`` and nothing mutable, equals the whole batch in one step
too, which rounds otherwise). Loss, every gradient and every updated
collection, in the pipeline's layout, within float32 rounding: relative
to each array's largest entry (as ``tests/pipeline``) and, for a
gradient, an epsilon of the tree's largest per layer the backward pass
crossed (``_tolerance``), plus, where the whole batch is the same
function, twice how far its gradients are from the microbatches'
(``_reference``'s spread), and where it is not and the gradients differ,
twice how far the reference's are from float64 (``_float64_spread``: an
ill-conditioned block such as BatchNorm on two rows); integer leaves, and
the parameters taken to the pipeline's layout and back, bit for bit.

What the pipeline documents that it refuses must be refused with its
error: a mutable collection not declared ``per_microbatch``
(``PipelineError`` naming it), and variables the blocks create rather than
update (sown intermediates: ``PipelineError``, "can only update variables
that already exist"), and, for a training schedule, a batch sharded over an
Explicit ``'data'`` axis in microbatches whose rows do not divide over it
(``PipelineError``, "the rows must divide evenly"). Such a program is
``both_raise``: the reference runs, the pipeline refuses as documented.
The configurations are drawn valid but for ``REFUSED_PERCENT`` of them,
drawn among those ``nn.Pipeline`` or ``nn.Stack`` documents that it
refuses (``construction_refusal``, ``refusal``), which must raise the
``ValueError`` saying so. Any other exception, a refusal of a program the
pipeline should run, or a program run that it should refuse, is a
mismatch; a hang is a failure.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from . import programs

RTOL = 2e-5  # of each array's largest entry: float32 rounding of a longer sum
EPS = float(np.finfo(np.float32).eps)
REFUSED_PERCENT = 4  # of programs drawn as a configuration refused on purpose
MODES = ('gpipe', '1f1b', 'zero_bubble')
MICROBATCHES = (2, 1, 4, 8, 3)  # simplest first
BLOCK_FEATURES = {f: False for f in programs.FEATURES}
BLOCK_FEATURES.update({f: True for f in (
    'dense', 'dense_general', 'layer_norm', 'rms_norm', 'activation',
    'param', 'submodule', 'remat', 'dropout', 'batch_norm', 'sow',
    'variable')})
# The collections an impure block may hold besides params, in the order
# the generator's ops name them.
STATE = ('batch_stats', 'intermediates', 'state')
# The ('stage', 'data') mesh's axis types, Auto first (what a replay that
# predates the draw gets), with their weights.
AXIS_TYPES = ((('auto', 'auto'), 6), (('explicit', 'explicit'), 3),
              (('auto', 'explicit'), 1), (('explicit', 'auto'), 1))


@dataclasses.dataclass(frozen=True)
class Program:
  """A block and a pipeline configuration.

  Attributes:
    src: the block's source (classes ending with ``Block``).
    stages, microbatches, repeats: the pipeline's ``S``, ``M``, ``R``.
    per_chunk: layers per stage and repeat.
    mode: the schedule.
    remat_iterations: ``Pipeline(remat_iterations=...)``.
    policy: the stack's policy, as source.
    rows: rows per microbatch.
    sharded: the batch is sharded over ``'data'`` (where it divides).
    train: the block's ``train`` attribute (dropout, BatchNorm).
    mutable: the collections the step makes mutable.
    declared: the pipeline declares ``mutable`` as ``per_microbatch``.
    axis_types: the types of the mesh's ``('stage', 'data')`` axes.
  """
  src: str
  stages: int
  microbatches: int
  repeats: int
  per_chunk: int  # layers per stage and repeat
  mode: str
  remat_iterations: bool
  policy: str
  rows: int  # rows per microbatch
  sharded: bool
  train: bool = False
  mutable: tuple = ()
  declared: bool = False
  axis_types: tuple = ('auto', 'auto')

  @property
  def sharded_rows(self) -> bool:
    """Whether the batch is put sharded over ``'data'``: drawn so, and its
    rows divide over the axis."""
    return (self.sharded and
            self.rows * self.microbatches % (8 // self.stages) == 0)


def draw(c: programs.Chooser) -> Program:
  """A random block and pipeline: a configuration ``nn.Pipeline`` runs,
  or, ``REFUSED_PERCENT`` of the time, one it documents that it refuses."""
  gen = programs.Generator(c, BLOCK_FEATURES, max_depth=2)
  pure = not c.boolean(0.5)
  info = gen.node(c.integer(1, 2), 2, pure=pure, name='Block')
  src = '\n\n'.join(gen.classes) + '\n'
  refused = not c.boolean(1 - REFUSED_PERCENT / 100)
  config = _refused_config(c) if refused else _valid_config(c)
  prog = Program(src, **config, per_chunk=c.choice([1, 2]),
                 rows=c.choice([2, 1, 4, 3]), sharded=c.boolean(0.4))
  if not pure:
    held = [col for col in STATE if col in info.cols]
    mutable = tuple(col for col in held if c.boolean(0.5))
    prog = dataclasses.replace(prog, train=c.boolean(0.7), mutable=mutable,
                               declared=bool(mutable) and c.boolean(0.7))
  return dataclasses.replace(prog, axis_types=c.weighted(AXIS_TYPES))


def _schedulable(mode: str, stages: int, repeats: int,
                 microbatches: int) -> bool:
  """Whether ``nn.Pipeline`` accepts the schedule: a circular one
  (``repeats > 1``) needs ``microbatches >= stages``, and a trained
  circular one a multiple of ``stages``."""
  return repeats == 1 or (microbatches >= stages and (
      mode == 'gpipe' or microbatches % stages == 0))


def _valid_config(c: programs.Chooser) -> dict:
  mode = c.choice(MODES)
  stages = c.choice([2, 1, 4, 8])
  repeats = c.weighted([(1, 3), (2, 1)])
  microbatches = c.choice([m for m in MICROBATCHES
                           if _schedulable(mode, stages, repeats, m)])
  remat = mode == 'gpipe' and c.boolean(0.15)
  policy = 'None' if remat else c.choice(['None', "'full'"])
  return dict(mode=mode, stages=stages, repeats=repeats,
              microbatches=microbatches, remat_iterations=remat,
              policy=policy)


def _refused_config(c: programs.Chooser) -> dict:
  """One of the configurations ``nn.Pipeline`` or ``nn.Stack`` documents
  that it refuses (``construction_refusal``, ``refusal``)."""
  kind = c.choice(['indivisible', 'too_few', 'recomputed', 'policy'])
  config = dict(mode='gpipe', stages=c.choice([2, 4, 8]), repeats=1,
                remat_iterations=False, policy='None')
  if kind in ('indivisible', 'too_few'):
    config['repeats'] = 2
    if kind == 'indivisible':
      config['mode'] = c.choice(MODES[1:])
    config['microbatches'] = c.choice([
        m for m in MICROBATCHES
        if not _schedulable(config['mode'], config['stages'], 2, m)])
    return config
  config['microbatches'] = c.choice(MICROBATCHES)
  config['remat_iterations'] = True
  if kind == 'recomputed':
    config['mode'] = c.choice(MODES[1:])
  else:
    config['policy'] = "'full'"
  return config


def _model(nn, block, length, policy, pipeline, train):

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(programs.F)(x)
      given = {'train': True} if train else {}  # (a block may lack it)
      x = nn.Stack(block, length, policy=policy, pipeline=pipeline)(
          name='blocks', **given)(x)
      return nn.Dense(2)(x)

  return Model()


def _relayout(tree, move):
  """``tree`` with the stack's variables moved (a block may have none)."""
  if 'blocks' not in tree:
    return tree
  return {**tree, 'blocks': move(dict(tree['blocks']))}


def _relayout_all(collections, move):
  return {col: _relayout(dict(tree), move)
          for col, tree in collections.items()}


def construction_refusal(prog: Program) -> str:
  """A regex of the ``ValueError`` ``nn.Pipeline(...)`` must raise for
  ``prog``'s configuration, or '' when it must accept it: a circular
  schedule with fewer microbatches than stages, or a trained one whose
  microbatches are not a multiple of them; ``remat_iterations`` with a
  trained schedule."""
  found = []
  if not _schedulable(prog.mode, prog.stages, prog.repeats,
                      prog.microbatches):
    found += ['microbatches must be a multiple of stages',
              'needs at least as many microbatches as stages']
  if prog.mode != 'gpipe' and prog.remat_iterations:
    found.append('already recomputes each stage')
  return '|'.join(found)


def refusal(prog: Program) -> str:
  """A regex of the documented error the pipeline must raise for
  ``prog``, or '' when it must run: a stack policy with
  ``remat_iterations``; a mutable collection not declared
  ``per_microbatch``; sown intermediates (created, not updated); a
  training schedule's microbatches whose rows do not divide over the
  Explicit axis the batch is sharded on. With several, the pipeline may
  name any of them first."""
  if prog.policy != 'None' and prog.remat_iterations:
    return 'a stack policy on top would recompute every layer twice'
  found = []
  if (prog.mode != 'gpipe' and prog.axis_types[1] == 'explicit' and
      prog.sharded_rows and prog.rows % (8 // prog.stages)):
    found.append('the rows must divide evenly')
  if set(prog.mutable) - {'intermediates'} and not prog.declared:
    found.append("collection '[a-z_]+' is mutable")
  if 'intermediates' in prog.mutable:
    found.append('can only update variables that already exist')
  return '|'.join(found)


def _loss_of(model, prog):
  """The step's loss: ``(p, state, x, y) -> loss`` (``(loss, updated)``
  with mutable collections)."""
  rngs = {'dropout': jax.random.key(3)}

  def loss_fn(p, state, x, y):
    out = model.apply({'params': p, **state}, x, rngs=rngs,
                      mutable=list(prog.mutable) or False)
    if not prog.mutable:
      return jnp.mean((out - y) ** 2)
    out, updated = out
    return jnp.mean((out - y) ** 2), updated

  return loss_fn


def _reference(plain, state, prog, params, x, y):
  """``(loss, grads, updated, spread)`` of the unpipelined model run
  microbatch by microbatch, which the pipeline equals (module docstring).

  ``spread`` is ``None``, or, where the whole batch in one step is the same
  function (no ``train``, nothing mutable), how far each gradient of that
  step is from the microbatches' mean: float32 rounding of one sum in two
  orders, which an ill-conditioned block makes far larger than an epsilon
  (an RMSNorm of rows near zero: seed 13041, 4.8e-5 beside 0.4)."""
  has_aux = bool(prog.mutable)
  step = jax.jit(jax.value_and_grad(_loss_of(plain, prog), has_aux=has_aux))
  m = prog.microbatches
  total, grads, updated = 0., None, {}
  for i in range(m):
    loss, g = step(params, state, x[i::m], y[i::m])
    if has_aux:
      loss, updated = loss
      state = {**state, **updated}
    total = total + loss / m
    g = jax.tree_util.tree_map(lambda a: a / m, g)
    grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
  spread = None
  if not (prog.train or prog.mutable):
    spread = jax.tree_util.tree_map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max(
            initial=0)), grads, step(params, state, x, y)[1])
  return total, grads, updated, spread


def _tolerance(own: float, largest: float, depth: int) -> float:
  """How far an array whose largest entry is ``own`` may be from its
  reference: float32 rounding of its own sums, and, for a gradient that
  crossed ``depth`` layers, of the cotangents it came through, which are as
  large as the tree's ``largest`` however small the gradient ends up (a
  Dense before 16 layers takes a gradient of 1e-3 beside ones of 2.0)."""
  return RTOL * max(own, 1e-3) + EPS * depth * largest


def _close(got, want, depth: int = 0, spread=None) -> str:
  """'' when ``got`` equals ``want`` to float32 rounding (``_tolerance``;
  ``depth`` 0 for what no backward pass computed; plus twice the
  ``spread`` of each array, a tree of floats, when given), integers
  exactly; else what differs."""
  flat = jax.tree_util.tree_flatten_with_path(want)[0]
  leaves = jax.tree_util.tree_leaves(got)
  if len(leaves) != len(flat):
    return 'trees differ'
  slack = (jax.tree_util.tree_leaves(spread) if spread is not None
           else [0.] * len(flat))
  largest = max([float(np.abs(r).max(initial=0)) for _, r in flat
                 if np.issubdtype(np.asarray(r).dtype, np.floating)] + [0.])
  for (path, r), g, more in zip(flat, leaves, slack):
    r, g = np.asarray(r), np.asarray(g)
    if r.shape != g.shape or r.dtype != g.dtype:
      return (f'{jax.tree_util.keystr(path)} is {g.dtype}{g.shape}, '
              f'expected {r.dtype}{r.shape}')
    if not np.issubdtype(r.dtype, np.floating):
      if not np.array_equal(g, r):
        return f'{jax.tree_util.keystr(path)} differs (exact)'
      continue
    off = np.abs(g - r).max(initial=0)
    if not np.isfinite(g).all() or off > _tolerance(
        np.abs(r).max(initial=0), largest, depth) + 2 * more:
      return f'{jax.tree_util.keystr(path)} differs by {off:.3g}'
  return ''


def _construct(nn, prog: Program) -> tuple:
  """``(pipeline, None)``, or ``(None, verdict)`` when the constructor
  refused: ``both_raise`` for a documented refusal
  (``construction_refusal``), else a mismatch; accepting a configuration
  it documents that it refuses is a mismatch too."""
  expected = construction_refusal(prog)
  try:
    pipe = nn.Pipeline(stages=prog.stages, microbatches=prog.microbatches,
                       repeats=prog.repeats, mode=prog.mode,
                       remat_iterations=prog.remat_iterations,
                       per_microbatch=prog.mutable if prog.declared else ())
  except ValueError as e:
    found = re.search(expected, str(e)) if expected else None
    if found:
      return None, ('both_raise', f'ValueError: ...{found.group(0)}')
    return None, ('mismatch', f'nn.Pipeline refused a configuration it '
                              f'documents as valid: {e}')
  if expected:
    return None, ('mismatch', f'nn.Pipeline accepted a configuration it '
                              f'documents that it refuses: {expected}')
  return pipe, None


def _layout_round_trip(pipe, params) -> str:
  """'' when the stack's parameters survive the pipeline's layout and back
  bit for bit, else what changed."""
  back = _relayout(_relayout(params, pipe.to_pipeline_layout),
                   pipe.to_stack_layout)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, a), b in zip(flat, jax.tree_util.tree_leaves(back)):
    if not np.array_equal(np.asarray(a), np.asarray(b)):
      return f'{jax.tree_util.keystr(path)} changed by the layout round trip'
  return ''


def check(prog: Program) -> tuple:
  """The pipelined step against the unpipelined one (module docstring)."""
  import liftmods as nn  # pylint: disable=g-import-not-at-top
  pipe, refused = _construct(nn, prog)
  if refused:
    return refused
  block = programs.build(prog.src.replace('class Block', 'class Model'), nn)
  length = prog.stages * prog.repeats * prog.per_chunk
  policy = eval(prog.policy)  # pylint: disable=eval-used
  kinds = {'auto': AxisType.Auto, 'explicit': AxisType.Explicit}
  mesh = jax.make_mesh((prog.stages, 8 // prog.stages), ('stage', 'data'),
                       axis_types=tuple(kinds[t] for t in prog.axis_types))
  rows = prog.rows * prog.microbatches
  x = jax.random.normal(jax.random.key(1), (rows, programs.F))
  y = jax.random.normal(jax.random.key(2), (rows, 2))
  plain = _model(nn, block, length, policy, None, prog.train)
  variables = dict(plain.init({'params': jax.random.key(0),
                               'dropout': jax.random.key(4)}, x))
  params = variables.pop('params')
  variables.pop('intermediates', None)  # sown by init; the step sows anew
  try:
    reference = _reference(plain, variables, prog, params, x, y)
    ref_error = None
  except Exception as e:  # pylint: disable=broad-except
    reference, ref_error = None, e  # (BatchNorm on batch statistics, ...)
  expected = refusal(prog)
  model = _model(nn, block, length, policy, pipe, prog.train)
  p = _relayout(params, pipe.to_pipeline_layout)
  state = _relayout_all(variables, pipe.to_pipeline_layout)
  grad_fn = (jax.value_and_grad if prog.mode == 'gpipe' else
             nn.pipeline.value_and_grad)
  try:
    with jax.set_mesh(mesh):
      if prog.sharded_rows:
        x = jax.device_put(x, NamedSharding(mesh, P('data')))
        y = jax.device_put(y, NamedSharding(mesh, P('data')))
      loss_fn = _loss_of(model, prog)
      got = jax.jit(grad_fn(
          lambda p, x, y: loss_fn(p, state, x, y),
          has_aux=bool(prog.mutable)))(p, x, y)
  except Exception as e:  # pylint: disable=broad-except
    said = f'{type(e).__name__}: {str(e)[:80]}'
    if ref_error is not None and type(e) is type(ref_error):
      return 'both_raise', said
    if (ref_error is None and expected and isinstance(e, ValueError) and
        re.search(expected, str(e))):
      return 'both_raise', said
    return 'mismatch', (f'the pipeline raised {type(e).__name__}: {e}\n'
                        f'unpipelined: {ref_error!r}; documented: '
                        f'{expected!r}')
  if ref_error is not None:
    return 'mismatch', f'ran, but the unpipelined model raised {ref_error!r}'
  if expected:
    return 'mismatch', f'ran, but the pipeline documents: {expected}'
  differs = (_layout_round_trip(pipe, params) or
             _compare(prog, pipe, got, reference, length))
  if (differs.startswith('gradient') and (prog.train or prog.mutable) and
      'Dropout' not in prog.src):
    spread = _float64_spread(plain, variables, prog, params, x, y,
                             reference[1])
    differs = _compare(prog, pipe, got, (*reference[:3], spread), length)
  return ('mismatch', differs) if differs else ('ok', '')


def _float64_spread(plain, state, prog, params, x, y, grads):
  """How far each float32 gradient of the unpipelined reference is from
  the same run in float64: in an ill-conditioned block float32 rounding
  alone moves a gradient that far, and the pipeline's may be as far off.
  BatchNorm on two rows (seed 119013): the input gradient is a difference
  of nearly equal terms, and the bias of the Dense before it, zero in
  exact arithmetic, came out 1.3e-5 in one order and 1.85e-5 away in the
  other. Not for dropout, whose masks float64 would draw anew."""
  def wide(tree):
    return jax.tree_util.tree_map(
        lambda a: (np.asarray(a, np.float64)
                   if np.issubdtype(np.asarray(a).dtype, np.floating) else a),
        tree)

  with jax.enable_x64(True):
    exact = _reference(plain, wide(state), prog, wide(params), wide(x),
                       wide(y))[1]
  return jax.tree_util.tree_map(
      lambda a, b: float(np.abs(np.asarray(a, np.float64) -
                                np.asarray(b)).max(initial=0)),
      grads, exact)


def _compare(prog, pipe, got, reference, length: int) -> str:
  """'' when the pipelined step's ``got`` (``value_and_grad``'s) equals
  the unpipelined ``reference`` (``_reference``'s), else what differs."""
  (loss, grads), (ref_loss, ref_grads, ref_updated, spread) = got, reference
  updated = {}
  if prog.mutable:
    loss, updated = loss
    updated = _relayout_all(updated, pipe.to_stack_layout)
  grads = _relayout(grads, pipe.to_stack_layout)
  if not np.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
    return f'loss {float(loss)} vs unpipelined {float(ref_loss)}'
  # The backward pass crosses the stack's layers and the Dense on each side.
  differs = _close(grads, ref_grads, depth=length + 2, spread=spread)
  if differs:
    return f'gradient {differs}'
  differs = _close(updated, ref_updated)
  return f'updated collection {differs}' if differs else ''
