"""Pipelined ``nn.Stack`` against the same stack unpipelined (8 devices).

A program is a random row-wise block (``programs.Generator``: layers that
never mix batch rows), a Dense before and after the stack, and a random
pipeline: stages ``S`` over a ``('stage', 'data')`` mesh of the 8 devices,
microbatches ``M``, ``repeats``, schedule (``gpipe``, ``1f1b``,
``zero_bubble``), ``remat_iterations``, the stack's policy, the rows per
microbatch, and the batch replicated or sharded over ``'data'``. The loss
is a mean squared error; GPipe is differentiated with ``jax.value_and_grad``
and the training schedules with ``nn.pipeline.value_and_grad``. The
reference is ``jax.value_and_grad`` of the unpipelined model on the same
parameters (``Pipeline.to_stack_layout``): loss, and every gradient in the
pipeline's layout, within float32 rounding (relative to each array's
largest entry, as ``tests/pipeline``). A configuration the pipeline cannot
run must raise ``ValueError`` (``PipelineError`` is one) at construction
or call; a hang is a failure.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from . import programs

RTOL = 2e-5  # of each array's largest entry: float32 rounding of a longer sum
BLOCK_FEATURES = {f: False for f in programs.FEATURES}
BLOCK_FEATURES.update({f: True for f in (
    'dense', 'dense_general', 'layer_norm', 'rms_norm', 'activation',
    'param', 'submodule', 'remat')})


@dataclasses.dataclass(frozen=True)
class Program:
  """A block and a pipeline configuration."""
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


def draw(c: programs.Chooser) -> Program:
  """A random block and pipeline (valid or not)."""
  gen = programs.Generator(c, BLOCK_FEATURES, max_depth=2)
  gen.node(c.integer(1, 2), 2, pure=True, name='Block')
  mode = c.choice(['gpipe', '1f1b', 'zero_bubble'])
  return Program('\n\n'.join(gen.classes) + '\n',
                 stages=c.choice([2, 1, 4, 8]),
                 microbatches=c.choice([2, 1, 4, 8, 3]),
                 repeats=c.weighted([(1, 3), (2, 1)]),
                 per_chunk=c.choice([1, 2]), mode=mode,
                 remat_iterations=c.boolean(0.15),
                 policy=c.choice(['None', "'full'"]),
                 rows=c.choice([2, 1, 4, 3]), sharded=c.boolean(0.4))


def _model(nn, block, length, policy, pipeline):

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(programs.F)(x)
      x = nn.Stack(block, length, policy=policy, pipeline=pipeline)(
          name='blocks')(x)
      return nn.Dense(2)(x)

  return Model()


def _relayout(tree, move):
  """``tree`` with the stack's variables moved (a block may have none)."""
  if 'blocks' not in tree:
    return tree
  return {**tree, 'blocks': move(dict(tree['blocks']))}


def check(prog: Program) -> tuple:
  """The pipelined step against the unpipelined one (module docstring)."""
  import liftmods as nn  # pylint: disable=g-import-not-at-top
  block = programs.build(prog.src.replace('class Block', 'class Model'), nn)
  length = prog.stages * prog.repeats * prog.per_chunk
  policy = eval(prog.policy)  # pylint: disable=eval-used
  mesh = jax.make_mesh((prog.stages, 8 // prog.stages), ('stage', 'data'),
                       axis_types=(AxisType.Auto,) * 2)
  rows = prog.rows * prog.microbatches
  x = jax.random.normal(jax.random.key(1), (rows, programs.F))
  y = jax.random.normal(jax.random.key(2), (rows, 2))
  plain = _model(nn, block, length, policy, None)
  params = plain.init(jax.random.key(0), x)['params']

  def loss_of(model):
    return lambda p, x, y: jnp.mean((model.apply({'params': p}, x) - y) ** 2)

  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_of(plain)))(
      params, x, y)
  try:
    pipe = nn.Pipeline(stages=prog.stages, microbatches=prog.microbatches,
                       repeats=prog.repeats, mode=prog.mode,
                       remat_iterations=prog.remat_iterations)
    model = _model(nn, block, length, policy, pipe)
    p = _relayout(params, pipe.to_pipeline_layout)
    grad_fn = (jax.value_and_grad if prog.mode == 'gpipe' else
               nn.pipeline.value_and_grad)
    with jax.set_mesh(mesh):
      if prog.sharded and rows % (8 // prog.stages) == 0:
        x = jax.device_put(x, NamedSharding(mesh, P('data')))
        y = jax.device_put(y, NamedSharding(mesh, P('data')))
      loss, grads = jax.jit(grad_fn(loss_of(model)))(p, x, y)
  except ValueError as e:
    return 'both_raise', f'{type(e).__name__}: {str(e)[:80]}'
  grads = _relayout(grads, pipe.to_stack_layout)
  if not np.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
    return 'mismatch', f'loss {float(loss)} vs unpipelined {float(ref_loss)}'
  flat = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
  got = jax.tree_util.tree_leaves(grads)
  if len(got) != len(flat):
    return 'mismatch', 'gradient trees differ'
  for (path, r), g in zip(flat, got):
    r, g = np.asarray(r), np.asarray(g)
    if r.shape != g.shape or not np.isfinite(g).all() or (
        np.abs(g - r).max(initial=0) > RTOL * max(np.abs(r).max(initial=0),
                                                  1e-3)):
      return 'mismatch', (f'gradient {jax.tree_util.keystr(path)} differs '
                          f'by {np.abs(g - r).max(initial=0):.3g}')
  return 'ok', ''
