"""Pipelined ``nn.Stack``: bubble, per-device memory, trace and compile time.

Runs on 8 simulated CPU devices (set before JAX starts)::

  python -m benchmarks.pipeline                  # all sections
  python -m benchmarks.pipeline --sections=bubble,memory

- ``bubble``: for each (S, M, R) the iterations the compiled schedule runs
  (read from the program: the length of its loop) and the idle
  stage-iterations (``S x iterations`` minus the stage-iterations that did
  work, counted by a counter every layer increments once per microbatch it
  runs), against the schedule's theory ``(S - 1) / (M·R + S - 1)``.
- ``memory``: per-device bytes of parameters, Adam state and the train
  step's temporaries (XLA's memory analysis) by S, M, R and policy, next to
  the unpipelined stack on one device.
- ``placement``: per-device parameter bytes from ``nn.init_sharded`` of a
  pipelined stack whose block annotates its kernel and bias, its kernel
  only, or nothing; next to the bytes the annotations alone would give.
- ``compile``: trace+lower and compile seconds of the train step, pipelined
  and unpipelined, for growing L (both loop over layers: flat in L).
- ``tpu`` (with ``--topology``, ``benchmarks/aot.py``): the train step
  compiled for a TPU slice, the unpipelined stack data-parallel over every
  chip next to pipelined ones over a ``('stage', 'data')`` mesh: per-chip
  memory and XLA's *estimated* step seconds (the compiler's cost model, not
  a measurement). With ``--num_slices=N`` the stages span the slices (the
  unpipelined row's data axis does) and each row also gives its bytes per
  step over DCN and ICI (``benchmarks/traffic.py``)::

    python -m benchmarks.pipeline --sections=tpu --topology=v5e:4x4 \
        --hidden=2048 --layers=32 --batch=512
    python -m benchmarks.pipeline --sections=tpu --topology=v5e:2x2 \
        --num_slices=2 --tpu_row=2,8,1

- ``figures``: per schedule (GPipe, circular, 1F1B, interleaved 1F1B,
  zero-bubble) and M: the idle fraction measured (slots read from the
  traced program, work counted by the layers) against the formula, the
  train step's temp MiB, compile seconds, step time and the largest
  gradient difference from the unpipelined model.
- ``pictures``: ``docs/img/pipeline_<schedule>.png``, a timeline per stage
  of each schedule drawn from :func:`timeline` (for the training loops
  the table the loop reads, ``Pipeline.table()``).

No MaxText figure is quoted: its pipeline uses the same iteration count
``M·R + S - 1`` for its GPipe/circular schedule, so the ``bubble`` rows are
what that formula gives for the same S, M, R.
"""
import os
import sys

if __name__ == '__main__':
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8')

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import math
import statistics
import time

from absl import app, flags
import jax
import jax.extend
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import numpy as np

import liftmods as nn
from benchmarks import aot
from liftmods import sharded_init

flags.DEFINE_list('sections', ['bubble', 'memory', 'compile'],
                  'which sections to run')
flags.DEFINE_integer('hidden', 256, 'block width')
flags.DEFINE_integer('batch', 64, 'global batch')
flags.DEFINE_integer('layers', 16, 'layers L for the memory section')
flags.DEFINE_integer('memory_rows', 6, 'pipelined rows per policy')
flags.DEFINE_list('compile_layers', ['8', '32', '128'],
                  'L values for the compile section')
flags.DEFINE_integer('compile_repeats', 3, 'fresh traces/compiles per row '
                     '(median)')
flags.DEFINE_integer('micro_rows', 8, 'rows per microbatch (schedules)')
flags.DEFINE_list('schedule_micro', ['4', '8', '16', '32', '64'],
                  'M values for the schedules section')
flags.DEFINE_list('schedule_names', ['gpipe', 'gpipe remat_iterations',
                                     '1f1b'],
                  'rows of the schedules and tpu_schedules sections')
flags.DEFINE_list('time_micro', ['8', '32'],
                  'M values for the schedule_time section')
flags.DEFINE_multi_string(
    'tpu_row', ['4,8,1', '4,16,1', '4,8,2'],
    'S,M,R of a pipelined row of the tpu section (repeatable)')
FLAGS = flags.FLAGS


class Block(nn.Module):
  """An MLP residual block; ``count=True`` counts the microbatches it runs
  on in the ``'counts'`` collection."""
  hidden: int
  count: bool = False

  @nn.compact
  def __call__(self, x):
    if self.count:
      calls = self.variable('counts', 'calls',
                            lambda: jnp.zeros((), jnp.int32))
      calls.value += 1
    h = nn.gelu(nn.Dense(2 * self.hidden)(nn.LayerNorm()(x)))
    return x + nn.Dense(self.hidden)(h)


def stage_mesh(stages):
  return jax.make_mesh((stages,), ('stage',), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:stages])


def loop_lengths(jaxpr, out):
  """Lengths of every scan in a (closed) jaxpr, innermost last."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'scan':
      out.append(eqn.params['length'])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      loop_lengths(sub, out)
  return out


def permutes(jaxpr):
  """Whether ``jaxpr`` (or one inside it) sends to the next stage."""
  return any(eqn.primitive.name == 'ppermute' or any(
      permutes(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
             for eqn in jaxpr.eqns)


def schedule_loop(jaxpr):
  """The iterations the first shard_map runs: the lengths of the loops at
  the top of its body that permute (the schedule's; a loop over layers
  does not)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'shard_map':
      return sum(e.params['length'] for e in eqn.params['jaxpr'].eqns
                 if e.primitive.name == 'scan' and permutes(
                     e.params['jaxpr'].jaxpr))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found = schedule_loop(sub)
      if found:
        return found
  return 0


def bubble():
  print('\nBubble: iterations and idle stage-iterations (measured) vs '
        '(S-1)/(M*R+S-1)')
  print(f'  {"S":>2} {"M":>3} {"R":>2} {"iterations":>10} {"theory":>7} '
        f'{"idle":>5} {"of":>5} {"idle frac":>10} {"theory":>8}')
  hidden = 16
  for stages, micro, repeats in [(2, 2, 1), (2, 4, 1), (2, 8, 1), (2, 4, 2),
                                 (4, 4, 1), (4, 8, 1), (4, 16, 1), (4, 4, 2),
                                 (4, 8, 2), (8, 8, 1), (8, 16, 2)]:
    pipe = nn.Pipeline(stages=stages, microbatches=micro, repeats=repeats,
                       per_microbatch=('counts',))
    length = 2 * stages * repeats
    stack = nn.Stack(Block, length, pipeline=pipe)(hidden, count=True)
    x = jnp.ones((2 * micro, hidden))
    variables = stack.init(jax.random.key(0), x)
    fn = lambda v, x: stack.apply(v, x, mutable=['counts'])
    with jax.set_mesh(stage_mesh(stages)):
      jaxpr = jax.make_jaxpr(fn)(variables, x)
      _, counts = jax.jit(fn)(variables, x)
    lengths = loop_lengths(jaxpr.jaxpr, [])
    iterations = lengths[0]  # the outer loop: iterations; inner: layers
    # Every layer counted one call at init; the rest are microbatch runs.
    runs = int((counts['counts']['calls'] - 1).sum())
    active = runs // (length // stages // repeats)  # stage-iterations
    idle = stages * iterations - active
    print(f'  {stages:>2} {micro:>3} {repeats:>2} {iterations:>10} '
          f'{pipe.iterations:>7} {idle:>5} {stages * iterations:>5} '
          f'{idle / (stages * iterations):>10.3f} '
          f'{pipe.bubble_fraction:>8.3f}')


def device_bytes(tree, device):
  return sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
             for s in leaf.addressable_shards if s.device == device)


def train_step(stack, tx):
  def step(params, opt_state, x):
    def loss(p):
      return jnp.mean(stack.apply({'params': p}, x) ** 2)
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def memory_row(label, stack, stages, x, tx):
  mesh = stage_mesh(stages)
  params = stack.init(jax.random.key(0), x)['params']
  sharding = NamedSharding(mesh, PartitionSpec('stage') if stages > 1 else
                           PartitionSpec())
  params = jax.device_put(params, sharding)
  opt_state = jax.tree_util.tree_map(
      lambda a: jax.device_put(a, sharding if a.ndim else
                               NamedSharding(mesh, PartitionSpec())),
      tx.init(params))
  with jax.set_mesh(mesh):
    compiled = jax.jit(train_step(stack, tx)).lower(params, opt_state,
                                                    x).compile()
  device = jax.devices()[0]
  mib = lambda b: f'{b / 2**20:>9.2f}'
  print(f'  {label:<34}{mib(device_bytes(params, device))}'
        f'{mib(device_bytes(opt_state, device))}'
        f'{mib(compiled.memory_analysis().temp_size_in_bytes)}')


def memory():
  hidden, length, rows = FLAGS.hidden, FLAGS.layers, FLAGS.batch
  print(f'\nPer-device MiB, train step (Adam), L={length}, width={hidden}, '
        f'batch={rows}')
  print(f'  {"":<34}{"params":>9}{"adam":>9}{"temp":>9}')
  x = jnp.ones((rows, hidden))
  tx = optax.adam(1e-3)
  for policy in (None, 'full'):
    memory_row(f'unpipelined policy={policy}',
               nn.Stack(Block, length, policy=policy)(hidden), 1, x, tx)
    for stages, micro, repeats in [(2, 2, 1), (2, 8, 1), (4, 4, 1),
                                   (4, 16, 1), (4, 4, 2), (8, 8, 1)][
                                       :FLAGS.memory_rows]:
      pipe = nn.Pipeline(stages=stages, microbatches=micro, repeats=repeats)
      memory_row(f'S={stages} M={micro} R={repeats} policy={policy}',
                 nn.Stack(Block, length, policy=policy, pipeline=pipe)(hidden),
                 stages, x, tx)
  pipe = nn.Pipeline(stages=4, microbatches=16, remat_iterations=True)
  memory_row('S=4 M=16 R=1 remat_iterations',
             nn.Stack(Block, length, pipeline=pipe)(hidden), 4, x, tx)


class Annotated(nn.Module):
  """A residual Dense block; ``annotate``: which variables carry logical
  names ('both', 'kernel' or 'none')."""
  annotate: str

  @nn.compact
  def __call__(self, x):
    kernel_init = nn.initializers.lecun_normal()
    bias_init = nn.initializers.zeros_init()
    if self.annotate != 'none':
      kernel_init = nn.with_logical_partitioning(kernel_init,
                                                 ('embed', 'mlp'))
    if self.annotate == 'both':
      bias_init = nn.with_logical_partitioning(bias_init, ('mlp',))
    return x + nn.Dense(x.shape[-1], kernel_init=kernel_init,
                        bias_init=bias_init)(x)


def placement():
  """Per-device parameter bytes of a pipelined stack from nn.init_sharded,
  for three annotation cases, next to what the annotations alone give."""
  stages, length, width = 4, 8, 32
  print(f'\nPer-device parameter bytes, S={stages}, L={length}, Dense '
        f'{width}x{width}, rules (layers->stage, embed/mlp->None)')
  print(f'  {"annotated":<18}{"stack total":>12}{"per device":>12}'
        f'{"by annotations alone":>22}')
  mesh = stage_mesh(stages)
  rules = (('layers', 'stage'), ('embed', None), ('mlp', None))
  x = jnp.ones((8, width))
  device = jax.devices()[0]
  for annotate in ('both', 'kernel', 'none'):
    pipe = nn.Pipeline(stages=stages, microbatches=4)
    stack = nn.Stack(Annotated, length, pipeline=pipe)(annotate)
    variables, _ = nn.init_sharded(stack, mesh, rules, warn_unmapped=False)(
        jax.random.key(0), x)
    boxed = jax.eval_shape(stack.init, jax.random.key(0), x)
    alone = sharded_init.mesh_shardings(boxed, mesh, rules)
    naive = sum(
        math.prod(s.shard_shape(np.shape(nn.unbox(b))))
        * 4 for b, s in zip(
            jax.tree_util.tree_leaves(boxed, is_leaf=nn.meta.is_axis_metadata),
            jax.tree_util.tree_leaves(alone)))
    total = sum(a.nbytes for a in jax.tree_util.tree_leaves(variables))
    print(f'  {annotate:<18}{total:>12,}{device_bytes(variables, device):>12,}'
          f'{naive:>22,}')


class Model(nn.Module):
  """An input projection, a stack of MLP blocks, an output projection: the
  shape of a language model without the vocabulary."""
  hidden: int
  length: int
  pipeline: object = None
  count: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.hidden)(x)
    x = nn.Stack(Block, self.length, pipeline=self.pipeline)(
        self.hidden, count=self.count, name='blocks')(x)
    return nn.Dense(x.shape[-1])(nn.LayerNorm()(x))


def model_loss(model):
  def loss_fn(params, x):
    return jnp.mean((model.apply({'params': params}, x) - x) ** 2)
  return loss_fn


def sgd_step(model, one_f_one_b):
  """The train step: value and gradients (jax.value_and_grad, or
  nn.pipeline.value_and_grad for 1F1B), then an SGD update."""
  grad_fn = (nn.pipeline.value_and_grad if one_f_one_b else
             jax.value_and_grad)(model_loss(model))

  def step(params, x):
    loss, grads = grad_fn(params, x)
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params,
                                        grads)
  return step


SCHEDULES = [('gpipe', {}), ('gpipe remat_iterations',
                            dict(remat_iterations=True)),
             ('circular', dict(repeats=2)),
             ('1f1b', dict(mode='1f1b')),
             ('1f1b interleaved', dict(mode='1f1b', repeats=2)),
             ('zero_bubble', dict(mode='zero_bubble'))]
# The sections comparing the two schedules of before interleaving.
GPIPE_AND_1F1B = [s for s in SCHEDULES if s[0] in ('gpipe', '1f1b')]


def chosen_schedules():
  return [(label, options) for label, options in SCHEDULES
          if label in FLAGS.schedule_names]


def schedule_step(stages, micro, options, hidden, rows):
  """``(model, step, params, x)`` of the train step for one schedule."""
  pipe = nn.Pipeline(stages=stages, microbatches=micro, **options)
  model = Model(hidden, 2 * stages, pipe)
  x = jax.ShapeDtypeStruct((micro * rows, hidden), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)['params']
  return model, sgd_step(model, in_loop(pipe)), params, x


def activation_memory():
  """Temp bytes of the train step by schedule and M, at a fixed microbatch
  size (the batch grows with M); iterations read from the program."""
  stages, hidden, rows = 4, FLAGS.hidden, FLAGS.micro_rows
  micros = [int(m) for m in FLAGS.schedule_micro]
  print(f'\nTrain step (SGD) temp MiB per device, S={stages}, '
        f'L={2 * stages}, width={hidden}, {rows} rows per microbatch (batch '
        f'= M x {rows})')
  print(f'  {"schedule":<26}' + ''.join(f'{"M=" + str(m):>9}'
                                        for m in micros))
  mesh = stage_mesh(stages)
  loops = {}
  for label, options in chosen_schedules():
    cells = []
    for micro in micros:
      _, step, params, x = schedule_step(stages, micro, options, hidden, rows)
      with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(params, x).compile()
        loops[label, micro] = schedule_loop(
            jax.make_jaxpr(step)(params, x).jaxpr)
      cells.append(f'{compiled.memory_analysis().temp_size_in_bytes / 2**20:>9.2f}')
    print(f'  {label:<26}' + ''.join(cells), flush=True)
  for label, options in chosen_schedules():
    if 'remat_iterations' in options:
      continue
    print(f'  {"iterations, " + label:<26}' + ''.join(
        f'{loops[label, m]:>9}' for m in micros))
    print(f'  {"idle fraction, " + label:<26}' + ''.join(
        f'{nn.Pipeline(stages=stages, microbatches=m, **options).bubble_fraction:>9.3f}'
        for m in micros))


def median_seconds(fn, repeats=5):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def schedule_times():
  """Lower, compile and step seconds of the train step, GPipe vs 1F1B."""
  stages, hidden, rows = 4, FLAGS.hidden, FLAGS.micro_rows
  print(f'\nTrain step (SGD) seconds on {jax.device_count()} CPU devices, '
        f'S={stages}, L={2 * stages}, width={hidden}, {rows} rows per '
        'microbatch; median of 3 lowerings/compiles and 5 steps')
  print(f'  {"schedule":<14}{"M":>4}{"lower s":>10}{"compile s":>11}'
        f'{"step ms":>10}')
  mesh = stage_mesh(stages)
  for micro in map(int, FLAGS.time_micro):
    for label, options in GPIPE_AND_1F1B:
      model, step, params, x = schedule_step(stages, micro, options, hidden,
                                             rows)
      with jax.set_mesh(mesh):
        lower, comp = lower_and_compile(step, params, x)
        x = jax.random.normal(jax.random.key(1), x.shape)
        params = jax.jit(model.init)(jax.random.key(0), x)['params']
        run = jax.jit(step)
        jax.block_until_ready(run(params, x))
        seconds = median_seconds(lambda: run(params, x))
      print(f'  {label:<14}{micro:>4}{lower:>10.3f}{comp:>11.3f}'
            f'{seconds * 1e3:>10.2f}', flush=True)


def differences():
  """Loss and gradients of the pipelined train step against the
  unpipelined one (float32), per schedule."""
  stages, hidden, rows, micro = 4, 64, 8, 8
  print(f'\nAgainst the unpipelined model: S={stages}, M={micro}, '
        f'width={hidden}, batch={micro * rows}; |d loss| / |loss| and the '
        'largest |d grad| / max |grad| over the parameters')
  x = jax.random.normal(jax.random.key(1), (micro * rows, hidden))
  plain = Model(hidden, 2 * stages)
  params = jax.jit(plain.init)(jax.random.key(0), x)['params']
  loss, grads = jax.jit(jax.value_and_grad(model_loss(plain)))(params, x)
  mesh = stage_mesh(stages)
  results = {}
  for label, options in GPIPE_AND_1F1B:
    model, step, _, _ = schedule_step(stages, micro, options, hidden, rows)
    grad = (nn.pipeline.value_and_grad if 'mode' in options else
            jax.value_and_grad)(model_loss(model))
    with jax.set_mesh(mesh):
      results[label] = jax.jit(grad)(params, x)
  def worst(a, b):
    return max(float(jnp.abs(u - v).max() / jnp.abs(v).max())
               for u, v in zip(jax.tree_util.tree_leaves(a),
                               jax.tree_util.tree_leaves(b)))
  for label, (l, g) in results.items():
    print(f'  {label:<8} vs unpipelined: loss {abs(float(l - loss)) / abs(float(loss)):.2e}'
          f'  gradients {worst(g, grads):.2e}')
  (l1, g1), (l0, g0) = results['1f1b'], results['gpipe']
  print(f'  1f1b vs gpipe:          loss {abs(float(l1 - l0)) / abs(float(l0)):.2e}'
        f'  gradients {worst(g1, g0):.2e}')


def tpu_schedules():
  """Temp MiB of the train step per schedule and M, compiled for
  --topology over a stage axis of 4 chips."""
  topology = aot.flag_topology()
  if not topology:
    raise app.UsageError('--sections=tpu_schedules needs --topology.')
  stages, hidden, rows = 4, FLAGS.hidden, FLAGS.micro_rows
  micros = [int(m) for m in FLAGS.schedule_micro]
  mesh = aot.topology_mesh(topology, {'stage': stages, 'data': -1},
                           slice_axes(topology, stages))
  print(f'\nTrain step (SGD) compiled for {topology}: temp MiB per '
        f'chip, S={stages}, L={2 * stages}, width={hidden}, {rows} rows per '
        'microbatch')
  print(f'  {"schedule":<26}' + ''.join(f'{"M=" + str(m):>9}'
                                        for m in micros))
  layers = NamedSharding(mesh, PartitionSpec('stage'))
  whole = NamedSharding(mesh, PartitionSpec())
  for label, options in chosen_schedules():
    cells = []
    for micro in micros:
      model, step, params, x = schedule_step(stages, micro, options, hidden,
                                             rows)
      blocks = lambda path, _: any(getattr(k, 'key', None) == 'blocks'
                                   for k in path)
      shard = jax.tree_util.tree_map_with_path(
          lambda path, a: layers if blocks(path, a) else whole, params)
      args = (aot.abstract(params, shard), aot.abstract(x, whole))

      def lower(step=step, args=args):
        with jax.set_mesh(mesh):
          return jax.jit(step).lower(*args)

      report = aot.compile_report(f'{label} M={micro}', lower, mesh)[0]
      cells.append(f'{report.temp / 2**20:>9.2f}' if report.fits
                   else f'{"no fit":>9}')
      if report.fits and aot.split_slices(topology)[1] > 1:
        print(f'    {label} M={micro}: '
              f'{aot.traffic_lib.summary(report.traffic)}', flush=True)
    print(f'  {label:<26}' + ''.join(cells), flush=True)


def lower_and_compile(fn, *args):
  """Median seconds of (trace+lower, compile) over fresh runs, after one
  untimed warm-up."""
  lowers, compiles = [], []
  for i in range(FLAGS.compile_repeats + 1):
    jax.clear_caches()
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    middle = time.perf_counter()
    lowered.compile()
    end = time.perf_counter()
    if i:
      lowers.append(middle - start)
      compiles.append(end - middle)
  return statistics.median(lowers), statistics.median(compiles)


def compile_times():
  hidden, rows = 64, 32
  print('\nTrace+lower and compile seconds of the train step (median of '
        f'{FLAGS.compile_repeats}); S=4, M=8')
  print(f'  {"L":>5} {"unpipelined":>24} {"pipelined":>24}')
  print(f'  {"":>5} {"lower":>12}{"compile":>12} {"lower":>12}{"compile":>12}')
  x = jnp.ones((rows, hidden))
  tx = optax.sgd(1e-3)
  mesh = stage_mesh(4)
  for length in map(int, FLAGS.compile_layers):
    cells = []
    for pipe in (None, nn.Pipeline(stages=4, microbatches=8)):
      stack = nn.Stack(Block, length, policy='full', pipeline=pipe)(hidden)
      params = jax.eval_shape(stack.init, jax.random.key(0), x)['params']
      opt_state = jax.eval_shape(tx.init, params)
      with jax.set_mesh(mesh):
        lower, comp = lower_and_compile(train_step(stack, tx), params,
                                        opt_state, x)
      cells.append(f'{lower:>12.3f}{comp:>12.3f}')
    print(f'  {length:>5} {cells[0]} {cells[1]}')


def slice_axes(topology, stages):
  """The mesh axes that span the slices of ``topology``: ``--dcn_axes``
  when given for a pipelined row, else the stage axis (stages across
  slices); an unpipelined row spans them with its data axis."""
  slices = aot.split_slices(topology)[1]
  if slices == 1:
    return {}
  if stages == 1:
    return {'data': slices}
  named = FLAGS.dcn_axes if FLAGS.is_parsed() else []
  return aot.parse_dcn_axes(named) or {'stage': slices}


def tpu_report(label, stack, stages, x, topology):
  """The Adam train step of ``stack`` compiled for ``topology`` over a
  ``('stage', 'data')`` mesh with ``stages`` stages (1: the batch over every
  chip); an ``aot.Report`` with the bytes per step on each network."""
  tx = optax.adam(1e-3)
  mesh = aot.topology_mesh(topology, {'stage': stages, 'data': -1},
                           slice_axes(topology, stages))
  layers = NamedSharding(mesh, PartitionSpec('stage'))
  scalar = NamedSharding(mesh, PartitionSpec())
  batch = NamedSharding(mesh, PartitionSpec(
      ('stage', 'data') if stages == 1 else 'data'))
  params = jax.eval_shape(stack.init, jax.random.key(0), x)['params']
  opt_state = jax.eval_shape(tx.init, params)
  shard = lambda a: layers if a.ndim else scalar
  args = (aot.abstract(params, jax.tree_util.tree_map(shard, params)),
          aot.abstract(opt_state, jax.tree_util.tree_map(shard, opt_state)),
          aot.abstract(x, batch))

  def lower():
    with jax.set_mesh(mesh):
      return jax.jit(train_step(stack, tx)).lower(*args)

  return aot.compile_report(label, lower, mesh)[0]


def tpu_rows():
  """Unpipelined vs pipelined train step (Adam) compiled for --topology."""
  topology = aot.flag_topology()
  if not topology:
    raise app.UsageError('--sections=tpu needs --topology (e.g. v5e:4x4).')
  hidden, length, rows = FLAGS.hidden, FLAGS.layers, FLAGS.batch
  x = jax.ShapeDtypeStruct((rows, hidden), jnp.float32)
  reports = []
  smr = [tuple(map(int, row.split(','))) for row in FLAGS.tpu_row]
  for stages, micro, repeats in [(1, 1, 1)] + smr:
    pipe = None if stages == 1 else nn.Pipeline(
        stages=stages, microbatches=micro, repeats=repeats)
    stack = nn.Stack(Block, length, policy='full', pipeline=pipe)(hidden)
    label = ('unpipelined, data-parallel' if pipe is None else
             f'S={stages} M={micro} R={repeats}')
    reports.append(tpu_report(label, stack, stages, x, topology))
    print(aot.table_row(reports[-1]), flush=True)
  aot.print_table(f'Train step (Adam) compiled for {topology}: L={length},'
                  f' width={hidden}, batch={rows}, policy=full', reports)
  print('\nBytes per chip per step by network and collective (result '
        'sizes, loops counted per iteration):')
  for r in reports:
    if r.fits:
      print(f'  {r.label:<28} {aot.traffic_lib.summary(r.traffic)}')
  # XLA's cost model gives no step estimate for these loops (n/a) or counts
  # a loop body once, so the step time comes from a roofline model instead:
  # the stack's matmul FLOPs (4x the forward: forward, recomputed forward,
  # backward) spread over every chip, times the pipeline's bubble factor.
  chips = len(aot.topology_devices(topology))
  flops = 4 * 2 * (4 * hidden * hidden) * rows * length
  ideal = flops / chips / aot.chip(topology)['peak_flops']
  print(f'\nRoofline step estimate (model FLOPs {flops / 1e12:.2f} T over '
        f'{chips} chips at peak, x bubble (M*R+S-1)/(M*R)); a model, not '
        'a measurement:')
  for (stages, micro, repeats), r in zip([(1, 1, 1)] + smr, reports):
    factor = (micro * repeats + stages - 1) / (micro * repeats)
    print(f'  {r.label:<28} {ideal * factor * 1e3:8.2f} ms  '
          f'{factor:.3f}x the unpipelined step')


# -- every schedule: figures and pictures ------------------------------------------

FIGURE_SCHEDULES = [s for s in SCHEDULES
                    if s[0] != 'gpipe remat_iterations']
flags.DEFINE_list('figure_micro', ['8', '16', '32', '64'],
                  'M values for the figures section')
flags.DEFINE_string('picture_dir', 'docs/img', 'where pictures go')


def in_loop(pipe):
  """Whether the schedule computes the gradients in its own loop."""
  return pipe.mode in nn.pipeline.TRAINED


def timeline(pipe):
  """``(blocks, length)``: what each stage runs when, as the code runs
  it. A block is ``(stage, start, width, kind, repeat, microbatch,
  iteration)``; time is counted in slots of one forward each (an input-
  or weight-gradient slot costs one, a whole backward two). The training
  loops (1F1B, interleaved, zero-bubble) come from ``pipe.table()``, the
  table the loop reads, its iterations laid out phase by phase; GPipe and
  circular from ``pipe.schedule()`` (the forward loop's ``j = t − s``),
  then ``jax.grad``'s backward loop, the forward's iterations in
  reverse."""
  stages, micro = pipe.stages, pipe.microbatches
  blocks, clock = [], 0
  if in_loop(pipe):
    table = pipe.table()
    cost = {'F': 1, 'B': 1 if table.split else 2, 'W': 1}
    for start, stop, kinds in table.phases():
      for t in range(start, stop):
        for kind in kinds:
          cells = table.kinds[kind]
          blocks += [(s, clock, cost[kind], kind, int(cells['repeat'][t, s]),
                      int(cells['micro'][t, s]), t)
                     for s in range(stages) if cells['ok'][t, s]]
          clock += cost[kind]
    return blocks, clock
  items = pipe.schedule()
  n = len(items)
  for t in range(2 * n):
    forward = t < n
    row = items[t if forward else 2 * n - 1 - t]
    blocks += [(s, clock, 1 if forward else 2, 'F' if forward else 'B',
                int(j) // micro, int(j) % micro, t)
               for s, j in enumerate(row) if j >= 0]
    clock += 1 if forward else 2
  return blocks, clock


def draw(pipe, label, path):
  """One schedule's timeline per stage as a PNG (matplotlib)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  blocks, length = timeline(pipe)
  colors = {'F': ('#9ecae1', '#3182bd'), 'B': ('#a1d99b', '#31a354'),
            'W': ('#fdd0a2', '#e6550d')}
  figure, axes = pyplot.subplots(figsize=(max(6, length * 0.16),
                                          0.45 * pipe.stages + 0.9))
  for stage, start, width, kind, repeat, micro, _ in blocks:
    shade = colors[kind][min(repeat, 1)]
    axes.broken_barh([(start, width)], (stage - 0.4, 0.8), facecolors=shade,
                     edgecolors='white', linewidth=0.5)
    axes.text(start + width / 2, stage, str(micro), ha='center',
              va='center', fontsize=6)
  axes.set_xlim(0, length)
  axes.set_ylim(pipe.stages - 0.5, -0.5)
  axes.set_yticks(range(pipe.stages),
                  [f'stage {s}' for s in range(pipe.stages)])
  axes.set_xlabel('time (one forward = 1; blank = idle); forward blue, '
                  'backward (B) green, weight gradient (W) orange, darker: '
                  'second chunk; numbers: microbatches', fontsize=7)
  axes.set_title(f'{label}: S={pipe.stages}, M={pipe.microbatches}, '
                 f'repeats={pipe.repeats}; idle {pipe.bubble_fraction:.3f}',
                 fontsize=9)
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  pyplot.close(figure)


def pictures():
  """docs/img/pipeline_<schedule>.png for every schedule, S=4, M=8."""
  os.makedirs(FLAGS.picture_dir, exist_ok=True)
  for label, options in FIGURE_SCHEDULES:
    pipe = nn.Pipeline(stages=4, microbatches=8, **options)
    path = os.path.join(FLAGS.picture_dir,
                        f'pipeline_{label.replace(" ", "_")}.png')
    draw(pipe, label, path)
    print(f'  {path}')


def scopes_in(jaxpr, found):
  """The ``pipeline_slot_*`` scopes of every equation in ``jaxpr``."""
  for eqn in jaxpr.eqns:
    stack = str(eqn.source_info.name_stack)
    found.update(k for k in 'FBW' if f'pipeline_slot_{k}' in stack)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      scopes_in(sub, found)
  return found


def slot_loops(jaxpr):
  """``{kind: iterations}`` of the schedule's loops (the scans at the top
  of the first shard_map that permute), by the slots their bodies hold."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'shard_map':
      counts = {}
      for e in eqn.params['jaxpr'].eqns:
        if e.primitive.name == 'scan' and permutes(e.params['jaxpr'].jaxpr):
          for kind in scopes_in(e.params['jaxpr'].jaxpr, set()) or {'F'}:
            counts[kind] = counts.get(kind, 0) + e.params['length']
      return counts
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found = slot_loops(sub)
      if found:
        return found
  return {}


def measured_idle(pipe, hidden, rows):
  """Idle share of the slot time, the slots read from the traced train
  step's loops, the work done counted by the layers (each counts the
  microbatches its forward runs); backward and weight-gradient work is
  one per forward (the gradients are checked against the unpipelined
  model)."""
  model = Model(hidden, 2 * pipe.stages,
                dataclasses.replace(pipe, per_microbatch=('counts',)),
                count=True)
  x = jax.random.normal(jax.random.key(1), (pipe.microbatches * rows, hidden))
  variables = Model(hidden, 2 * pipe.stages, count=True).init(
      jax.random.key(0), x)
  variables = {**variables, 'params': {**variables['params'], 'blocks':
      pipe.to_pipeline_layout(variables['params']['blocks'])}}

  def loss_fn(params, x):
    y, counts = model.apply({'params': params,
                             'counts': variables['counts']}, x,
                            mutable=['counts'])
    return jnp.mean((y - x) ** 2), counts

  grad = (nn.pipeline.value_and_grad if in_loop(pipe) else
          jax.value_and_grad)(loss_fn, has_aux=True)
  with jax.set_mesh(stage_mesh(pipe.stages)):
    slots = slot_loops(jax.make_jaxpr(grad)(variables['params'], x).jaxpr)
    (_, counts), _ = jax.jit(grad)(variables['params'], x)
  if not in_loop(pipe):  # jax.grad runs as many backward iterations
    slots = {'F': slots['F'], 'B': slots['F']}
  runs = int((counts['counts']['blocks']['calls'] - 1).sum())
  active = runs // pipe.layers_per_stage(2 * pipe.stages)  # layers a slot
  cost = {'F': 1, 'B': 1 if pipe.split_backward else 2, 'W': 1}
  total = sum(cost[k] * n * pipe.stages for k, n in slots.items())
  busy = sum(cost[k] * active for k in slots)
  return 1 - busy / total


def schedule_figures():
  """Per schedule and M at S=4: idle measured vs formula, temp MiB, step
  ms, largest gradient difference from the unpipelined model."""
  stages, hidden, rows = 4, FLAGS.hidden, FLAGS.micro_rows
  length = 2 * stages
  print(f'\nEvery schedule, S={stages}, L={length}, width={hidden}, {rows} '
        f'rows per microbatch, {jax.device_count()} CPU devices; train step '
        '= value and gradients + SGD')
  print(f'  {"schedule":<18}{"M":>4}{"idle":>8}{"formula":>9}{"temp MiB":>10}'
        f'{"compile s":>10}{"step ms":>9}{"grad diff":>11}', flush=True)
  mesh = stage_mesh(stages)
  for micro in map(int, FLAGS.figure_micro):
    x = jax.random.normal(jax.random.key(1), (micro * rows, hidden))
    plain = Model(hidden, length)
    params = jax.jit(plain.init)(jax.random.key(0), x)['params']
    _, ref = jax.jit(jax.value_and_grad(model_loss(plain)))(params, x)
    for label, options in FIGURE_SCHEDULES:
      pipe = nn.Pipeline(stages=stages, microbatches=micro, **options)
      model = Model(hidden, length, pipe)
      mine = {**params, 'blocks': pipe.to_pipeline_layout(params['blocks'])}
      step = sgd_step(model, in_loop(pipe))
      idle = measured_idle(pipe, 16, 2)
      with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = jax.jit(step).lower(mine, x).compile()
        comp = time.perf_counter() - start
        grad = (nn.pipeline.value_and_grad if in_loop(pipe) else
                jax.value_and_grad)(model_loss(model))
        _, grads = jax.jit(grad)(mine, x)
        jax.block_until_ready(compiled(mine, x))
        seconds = median_seconds(lambda: compiled(mine, x), repeats=3)
      want = {**ref, 'blocks': pipe.to_pipeline_layout(ref['blocks'])}
      diff = max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
                 for a, b in zip(jax.tree_util.tree_leaves(grads),
                                 jax.tree_util.tree_leaves(want)))
      temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
      print(f'  {label:<18}{micro:>4}{idle:>8.3f}{pipe.bubble_fraction:>9.3f}'
            f'{temp:>10.2f}{comp:>10.2f}{seconds * 1e3:>9.1f}{diff:>11.1e}',
            flush=True)


def main(argv):
  del argv
  print(f'JAX {jax.__version__}, {jax.device_count()} '
        f'{jax.default_backend()} devices')
  sections = {'bubble': bubble, 'memory': memory, 'compile': compile_times,
              'tpu': tpu_rows, 'placement': placement,
              'schedules': activation_memory, 'schedule_time': schedule_times,
              'differences': differences, 'tpu_schedules': tpu_schedules,
              'figures': schedule_figures, 'pictures': pictures}
  for name in FLAGS.sections:
    sections[name]()


if __name__ == '__main__':
  app.run(main)
