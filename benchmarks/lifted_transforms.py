r"""Lifted-transform figures: liftmods vs flax.linen (vs hand-written JAX where
one exists), in one process.

1. Scanned residual-MLP stack (LayerNorm -> Dense(4H) -> gelu -> Dense(H)):
   apply/init trace time at two depths (flat in depth?).
2. Lifted jit dispatch: ``nn.jit(Net)().apply`` eager call vs ``jax.jit`` of
   the same apply, for the scanned stack and for an MLP of ``mlp_layers``
   Dense(``mlp_width``) layers at batch ``mlp_batch``; and nn.jit trace
   counts for identical jitted blocks (one configuration, several paths),
   next to Linen's.
   ``jit`` puts both eager-call figures in one table: per model, nn.jit's
   cost as a ratio to jax.jit of the same apply and to Linen's nn.jit, from
   alternating blocked rounds (median over rounds, and best call vs best
   call).
3. Gradient temp memory (XLA memory_analysis of a jitted grad) for a plain
   scan, ``remat_scan(lengths=(8, 8))`` and a scan of per-layer remat.
4. Compiled step time of the scanned apply.

  python -m benchmarks.lifted_transforms --depth=24 --deep=96 --hidden=256
  python -m benchmarks.lifted_transforms --sections=dispatch,mlp,blocks
  python -m benchmarks.lifted_transforms --sections=jit
"""
import functools
import statistics
import time

from absl import app, flags
import flax.linen as fnn
import jax
import jax.numpy as jnp

import liftmods as lnn
from benchmarks import common

flags.DEFINE_integer('depth', 24, 'scanned stack depth')
flags.DEFINE_integer('deep', 96, 'second depth for the flatness check')
flags.DEFINE_integer('hidden', 256, 'hidden width H')
flags.DEFINE_integer('batch', 8, 'batch for trace/dispatch figures')
flags.DEFINE_integer('repeats', 7, 'timed repetitions per figure')
flags.DEFINE_integer('dispatch_hidden', 16,
                     'width for the eager-call figure (small, so that the '
                     'call measures dispatch rather than compute)')
flags.DEFINE_integer('mlp_layers', 4, 'Dense layers of the eager-call MLP')
flags.DEFINE_integer('mlp_width', 64, 'width of the eager-call MLP')
flags.DEFINE_integer('mlp_batch', 8, 'batch of the eager-call MLP')
flags.DEFINE_integer('dispatch_calls', 300, 'timed calls per eager figure')
flags.DEFINE_integer('dispatch_rounds', 5,
                     'alternating rounds per eager figure (median ratio over '
                     'rounds, so that load shared by both sides cancels)')
flags.DEFINE_list('sections', 'trace,jit,dispatch,mlp,blocks,memory,step',
                  'figures to run (comma-separated)')
flags.DEFINE_integer('mem_depth', 64, 'depth for the memory figures')
flags.DEFINE_integer('mem_hidden', 64, 'width for the memory figures')
flags.DEFINE_integer('mem_batch', 2048, 'batch for the memory figures')
F = flags.FLAGS


def build(nn, stack: str = 'scan', lengths=(8, 8)):
  """A residual stack written once against a Linen-style namespace."""

  class Block(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x, _):
      h = nn.LayerNorm()(x)
      h = nn.gelu(nn.Dense(4 * self.hidden)(h))
      return x + nn.Dense(self.hidden)(h), None

  class CarryOnly(Block):
    """remat_scan bodies map the carry to the carry."""

    def __call__(self, x):
      return super().__call__(x, None)[0]

  class Net(nn.Module):
    depth: int
    hidden: int

    @nn.compact
    def __call__(self, x):
      if stack == 'remat_scan':
        body = nn.remat_scan(CarryOnly, lengths=lengths)
        return body(self.hidden)(x)
      block = nn.remat(Block) if stack == 'scan_remat' else Block
      body = nn.scan(block, variable_axes={'params': 0},
                     split_rngs={'params': True}, length=self.depth)
      x, _ = body(self.hidden)(x, None)
      return x

  return Net


def hand_scan_apply(params, x):
  def body(x, p):
    mean = x.mean(-1, keepdims=True)
    var = jnp.maximum((x * x).mean(-1, keepdims=True) - mean * mean, 0.)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-6) * p['scale'] + p['shift']
    h = jax.nn.gelu(h @ p['w1'] + p['b1'])
    return x + h @ p['w2'] + p['b2'], None
  return jax.lax.scan(body, x, params)[0]


def hand_params(depth, hidden):
  z = lambda *s: jnp.zeros((depth,) + s)
  return {'scale': z(hidden), 'shift': z(hidden), 'w1': z(hidden, 4 * hidden),
          'b1': z(4 * hidden), 'w2': z(4 * hidden, hidden), 'b2': z(hidden)}


def trace(f, *args):
  return lambda: jax.make_jaxpr(lambda *a: f(*a))(*args) and 0


def trace_figures(key):
  rows_apply, rows_init = {}, {}
  for depth in (F.depth, F.deep):
    x = jnp.ones((F.batch, F.hidden))
    hp = hand_params(depth, F.hidden)
    rows_apply[('hand-written JAX', depth)] = common.time_calls(
        trace(hand_scan_apply, hp, x), F.repeats)
    for name, nn in (('liftmods', lnn), ('flax.linen', fnn)):
      m = build(nn)(depth, F.hidden)
      v = m.init(key, x)
      rows_apply[(name, depth)] = common.time_calls(trace(m.apply, v, x),
                                                    F.repeats, warmup=2)
      rows_init[(name, depth)] = common.time_calls(trace(m.init, key, x),
                                                   F.repeats, warmup=2)
  for title, rows in (('scanned apply trace', rows_apply),
                      ('scanned init trace', rows_init)):
    for depth in (F.depth, F.deep):
      table = [(n, t) for (n, d), t in rows.items() if d == depth]
      common.print_table(f'{title} (depth={depth}, H={F.hidden})', table,
                         'flax.linen')
  print('\nflatness (deep / shallow, median):')
  for name in ('liftmods', 'flax.linen', 'hand-written JAX'):
    for title, rows in (('apply', rows_apply), ('init', rows_init)):
      if (name, F.depth) in rows:
        r = rows[(name, F.deep)]['median'] / rows[(name, F.depth)]['median']
        print(f'  {name:<18} {title:<6} D={F.deep}/D={F.depth}: {r:.2f}x')
  return rows_apply, rows_init


def dispatch_figures(key):
  hidden = F.dispatch_hidden
  x = jnp.ones((1, hidden))
  rows = []
  for name, nn in (('liftmods', lnn), ('flax.linen', fnn)):
    net = build(nn)
    v = net(F.depth, hidden).init(key, x)
    plain = jax.jit(net(F.depth, hidden).apply)
    lifted = nn.jit(net)(F.depth, hidden)
    rows.append((f'{name} jax.jit(apply)', common.time_calls(
        lambda: plain(v, x), 200, warmup=3)))
    rows.append((f'{name} nn.jit(Net)', common.time_calls(
        lambda: lifted.apply(v, x), 200, warmup=3)))
  common.print_table(f'eager call (depth={F.depth}, H={hidden}, batch 1)', rows,
                     'liftmods jax.jit(apply)')
  d = dict(rows)
  for name in ('liftmods', 'flax.linen'):
    r = d[f'{name} nn.jit(Net)']['median'] / d[f'{name} jax.jit(apply)']['median']
    print(f'  {name}: nn.jit / jax.jit = {r:.2f}x')
  return rows


def build_mlp(nn, layers: int, width: int):

  class MLP(nn.Module):

    @nn.compact
    def __call__(self, x):
      for _ in range(layers):
        x = nn.Dense(width)(x)
      return x

  return MLP


def mlp_dispatch_figures(key):
  """Eager ``nn.jit(MLP)().apply`` vs ``jax.jit(MLP().apply)``, timed in
  alternating rounds; the ratio reported is the median over rounds."""
  x = jnp.ones((F.mlp_batch, F.mlp_width))
  rows, ratios = [], {}
  for name, nn in (('liftmods', lnn), ('flax.linen', fnn)):
    mlp = build_mlp(nn, F.mlp_layers, F.mlp_width)
    v = mlp().init(key, x)
    plain = jax.jit(mlp().apply)
    lifted = nn.jit(mlp)()
    per_round = []
    for _ in range(F.dispatch_rounds):
      a = common.time_calls(lambda: plain(v, x), F.dispatch_calls, warmup=3)
      b = common.time_calls(lambda: lifted.apply(v, x), F.dispatch_calls,
                            warmup=3)
      per_round.append((a, b))
    ratios[name] = sorted(b['median'] / a['median'] for a, b in per_round)
    mid = per_round[len(per_round) // 2]
    rows.append((f'{name} jax.jit(apply)', mid[0]))
    rows.append((f'{name} nn.jit(MLP)', mid[1]))
  common.print_table(
      f'eager call ({F.mlp_layers}xDense({F.mlp_width}), batch '
      f'{F.mlp_batch})', rows, 'liftmods jax.jit(apply)')
  for name, rs in ratios.items():
    print(f'  {name}: nn.jit / jax.jit = {rs[len(rs) // 2]:.2f}x (median of '
          f'{len(rs)} rounds; range {rs[0]:.2f}-{rs[-1]:.2f}x)')
  return rows, ratios


def _blocked_calls(fn, calls):
  """Per-call seconds of ``calls`` blocked calls of ``fn``: (median, best)."""
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times), min(times)


def jit_overhead_figures(key):
  """nn.jit's eager-call cost on a tiny MLP and on the depth-``depth``
  scanned stack, as ratios to jax.jit of the same apply and to Linen's
  nn.jit. The four callables of a model are timed in alternating rounds
  (so load shared by all cancels); ratios are medians over rounds of
  per-round medians, and best call over best call."""
  mlp_x = jnp.ones((F.mlp_batch, F.mlp_width))
  stack_x = jnp.ones((1, F.dispatch_hidden))
  models = (
      (f'{F.mlp_layers}xDense({F.mlp_width}), batch {F.mlp_batch}',
       lambda nn: build_mlp(nn, F.mlp_layers, F.mlp_width), (), mlp_x),
      (f'scan depth {F.depth}, H={F.dispatch_hidden}, batch 1', build,
       (F.depth, F.dispatch_hidden), stack_x),
  )
  results = {}
  print('\nnn.jit eager call vs jax.jit and vs flax.linen nn.jit '
        f'({F.dispatch_rounds} alternating rounds x {F.dispatch_calls} '
        'blocked calls)')
  print(f'  {"model":<30}{"liftmods nn.jit":>16}{"jax.jit":>10}'
        f'{"/jax.jit":>10}{"(best)":>8}{"linen nn.jit":>14}{"/linen":>8}')
  for label, make, cfg, x in models:
    calls = {}
    for name, nn in (('liftmods', lnn), ('flax.linen', fnn)):
      cls = make(nn)
      v = cls(*cfg).init(key, x)
      plain, lifted = jax.jit(cls(*cfg).apply), nn.jit(cls)(*cfg)
      calls[f'{name} jax.jit'] = functools.partial(plain, v, x)
      calls[f'{name} nn.jit'] = functools.partial(lifted.apply, v, x)
    rounds = {name: [] for name in calls}
    for name, fn in calls.items():
      _blocked_calls(fn, 20)  # compile and warm up
    for _ in range(F.dispatch_rounds):
      for name, fn in calls.items():
        rounds[name].append(_blocked_calls(fn, F.dispatch_calls))

    def ratio(a, b, which=0):
      if which:
        return (min(r[1] for r in rounds[a]) / min(r[1] for r in rounds[b]))
      return statistics.median(
          ra[0] / rb[0] for ra, rb in zip(rounds[a], rounds[b]))

    ours = statistics.median(r[0] for r in rounds['liftmods nn.jit'])
    base = statistics.median(r[0] for r in rounds['liftmods jax.jit'])
    theirs = statistics.median(r[0] for r in rounds['flax.linen nn.jit'])
    row = {'vs_jax_jit': ratio('liftmods nn.jit', 'liftmods jax.jit'),
           'vs_jax_jit_best': ratio('liftmods nn.jit', 'liftmods jax.jit', 1),
           'vs_linen_nn_jit': ratio('liftmods nn.jit', 'flax.linen nn.jit'),
           'median_us': ours * 1e6, 'jax_jit_us': base * 1e6,
           'linen_us': theirs * 1e6}
    results[label] = row
    print(f'  {label:<30}{row["median_us"]:>14.1f}us{row["jax_jit_us"]:>8.1f}us'
          f'{row["vs_jax_jit"]:>9.2f}x{row["vs_jax_jit_best"]:>7.2f}x'
          f'{row["linen_us"]:>12.1f}us{row["vs_linen_nn_jit"]:>7.2f}x')
  return results


def identical_block_traces(key):
  """Traces of a jitted block used four times with one configuration, in
  a plain model and in a scan body."""
  x = jnp.ones((2, 8))
  print('\nnn.jit traces of 4 identical jitted blocks (init / apply / '
        'second apply)')
  out = {}
  for in_scan in (False, True):
    for name, nn in (('liftmods', lnn), ('flax.linen', fnn)):
      count = []

      class Block(nn.Module):

        @nn.compact
        def __call__(self, h):
          count.append(1)
          return nn.tanh(nn.Dense(8)(h))

      JBlock = nn.jit(Block)

      class Body(nn.Module):

        @nn.compact
        def __call__(self, c, _):
          for _ in range(4):
            c = JBlock()(c)
          return c, None

      class Scanned(nn.Module):

        @nn.compact
        def __call__(self, c):
          return nn.scan(Body, variable_axes={'params': 0},
                         split_rngs={'params': True}, length=3)()(c, None)[0]

      model = Scanned() if in_scan else nn.Sequential(
          [JBlock() for _ in range(4)])
      v = model.init(key, x)
      seq = [len(count)]
      for _ in range(2):
        model.apply(v, x)
        seq.append(len(count))
      counts = (seq[0], seq[1] - seq[0], seq[2] - seq[1])
      out[(name, in_scan)] = counts
      where = 'in a scan body' if in_scan else 'in a Sequential'
      print(f'  {where:<16} {name:<11} {counts[0]} / {counts[1]} / '
            f'{counts[2]}')
  return out


def memory_figures(key):
  depth, hidden = F.mem_depth, F.mem_hidden
  x = jnp.ones((F.mem_batch, hidden))
  print(f'\ngradient temp memory (D={depth}, H={hidden}, batch={F.mem_batch})')
  print(f'  {"stack":<14}{"liftmods":>12}{"flax.linen":>12}{"ratio":>8}')
  out = {}
  for stack in ('scan', 'remat_scan', 'scan_remat'):
    mib = {}
    for name, nn in (('liftmods', lnn), ('flax.linen', fnn)):
      m = build(nn, stack)(depth, hidden)
      v = m.init(key, x[:1])
      loss = lambda p, x: m.apply({'params': p}, x).sum()
      compiled = jax.jit(jax.grad(loss)).lower(v['params'], x).compile()
      mib[name] = compiled.memory_analysis().temp_size_in_bytes / 2**20
    out[stack] = mib
    print(f'  {stack:<14}{mib["liftmods"]:>10.1f}Mi{mib["flax.linen"]:>10.1f}Mi'
          f'{mib["liftmods"] / mib["flax.linen"]:>8.2f}')
  return out


def step_figures(key):
  x = jnp.ones((F.batch * 32, F.hidden))
  rows = []
  for name, nn in (('liftmods', lnn), ('flax.linen', fnn)):
    m = build(nn)(F.depth, F.hidden)
    v = m.init(key, x[:1])
    f = jax.jit(m.apply)
    rows.append((name, common.time_calls(lambda f=f, v=v: f(v, x), 30,
                                         warmup=3)))
  common.print_table('compiled scanned apply step', rows, 'flax.linen')
  return rows


def main(_):
  key = jax.random.key(0)
  sections = {'trace': trace_figures, 'jit': jit_overhead_figures,
              'dispatch': dispatch_figures,
              'mlp': mlp_dispatch_figures, 'blocks': identical_block_traces,
              'memory': memory_figures, 'step': step_figures}
  for name in F.sections:
    sections[name](key)


if __name__ == '__main__':
  app.run(main)
