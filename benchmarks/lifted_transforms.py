r"""Lifted-transform figures: liftmods vs flax.linen (vs hand-written JAX where
one exists), in one process.

1. Scanned residual-MLP stack (LayerNorm -> Dense(4H) -> gelu -> Dense(H)):
   apply/init trace time at two depths (flat in depth?).
2. Lifted jit dispatch: ``nn.jit(Net)().apply`` eager call vs ``jax.jit`` of
   the same apply.
3. Gradient temp memory (XLA memory_analysis of a jitted grad) for a plain
   scan, ``remat_scan(lengths=(8, 8))`` and a scan of per-layer remat.
4. Compiled step time of the scanned apply.

  python -m benchmarks.lifted_transforms --depth=24 --deep=96 --hidden=256
"""
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
  trace_figures(key)
  dispatch_figures(key)
  memory_figures(key)
  step_figures(key)


if __name__ == '__main__':
  app.run(main)
