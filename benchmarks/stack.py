r"""Layer stacks: gradient memory, compile time and step time of ``nn.Stack``
policies vs flax.linen's scan/remat/remat_scan and hand-written JAX, in one
process.

Workload: ``depth`` residual blocks LayerNorm -> Dense(4H) -> gelu
-> Dense(H) (the gelu output named ``mlp_up``), f32, loss = mean of the
output; the gradient w.r.t. the parameters is jitted. For each row:

- temp MiB: ``jax.jit(grad).lower(...).compile().memory_analysis()``
  ``temp_size_in_bytes`` (deterministic), plus host temp bytes;
- compile s: lowering + compilation time, best of ``--compile_repeats``
  fresh jits;
- step ms: median of ``--repeats`` calls of the compiled gradient, taken
  round-robin over the rows (one call of each row per round) so that load
  changes on a shared machine hit every row alike.

Rows marked with another depth (prime, unrolled) are compared with the flat
``Stack('full')`` row at the same depth, printed next to them.

  python -m benchmarks.stack --depth=64 --hidden=64 --batch=2048 --repeats=5
  python -m benchmarks.stack --rows=liftmods_full,liftmods_nested  # subset

The ``offload_*`` rows move carries / a named internal to pinned host
memory. XLA:CPU has no separate host memory: there they warn
(``StackOffloadWarning``) and match their on-device rows; on a GPU, host
bytes > 0 and device temp below the on-device row are the figures:

  python -m benchmarks.stack --rows=liftmods_full,liftmods_save_named,\
      liftmods_nested,offload_carries,offload_named,offload_nested

With ``--topology`` (``benchmarks/aot.py``) every row is compiled for that
TPU slice instead (batch split over all its chips, parameters replicated)
and the compiled figures are printed; on TPU the H=64, batch 2,048 default
fits in on-chip memory, so use shapes that leave it:

  python -m benchmarks.stack --topology=v5e:2x2 --hidden=512 --batch=16384
"""
import time
import warnings

from absl import app, flags
import flax.linen as fnn
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks import aot
import liftmods as lnn

flags.DEFINE_integer('depth', 64, 'number of blocks D')
flags.DEFINE_integer('hidden', 64, 'width H')
flags.DEFINE_integer('batch', 2048, 'batch size')
flags.DEFINE_integer('repeats', 5, 'timed calls per row (median reported)')
flags.DEFINE_integer('prime_depth', 61, 'depth of the prime-L nested rows')
flags.DEFINE_integer('unrolled_depth', 8,
                     'depth of the unrolled-mode rows (unrolled compile time '
                     'grows with depth)')
flags.DEFINE_integer('compile_repeats', 2, 'fresh compiles per row (best)')
flags.DEFINE_list('rows', [], 'only these rows (default: all)')
flags.DEFINE_bool('time_steps', True, 'measure step time (slow on CPU)')
F = flags.FLAGS

MIB = 2.0 ** 20


def block_class(nn):
  """The residual block written once against a Linen-style namespace."""

  class Block(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(x)
      h = jax.ad_checkpoint.checkpoint_name(
          nn.gelu(nn.Dense(4 * self.hidden)(h)), 'mlp_up')
      return x + nn.Dense(self.hidden)(h)

  class ScanBlock(Block):
    """nn.scan bodies return (carry, output)."""

    def __call__(self, x, _):
      return super().__call__(x), None

  return Block, ScanBlock


def linen_net(kind, depth, hidden):
  """A flax.linen model with the stack at params['blocks']."""
  Block, ScanBlock = block_class(fnn)
  scan_kw = dict(variable_axes={'params': 0}, split_rngs={'params': True},
                 length=depth)

  class Net(fnn.Module):

    @fnn.compact
    def __call__(self, x):
      if kind == 'remat_scan':
        stack = fnn.remat_scan(Block, lengths=(8, depth // 8))
        return stack(hidden, name='blocks')(x)
      if kind == 'scan':
        cls = ScanBlock
      elif kind == 'remat':
        cls = fnn.remat(ScanBlock, prevent_cse=False)
      else:  # save the named internal
        cls = fnn.remat(
            ScanBlock, prevent_cse=False,
            policy=jax.checkpoint_policies.save_only_these_names('mlp_up'))
      return fnn.scan(cls, **scan_kw)(hidden, name='blocks')(x, None)[0]

  return Net()


def stack_net(depth, hidden, **stack_kw):
  """A liftmods model holding nn.Stack at params['blocks']."""
  Block, _ = block_class(lnn)

  class Net(lnn.Module):

    @lnn.compact
    def __call__(self, x):
      return lnn.Stack(Block, length=depth, **stack_kw)(hidden,
                                                         name='blocks')(x)

  return Net()


def _block_fn(p, x):
  """One layer as a pure function of its parameters (the Linen block's
  apply, so that every row computes exactly the same block)."""
  block, _ = block_class(fnn)
  return block(x.shape[-1]).apply({'params': p}, x)


class HandNested:
  """Hand-written JAX: 8 x (D/8) with a rolled outer scan, each group an
  inner scan of per-layer checkpoints under one checkpoint. Same (D, ...)
  parameters, reshaped inside."""

  def __init__(self, groups=8):
    self.groups = groups

  def apply(self, variables, x):
    params = variables['params']['blocks']
    g = self.groups
    grouped = jax.tree_util.tree_map(
        lambda a: a.reshape((g, a.shape[0] // g) + a.shape[1:]), params)

    def layer(x, p):
      return jax.checkpoint(_block_fn, prevent_cse=False)(p, x), None

    @jax.checkpoint
    def group(x, ps):
      return lax.scan(layer, x, ps)[0], None

    return lax.scan(group, x, grouped)[0]


def rows(depth, hidden):
  """(label, depth, model) for every configuration."""
  prime, unrolled = F.prime_depth, F.unrolled_depth
  policy = lnn.StackPolicy
  return [
      ('linen_scan', depth, linen_net('scan', depth, hidden)),
      ('linen_scan_remat', depth, linen_net('remat', depth, hidden)),
      ('linen_remat_named', depth, linen_net('named', depth, hidden)),
      ('linen_remat_scan_8x8', depth, linen_net('remat_scan', depth, hidden)),
      ('jax_nested_8x8', depth, HandNested(8)),
      ('liftmods_none', depth, stack_net(depth, hidden)),
      ('liftmods_full', depth, stack_net(depth, hidden, policy='full')),
      ('liftmods_save_named', depth, stack_net(
          depth, hidden, policy=policy(save_block_internals=('mlp_up',)))),
      ('liftmods_nested', depth, stack_net(depth, hidden, policy='nested')),
      ('liftmods_nested_4', depth, stack_net(
          depth, hidden, policy=policy(nested=4))),
      ('offload_carries', depth, stack_net(depth, hidden, policy='offload')),
      ('offload_named', depth, stack_net(depth, hidden, policy=policy(
          offload_block_internals=('mlp_up',)))),
      ('offload_nested', depth, stack_net(depth, hidden, policy=policy(
          nested=True, save_carries='offload'))),
      ('liftmods_full_L%d' % prime, prime, stack_net(prime, hidden,
                                                     policy='full')),
      ('liftmods_nested_L%d' % prime, prime, stack_net(prime, hidden,
                                                       policy='nested')),
      ('liftmods_nested_5_L%d' % prime, prime, stack_net(
          prime, hidden, policy=policy(nested=5))),
      ('liftmods_full_L%d' % unrolled, unrolled, stack_net(
          unrolled, hidden, policy='full')),
      ('unrolled_none_L%d' % unrolled, unrolled, stack_net(
          unrolled, hidden, mode='unrolled')),
      ('unrolled_full_L%d' % unrolled, unrolled, stack_net(
          unrolled, hidden, mode='unrolled', policy='full')),
      ('unrolled_nested_L%d' % unrolled, unrolled, stack_net(
          unrolled, hidden, mode='unrolled', policy='nested')),
  ]


def measure(model, variables, x):
  """temp bytes, host temp bytes, compile seconds, compiled grad fn."""

  def loss(v):
    return jnp.mean(model.apply(v, x))

  compile_s = float('inf')
  for _ in range(F.compile_repeats):
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(lambda v: loss(v))).lower(variables).compile()  # pylint: disable=unnecessary-lambda
    compile_s = min(compile_s, time.perf_counter() - start)
  stats = compiled.memory_analysis()
  host = getattr(stats, 'host_temp_size_in_bytes', 0)
  return stats.temp_size_in_bytes, host, compile_s, compiled


PAIRS = (  # (liftmods row, equivalent row)
    ('liftmods_none', 'linen_scan'),
    ('liftmods_full', 'linen_scan_remat'),
    ('liftmods_save_named', 'linen_remat_named'),
    ('liftmods_nested', 'jax_nested_8x8'),
    ('liftmods_nested', 'linen_remat_scan_8x8'),
    ('offload_carries', 'liftmods_full'),
    ('offload_named', 'liftmods_save_named'),
    ('offload_nested', 'liftmods_nested'),
)


def remat_scan_layout(variables, depth):
  """The ``(8, D/8, ...)`` parameter layout of ``nn.remat_scan((8, D/8))``."""
  return {'params': {'blocks': jax.tree_util.tree_map(
      lambda a: a.reshape((8, depth // 8) + a.shape[1:]),
      variables['params']['blocks'])}}


def compile_for_topology(depth, hidden):
  """Every row compiled for ``--topology``: the batch split over all chips,
  the parameters replicated; returns ``{label: aot.Report}``."""
  mesh = aot.topology_mesh(F.topology, {'data': -1})
  replicated = NamedSharding(mesh, PartitionSpec())
  x = jax.ShapeDtypeStruct((F.batch, hidden), jnp.float32,
                           sharding=NamedSharding(mesh, PartitionSpec('data')))
  reports = {}
  for label, d, model in rows(depth, hidden):
    if F.rows and label not in F.rows:
      continue
    v = jax.eval_shape(stack_net(d, hidden).init, jax.random.key(0),
                       jax.ShapeDtypeStruct((1, hidden), jnp.float32))
    if label.startswith('linen_remat_scan'):
      v = jax.eval_shape(lambda v, d=d: remat_scan_layout(v, d), v)
    v = aot.abstract(v, replicated)
    grad = jax.grad(lambda v, x, model=model: jnp.mean(model.apply(v, x)))

    def lower(grad=grad, v=v):
      with jax.set_mesh(mesh):
        return jax.jit(grad).lower(v, x)

    reports[label], _ = aot.compile_report(f'{label} (D={d})', lower)
    print(aot.table_row(reports[label]), flush=True)
  return reports


def aot_main(depth, hidden):
  print(f'topology={F.topology} D={depth} H={hidden} batch={F.batch} f32; '
        'compiled gradient, per device')
  reports = compile_for_topology(depth, hidden)
  aot.print_table('Stacks compiled for ' + F.topology, reports.values())
  print('\nliftmods vs equivalent (device temp ratio; host MiB)')
  for a, b in PAIRS:
    if a in reports and b in reports and reports[a].fits and reports[b].fits:
      ra, rb = reports[a], reports[b]
      print(f'  {a} / {b}: temp {ra.temp / max(rb.temp, 1):.2f}x, host '
            f'{ra.host / MIB:.1f} vs {rb.host / MIB:.1f} MiB')


def main(argv):
  del argv
  depth, hidden = F.depth, F.hidden
  if F.topology:
    return aot_main(depth, hidden)
  x = jax.random.normal(jax.random.key(1), (F.batch, hidden), jnp.float32)
  print(f'backend={jax.default_backend()} D={depth} H={hidden} '
        f'batch={F.batch} f32; temp = compiled grad temp bytes')
  variables, results, compiled = {}, {}, {}
  for label, d, model in rows(depth, hidden):
    if F.rows and label not in F.rows:
      continue
    if d not in variables:
      variables[d] = stack_net(d, hidden).init(jax.random.key(0), x[:1])
    v = variables[d]
    if label.startswith('linen_remat_scan'):  # its own (8, D/8, ...) layout
      v = remat_scan_layout(v, d)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always', lnn.StackOffloadWarning)
      temp, host, compile_s, fn = measure(model, v, x)
    for w in caught[:1]:
      print(f'  ({label}: StackOffloadWarning: {w.message})')
    compiled[label] = (fn, v)
    results[label] = dict(depth=d, temp=temp, host=host, compile=compile_s)
    print(f'  {label:<26} D={d:<3} temp {temp / MIB:9.2f} MiB  host '
          f'{host / MIB:6.2f} MiB  compile {compile_s:6.2f} s', flush=True)

  if F.time_steps:
    # Round-robin: one call of every row per round, so that load changes on
    # a shared machine hit all rows alike; median over rounds.
    # CPU time of the process (all XLA threads) is also recorded: on an
    # oversubscribed machine it tracks the work done better than wall time.
    times = {label: [] for label in compiled}
    cpu = {label: [] for label in compiled}
    for fn, v in compiled.values():
      jax.block_until_ready(fn(v))
    for _ in range(F.repeats):
      for label, (fn, v) in compiled.items():
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(v))
        times[label].append(time.perf_counter() - start)
        cpu[label].append(time.process_time() - start_cpu)
    for label, t in times.items():
      results[label]['step'] = sorted(t)[len(t) // 2]
      results[label]['cpu'] = sorted(cpu[label])[len(t) // 2]

  print('\n| row | D | temp MiB | compile s | step ms (wall) | step ms (CPU) |')
  print('|---|---|---|---|---|---|')
  for label, r in results.items():
    step = f'{r["step"] * 1e3:.0f}' if 'step' in r else '-'
    cpu_ms = f'{r["cpu"] * 1e3:.0f}' if 'cpu' in r else '-'
    print(f'| {label} | {r["depth"]} | {r["temp"] / MIB:.2f} | '
          f'{r["compile"]:.2f} | {step} | {cpu_ms} |')

  print('\nliftmods vs equivalent (ratio; compile difference)')
  for a, b in PAIRS:
    if a in results and b in results:
      ra, rb = results[a], results[b]
      line = (f'  {a} / {b}: temp {ra["temp"] / rb["temp"]:.2f}x, compile '
              f'{ra["compile"] - rb["compile"]:+.2f} s')
      if a.startswith('offload'):
        line += f', host {ra["host"] / MIB:.2f} vs {rb["host"] / MIB:.2f} MiB'

      if 'step' in ra:
        line += (f', step {ra["step"] / rb["step"]:.2f}x wall, '
                 f'{ra["cpu"] / rb["cpu"]:.2f}x CPU')
      print(line)
  for label, r in results.items():
    flat = f'liftmods_full_L{r["depth"]}' if r['depth'] != depth else (
        'liftmods_full')
    if label != flat and flat in results and 'nested' in label:
      print(f'  {label} vs {flat}: temp {r["temp"] / results[flat]["temp"]:.2f}x'
            f', compile {r["compile"] - results[flat]["compile"]:+.2f} s')

  # Every row computes the same gradient (remat_scan in its own layout).
  ref = {}
  for label, (fn, v) in compiled.items():
    d = results[label]['depth']
    g = fn(v)['params']['blocks']
    if label.startswith('linen_remat_scan'):
      g = jax.tree_util.tree_map(lambda a: a.reshape((d,) + a.shape[2:]), g)
    if d not in ref:
      ref[d] = (label, g)
      continue
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref[d][1])))
    print(f'  grad max|diff| {label} vs {ref[d][0]}: {err:.1e}')


if __name__ == '__main__':
  app.run(main)
