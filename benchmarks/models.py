r"""Whole-model figures: liftmods vs flax.linen on three models, one process.

Each model is written once against a Linen-style namespace ``nn`` and built
twice, with ``liftmods`` and with ``flax.linen``; a start-up check confirms
both give the same parameters bit for bit. The figure is for one training
step ``(state, batch) -> (state, loss)`` (forward, backward, optax update):

  trace    ``jax.jit(step).trace(...)`` of a fresh wrapper: the Python cost
           of running the model code (module system + JAX tracing).
  lower    ``jax.jit(step).lower(...)`` of a fresh wrapper: trace + lowering
           to StableHLO, i.e. everything before XLA compiles.
  compile  ``lowered.compile()``: XLA compiling the (same) program.
  step     one call of the compiled step.
  forward  ``jax.jit(loss).trace(...)`` of the forward pass alone (no
           gradient, no optimizer): closer to the module system's own cost.

``--attribute`` also profiles one step trace per implementation and prints
the share of its time spent in liftmods / flax code versus JAX itself.

Models:
  lm       the demo language model, ``examples/lm/model.py`` loaded twice with
           its ``import liftmods as nn`` line swapped for ``flax.linen`` — the
           one-line change — and the demo's own train step;
  resnet   a small ResNet with BatchNorm (running statistics updated in the
           step) on 32x32 images;
  seq2seq  an LSTM encoder-decoder (``nn.RNN`` over ``OptimizedLSTMCell``)
           learning to reverse sequences;
  lm_qat   the demo language model trained with int8 quantization-aware
           training: ``qwix.quantize_model`` with ``QtProvider`` (int8
           weights and activations in every matmul), as in
           ``examples/quantize.py`` (not in the default ``--model`` list).

qwix is Linen code that binds ``flax.linen`` when it is imported, so for
``lm_qat`` it is imported twice, once under ``liftmods.compat``'s switch
(:func:`use_qwix`); each side's copy is put in force, outside the timed
calls, before that side is timed.

With ``--topology`` (``benchmarks/aot.py``) nothing is timed: each model's
train step, built with each library, is compiled for that TPU slice with the
batch split over all chips (mesh ``{'data': -1}``), the training state
replicated and donated, and the per-device ``aot`` rows of liftmods and
flax.linen are printed side by side (``--mode`` does not apply).

  python -m benchmarks.models --model=lm,resnet,seq2seq \
      --mode=trace,lower,compile,step --repeats=7
  python -m benchmarks.models --topology=v5e:2x2
"""
import functools
import gc
import importlib
import pathlib
import statistics
import sys
import time
import types

from absl import app, flags
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import liftmods as lnn
from benchmarks import aot
from liftmods import compat

MODELS = ('lm', 'resnet', 'seq2seq', 'lm_qat')
MODES = ('trace', 'lower', 'compile', 'step', 'forward')
flags.DEFINE_list('model', list(MODELS[:3]), f'models, from {MODELS}')
flags.DEFINE_list('mode', list(MODES), f'figures, from {MODES}')
flags.DEFINE_integer('repeats', 7, 'timed repetitions (interleaved)')
flags.DEFINE_integer('step_repeats', 20, 'timed repetitions for --mode=step')
flags.DEFINE_bool('attribute', False, 'profile one step trace per '
                  'implementation: time in module-system code vs JAX')
F = flags.FLAGS

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMPLS = (('liftmods', lnn), ('flax.linen', fnn))


# --- the models, each written once against `nn` -----------------------------

def lm_model_module(nn_name: str) -> types.ModuleType:
  """``examples/lm/model.py`` with its ``nn`` import pointed at ``nn_name``."""
  path = ROOT / 'examples' / 'lm' / 'model.py'
  line = 'import liftmods as nn\n'
  source = path.read_text()
  if source.count(line) != 1:
    raise RuntimeError(f'{path} must contain the line {line!r} exactly once')
  name = f'_lm_model_{nn_name.replace(".", "_")}'
  module = types.ModuleType(name)
  module.__file__ = str(path)
  sys.modules[name] = module
  exec(compile(source.replace(line, f'import {nn_name} as nn\n'), str(path),
               'exec'), module.__dict__)  # pylint: disable=exec-used
  return module


def lm(nn, quantize=None):
  """The demo LM's train step; ``quantize(model)`` (if given) is the model
  the step trains, from the plain model's initial state."""
  from examples.lm import train
  module = lm_model_module(nn.__name__)
  cfg = train.TrainConfig(model=module.Config())
  model = module.TransformerLM(cfg.model)
  optimizer = train.make_optimizer(cfg)
  state, _ = train.init_state(model, optimizer, seed=0, unbox=nn.unbox)
  if quantize is not None:
    model = quantize(model)
  rng = np.random.default_rng(0)
  batch = jnp.asarray(rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1)),
                      jnp.int32)
  step = train.make_train_step(model, optimizer, seed=0).__wrapped__

  def forward(state, batch):
    logits = model.apply({'params': state['params']}, batch[:, :-1])
    return train.cross_entropy(logits, batch[:, 1:])

  return step, state, batch, forward


def resnet(nn, stages=(2, 2, 2), width=16, classes=10, batch_size=32):

  class ResBlock(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
      norm = functools.partial(nn.BatchNorm, use_running_average=not train,
                               momentum=0.9)
      s = (self.strides, self.strides)
      y = nn.Conv(self.features, (3, 3), s, use_bias=False)(x)
      y = nn.relu(norm()(y))
      y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
      y = norm(scale_init=nn.initializers.zeros)(y)
      if x.shape != y.shape:
        x = nn.Conv(self.features, (1, 1), s, use_bias=False, name='proj')(x)
        x = norm(name='proj_norm')(x)
      return nn.relu(x + y)

  class ResNet(nn.Module):

    @nn.compact
    def __call__(self, x, train: bool = False):
      x = nn.Conv(width, (3, 3), use_bias=False)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
      for i, blocks in enumerate(stages):
        for j in range(blocks):
          x = ResBlock(width * 2**i, 2 if i and not j else 1)(x, train)
      return nn.Dense(classes)(x.mean((1, 2)))

  model = ResNet()
  images = jax.random.normal(jax.random.key(1), (batch_size, 32, 32, 3))
  labels = jax.random.randint(jax.random.key(2), (batch_size,), 0, classes)
  variables = model.init(jax.random.key(0), images[:1])
  optimizer = optax.sgd(0.1, momentum=0.9)
  state = {'params': variables['params'],
           'batch_stats': variables['batch_stats'],
           'opt_state': optimizer.init(variables['params'])}

  def loss_fn(params, batch_stats, batch):
    images, labels = batch
    logits, updates = model.apply(
        {'params': params, 'batch_stats': batch_stats}, images,
        train=True, mutable=['batch_stats'])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss.mean(), updates['batch_stats']

  def forward(state, batch):
    return loss_fn(state['params'], state['batch_stats'], batch)[0]

  def step(state, batch):
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state['params'], state['batch_stats'], batch)
    updates, opt_state = optimizer.update(grads, state['opt_state'])
    return {'params': optax.apply_updates(state['params'], updates),
            'batch_stats': stats, 'opt_state': opt_state}, loss

  return step, state, (images, labels), forward


def seq2seq(nn, vocab=32, features=128, length=24, batch_size=32):

  class Seq2seq(nn.Module):

    @nn.compact
    def __call__(self, source, target_in):
      embed = nn.Embed(vocab, features, name='embed')
      encoder = nn.RNN(nn.OptimizedLSTMCell(features), return_carry=True,
                       name='encoder')
      carry, _ = encoder(embed(source))
      ys = nn.RNN(nn.OptimizedLSTMCell(features), name='decoder')(
          embed(target_in), initial_carry=carry)
      return nn.Dense(vocab, name='out')(ys)

  model = Seq2seq()
  source = jax.random.randint(jax.random.key(1), (batch_size, length), 2,
                              vocab)
  target = jnp.flip(source, 1)
  target_in = jnp.concatenate([jnp.ones_like(target[:, :1]), target[:, :-1]],
                              1)  # 1 = start-of-sequence
  params = model.init(jax.random.key(0), source, target_in)['params']
  optimizer = optax.adam(1e-3)
  state = {'params': params, 'opt_state': optimizer.init(params)}

  def loss_fn(params, batch):
    source, target_in, target = batch
    logits = model.apply({'params': params}, source, target_in)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, target).mean()

  def forward(state, batch):
    return loss_fn(state['params'], batch)

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state['params'], batch)
    updates, opt_state = optimizer.update(grads, state['opt_state'])
    return {'params': optax.apply_updates(state['params'], updates),
            'opt_state': opt_state}, loss

  return step, state, (source, target_in, target), forward


# qwix's modules as imported against each library, and which is in force.
_QWIX = {}
_QWIX_IN_FORCE = [None]


def _qwix_entries():
  return {name: module for name, module in sys.modules.items()
          if name == 'qwix' or name.startswith('qwix.')}


def _import_qwix_twice():
  """Imports qwix against flax.linen, then again under the switch.

  flax.linen first, so that what qwix imports from the rest of flax
  (``flax.nnx`` binds ``flax.linen`` too) is flax's own on both sides."""
  if _qwix_entries():
    raise RuntimeError('lm_qat imports qwix itself, once per library; it '
                       'was imported before')
  importlib.import_module('qwix')
  for name in ('flax.linen', 'liftmods'):
    _QWIX[name] = _qwix_entries()
    for entry in _QWIX[name]:
      del sys.modules[entry]
    if name == 'flax.linen':
      with compat.flax_linen_as_liftmods(warn=False):
        importlib.import_module('qwix')
  assert _QWIX['liftmods']['qwix._src.model'].nn.Dense is lnn.Dense
  assert _QWIX['flax.linen']['qwix._src.model'].nn.Dense is fnn.Dense


def use_qwix(nn):
  """Puts the copy of qwix imported against ``nn`` in force and returns it.

  While it intercepts, qwix finds names such as ``flax.linen.Module.param``
  and its own ``qwix._src.qconfig.get_current_rule`` through ``sys.modules``,
  so its entries there, and the switch (installed for liftmods), must be
  that side's while a quantized model is built or traced. Costs a dict
  lookup when that side is in force already (the switch's install is 1-2
  ms), so ``measure`` calls it before each timed call, untimed."""
  if not _QWIX:
    _import_qwix_twice()
  if _QWIX_IN_FORCE[0] != nn.__name__:
    for entry in _qwix_entries():
      del sys.modules[entry]
    sys.modules.update(_QWIX[nn.__name__])
    if nn is lnn:
      compat.install(warn=False)
    else:
      compat.uninstall()
    _QWIX_IN_FORCE[0] = nn.__name__
  return sys.modules['qwix']


def lm_qat(nn):
  """The LM's train step under int8 QAT (qwix's ``QtProvider``)."""

  def quantize(model):
    qwix = use_qwix(nn)
    rule = qwix.QtRule(module_path='.*', weight_qtype='int8',
                       act_qtype='int8')
    return qwix.quantize_model(model, qwix.QtProvider([rule]))

  def in_force(fn):
    @functools.wraps(fn)
    def wrapped(*args):
      use_qwix(nn)
      return fn(*args)
    wrapped.prepare = lambda: use_qwix(nn)
    return wrapped

  use_qwix(fnn)  # the model file is loaded with the switch off
  step, state, batch, forward = lm(nn, quantize)
  return in_force(step), state, batch, in_force(forward)


BUILDERS = {'lm': lm, 'resnet': resnet, 'seq2seq': seq2seq,
            'lm_qat': lm_qat}


# --- measuring ---------------------------------------------------------------

def check_same(name, built):
  """Same initial state bit for bit, and the same loss after one step."""
  (step_a, state_a, batch, _), (step_b, state_b, _, _) = built.values()
  leaves_a = jax.tree_util.tree_leaves_with_path(state_a)
  leaves_b = jax.tree_util.tree_leaves_with_path(state_b)
  assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b], name
  for (path, a), (_, b) in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(a, b, err_msg=f'{name}{path}')
  loss_a = jax.jit(step_a)(state_a, batch)[1]
  loss_b = jax.jit(step_b)(state_b, batch)[1]
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
  n = sum(x.size for x in jax.tree_util.tree_leaves(state_a['params']))
  print(f'{name}: {n:,} parameters; liftmods and flax.linen init '
        f'bit-identical, first-step loss {float(loss_a):.4f} vs {float(loss_b):.4f}')


def fresh(step):
  return jax.jit(lambda state, batch: step(state, batch))


def timed_call(mode, step, state, batch, forward):
  """``(prepare, call)``: ``call()`` is one ``mode`` measurement, after an
  untimed ``prepare()`` (a fresh lowering for ``compile``, since a
  ``Lowered`` keeps its compiled executable)."""
  nothing = lambda: None
  if mode == 'forward':
    return nothing, lambda: fresh(forward).trace(state, batch)
  if mode == 'trace':
    return nothing, lambda: fresh(step).trace(state, batch)
  if mode == 'lower':
    return nothing, lambda: fresh(step).lower(state, batch)
  if mode == 'compile':
    lowered = []
    prepare = lambda: lowered.append(fresh(step).lower(state, batch))
    return prepare, lambda: lowered.pop().compile()
  compiled = fresh(step).lower(state, batch).compile()
  return nothing, lambda: jax.block_until_ready(compiled(state, batch))


def _side(args, call):
  """``prepare`` then ``call``'s: a step may need its side put in force
  first (``lm_qat``: :func:`use_qwix`), which stays out of the timing."""
  prepare, timed = call
  side = getattr(args[0], 'prepare', None)
  if side is None:
    return prepare, timed
  return lambda: (side(), prepare()), timed


def measure(mode, built, repeats):
  calls = {name: _side(args, timed_call(mode, *args))
           for name, args in built.items()}
  times = {name: [] for name in calls}
  for prepare, call in calls.values():  # warm-up: caches, first-call costs
    prepare()
    call()
  for _ in range(repeats):  # interleaved, so load drifts hit both alike
    for name, (prepare, call) in calls.items():
      prepare()
      gc.collect()
      gc.disable()  # as timeit does: no collection inside the timed call
      start = time.perf_counter()
      call()
      times[name].append(time.perf_counter() - start)
      gc.enable()
  return {name: statistics.median(t) for name, t in times.items()}


def attribute(model, built):
  """Shares of one step trace's profile: module-system code vs JAX."""
  import cProfile
  import pstats
  for name, (step, state, batch, _) in built.items():
    fresh(step).trace(state, batch)
    gc.collect()
    gc.disable()  # a collection would be charged to whichever frame ran
    profile = cProfile.Profile()
    profile.enable()
    fresh(step).trace(state, batch)
    profile.disable()
    gc.enable()
    stats = pstats.Stats(profile)
    shares = {}
    for (path, _, _), (_, _, own, _, _) in stats.stats.items():
      where = next((k for k in ('liftmods', 'flax', 'jax', 'optax', 'qwix')
                    if f'/{k}/' in path), 'other')
      shares[where] = shares.get(where, 0.0) + own
    total = sum(shares.values())
    print(f'  {model} step trace under cProfile, {name}: ' + ', '.join(
        f'{k} {v / total:.1%}' for k, v in sorted(shares.items())))


def fmt(seconds):
  return (f'{seconds * 1e3:.2f} ms' if seconds < 1 else f'{seconds:.2f} s')


# --- compiled for a TPU slice (--topology) ----------------------------------

def topology_mesh():
  """All chips of ``--topology`` on one ``data`` axis (no TPU needed;
  LibtpuMissingError without libtpu)."""
  return aot.topology_mesh(F.topology, {'data': -1})


def compile_step(model, name, nn, mesh):
  """``model``'s train step built with ``nn``, compiled for ``mesh``'s
  slice: the batch split over ``data``, the state replicated and donated."""
  step, state, batch, _ = BUILDERS[model](nn)
  state = aot.abstract(state, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  batch = aot.abstract(batch, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('data')))

  def lower():
    # Under the slice's mesh, so that nn.Stack sees the TPU as its target.
    with jax.set_mesh(mesh):
      return jax.jit(step, donate_argnums=0).lower(state, batch)

  report, _ = aot.compile_report(f'{model} {name}', lower)
  print(aot.table_row(report), flush=True)
  return report


def aot_main():
  mesh = topology_mesh()  # before any model is built: libtpu's settings
  print(f'topology={F.topology}, batch split over {mesh.size} chips, state '
        f'replicated; train steps compiled, not run; jax {jax.__version__}',
        flush=True)
  reports = {(model, name): compile_step(model, name, nn, mesh)
             for model in F.model for name, nn in IMPLS}
  aot.print_table(f'Train steps compiled for {F.topology}', reports.values())
  gflop = lambda r: 'n/a' if r.flops is None else f'{r.flops / 1e9:,.1f}'
  print('\nliftmods vs flax.linen, per device')
  for model in F.model:
    a, b = reports[model, 'liftmods'], reports[model, 'flax.linen']
    if a.fits and b.fits:
      print(f'  {model:<8} argument bytes equal: {a.argument == b.argument}; '
            f'temp {a.temp / aot.MIB:,.1f} vs {b.temp / aot.MIB:,.1f} MiB; '
            f'GFLOP {gflop(a)} vs {gflop(b)}')
  return reports


def main(_):
  for m in F.model:
    if m not in MODELS:
      raise app.UsageError(f'--model={m}: expected one of {MODELS}')
  if F.topology:
    aot_main()
    return
  for m in F.mode:
    if m not in MODES:
      raise app.UsageError(f'--mode={m}: expected one of {MODES}')
  rows = []
  for model in F.model:
    built = {name: BUILDERS[model](nn) for name, nn in IMPLS}
    check_same(model, built)
    if F.attribute:
      attribute(model, built)
    for mode in F.mode:
      repeats = F.step_repeats if mode == 'step' else F.repeats
      t = measure(mode, built, repeats)
      ratio = t['liftmods'] / t['flax.linen']
      rows.append((model, mode, t['liftmods'], t['flax.linen'], ratio))
      print(f'  {model:<8} {mode:<8} liftmods {fmt(t["liftmods"]):>10}  '
            f'flax.linen {fmt(t["flax.linen"]):>10}  ratio {ratio:.2f}',
            flush=True)
  print(f'\nmedians of {F.repeats} (step: {F.step_repeats}), interleaved\n')
  print('| model | figure | liftmods | flax.linen | liftmods / linen |')
  print('|---|---|---|---|---|')
  for model, mode, a, b, r in rows:
    print(f'| {model} | {mode} | {fmt(a)} | {fmt(b)} | **{r:.2f}** |')


if __name__ == '__main__':
  app.run(main)
