r"""Tracing overhead of an unscanned residual-MLP stack: liftmods vs flax.linen
vs hand-written JAX, in one process.

Model: ``depth`` blocks of LayerNorm -> Dense(4H) -> gelu -> Dense(H) with a
residual connection, batch 8. Figures: time to trace ``apply`` and ``init``
to a jaxpr (``jax.make_jaxpr``), the primitives each trace binds, and the
compiled apply step time. Apply traces are timed interleaved (one call of
each row per round), so load on the machine hits every row alike.

The bf16 rows trace the same model computing in bfloat16 with float32
parameters: liftmods and flax.linen with ``dtype``/``param_dtype`` passed to
every layer, and liftmods under ``nn.precision_policy`` with the layers
unchanged (the policy's cost is the difference between those two rows).

The hand-written apply computes exactly what the layers compute (the same
XLA program; checked bit for bit at start-up), so its ratio isolates the
module system's Python cost. ``init`` of a module runs the forward pass too
(it must, to learn shapes), so the init table also shows hand-written
init+forward next to parameter-only init.

  python -m benchmarks.trace_overhead --depth=24 --hidden=256 --repeats=7
"""
import statistics
import time

from absl import app, flags
import flax.linen as fnn
import jax
import jax.extend
import jax.numpy as jnp

import liftmods as lnn
from benchmarks import common

flags.DEFINE_integer('depth', 24, 'number of residual blocks')
flags.DEFINE_integer('hidden', 256, 'hidden width H')
flags.DEFINE_integer('batch', 8, 'batch size')
flags.DEFINE_integer('repeats', 7, 'timed repetitions per figure')
flags.DEFINE_integer('step_repeats', 50, 'timed repetitions of the compiled step')
F = flags.FLAGS


def build(nn, **layer_kwargs):
  """The benchmark model written once against a Linen-style namespace;
  ``layer_kwargs`` (e.g. ``dtype=``) go to every layer."""

  class Block(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm(**layer_kwargs)(x)
      h = nn.Dense(4 * self.hidden, **layer_kwargs)(h)
      h = nn.gelu(h)
      return x + nn.Dense(self.hidden, **layer_kwargs)(h)

  class Net(nn.Module):
    depth: int
    hidden: int

    @nn.compact
    def __call__(self, x):
      for _ in range(self.depth):
        x = Block(self.hidden)(x)
      return x

  return Net


def hand_init(key, x, depth, hidden):
  """Plain-JAX parameters with the same shapes and initializers."""
  lecun = jax.nn.initializers.lecun_normal()
  params = []
  for _ in range(depth):
    key, k1, k2 = jax.random.split(key, 3)
    params.append({
        'scale': jnp.ones((hidden,)), 'shift': jnp.zeros((hidden,)),
        'w1': lecun(k1, (x.shape[-1], 4 * hidden)), 'b1': jnp.zeros(4 * hidden),
        'w2': lecun(k2, (4 * hidden, hidden)), 'b2': jnp.zeros(hidden)})
  return params


def _layer_norm(x, scale, shift, eps=1e-6):
  mean = jnp.mean(x, -1)
  var = jnp.maximum(0., jnp.mean(jax.lax.square(x), -1) - jax.lax.square(mean))
  y = x - mean[:, None]
  return y * (jax.lax.rsqrt(var[:, None] + eps) * scale[None]) + shift[None]


def _dense(x, w, b):
  y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))
  return y + b[None]


def hand_apply(params, x):
  """The same computation (and XLA program) as the module version, written
  directly in JAX."""
  for p in params:
    h = _layer_norm(x, p['scale'], p['shift'])
    h = jax.nn.gelu(_dense(h, p['w1'], p['b1']))
    x = x + _dense(h, p['w2'], p['b2'])
  return x


def as_hand_params(variables, depth):
  """The module's parameters in the hand-written layout."""
  p = variables['params']
  return [{'scale': p[f'Block_{i}']['LayerNorm_0']['scale'],
           'shift': p[f'Block_{i}']['LayerNorm_0']['bias'],
           'w1': p[f'Block_{i}']['Dense_0']['kernel'],
           'b1': p[f'Block_{i}']['Dense_0']['bias'],
           'w2': p[f'Block_{i}']['Dense_1']['kernel'],
           'b2': p[f'Block_{i}']['Dense_1']['bias']} for i in range(depth)]


def bound_primitives(fn) -> int:
  """How many primitives ``fn()`` binds (every ``Primitive.bind``, nested
  ones included), counted by wrapping ``bind`` for the call."""
  primitive = jax.extend.core.Primitive
  original = primitive.bind
  count = 0

  def counting_bind(self, *args, **params):
    nonlocal count
    count += 1
    return original(self, *args, **params)

  primitive.bind = counting_bind
  try:
    fn()
  finally:
    primitive.bind = original
  return count


def time_interleaved(fns: dict, repeats: int) -> list:
  """``[(label, {'best', 'median'})]`` with one call of every ``fn`` per
  round, after one warm-up round; the order rotates by one row per round,
  so no row always follows the same neighbour."""
  for fn in fns.values():
    fn()
  times = {label: [] for label in fns}
  labels = list(fns)
  for r in range(repeats):
    for label in labels[r % len(labels):] + labels[:r % len(labels)]:
      start = time.perf_counter()
      fns[label]()
      times[label].append(time.perf_counter() - start)
  return [(label, {'best': min(t), 'median': statistics.median(t)})
          for label, t in times.items()]


def main(_):
  depth, hidden = F.depth, F.hidden
  x = jnp.ones((F.batch, hidden))
  key = jax.random.key(0)
  models = {'liftmods': build(lnn)(depth, hidden),
            'flax.linen': build(fnn)(depth, hidden)}
  variables = {k: m.init(key, x) for k, m in models.items()}
  hand_params = as_hand_params(variables['liftmods'], depth)
  same = jnp.array_equal(jax.jit(hand_apply)(hand_params, x),
                         jax.jit(models['liftmods'].apply)(
                             variables['liftmods'], x))
  print(f'hand-written apply equals liftmods apply bit for bit: {bool(same)}')

  def trace(f, *args):
    # A fresh wrapper per call defeats jax's trace cache: we time tracing.
    return lambda: jax.make_jaxpr(lambda *a: f(*a))(*args) and 0

  bf16 = {'dtype': jnp.bfloat16, 'param_dtype': jnp.float32}
  policy = lnn.Precision(compute_dtype=jnp.bfloat16, param_dtype=jnp.float32)
  threaded = {'liftmods': build(lnn, **bf16)(depth, hidden),
              'flax.linen': build(fnn, **bf16)(depth, hidden)}

  def under_policy(*args):
    with lnn.precision_policy(policy):
      return models['liftmods'].apply(*args)

  apply_fns = {'hand-written JAX': trace(hand_apply, hand_params, x)}
  for name, m in models.items():
    apply_fns[name] = trace(m.apply, variables[name], x)
  for name, m in threaded.items():
    apply_fns[f'{name} bf16 threaded'] = trace(m.apply, variables[name], x)
  apply_fns['liftmods bf16 policy'] = trace(under_policy,
                                            variables['liftmods'], x)
  apply_rows = time_interleaved(apply_fns, F.repeats)
  binds = {label: bound_primitives(fn) for label, fn in apply_fns.items()}
  def hand_init_with_output(k):
    params = hand_init(k, x, depth, hidden)
    return hand_apply(params, x), params

  init_rows = [('hand-written JAX', common.time_calls(
      trace(lambda k: hand_init(k, x, depth, hidden), key), F.repeats)),
               ('hand init+forward', common.time_calls(
                   trace(hand_init_with_output, key), F.repeats))]
  for name, m in models.items():
    init_rows.append((name, common.time_calls(
        trace(m.init, key, x), F.repeats)))
  common.print_table(f'apply trace (depth={depth}, H={hidden})', apply_rows,
                     'hand-written JAX')
  print('\nprimitives bound per apply trace (after a warm-up trace)')
  for label, count in binds.items():
    print(f'  {label:<28}{count:>8}')
  common.print_table(f'init trace (depth={depth}, H={hidden})', init_rows,
                     'hand-written JAX')

  step_rows = []
  for name, m in models.items():
    f = jax.jit(m.apply)
    step_rows.append((name, common.time_calls(
        lambda f=f, v=variables[name]: f(v, x), F.step_repeats, warmup=3)))
  hand = jax.jit(hand_apply)
  step_rows.append(('hand-written JAX', common.time_calls(
      lambda: hand(hand_params, x), F.step_repeats, warmup=3)))
  common.print_table('compiled apply step', step_rows, 'flax.linen')

  print('\nsummary:')
  print(f'  apply trace  liftmods/hand = '
        f'{common.ratio(apply_rows, "liftmods", "hand-written JAX"):.2f}x   '
        f'flax/liftmods = '
        f'{common.ratio(apply_rows, "flax.linen", "liftmods"):.2f}x')
  print(f'  init trace   liftmods/hand = '
        f'{common.ratio(init_rows, "liftmods", "hand-written JAX"):.2f}x   '
        f'liftmods/(hand init+forward) = '
        f'{common.ratio(init_rows, "liftmods", "hand init+forward"):.2f}x   '
        f'flax/liftmods = {common.ratio(init_rows, "flax.linen", "liftmods"):.2f}x')
  print(f'  compiled step liftmods/flax = '
        f'{common.ratio(step_rows, "liftmods", "flax.linen"):.3f}')
  print(f'  bf16 apply trace  policy/threaded (liftmods) = '
        f'{common.ratio(apply_rows, "liftmods bf16 policy", "liftmods bf16 threaded"):.2f}x   '
        f'liftmods policy/hand (f32) = '
        f'{common.ratio(apply_rows, "liftmods bf16 policy", "hand-written JAX"):.2f}x')


if __name__ == '__main__':
  app.run(main)
