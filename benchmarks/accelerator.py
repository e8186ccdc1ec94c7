r"""Figures on whatever accelerator this machine has: liftmods vs flax.linen.

One command (``make bench-accel``) that measures, on the first device of the
default backend (a GPU, a TPU, or the CPU at small sizes), in a few minutes:

lm     The LM of ``examples/lm`` (liftmods: ``nn.Stack(policy='full')``;
       flax.linen: its ``nn.scan(nn.remat(...))``) sized for the device by
       its memory, computing in bfloat16 with float32 parameters and AdamW
       state: liftmods through one ``nn.precision_policy``, Linen through
       bf16 layer classes (``benchmarks.scaling``'s). Figures: the AdamW
       train step's time (median and best over interleaved rounds, one
       library then the other), tokens/s, MFU (model FLOPs of
       ``benchmarks.scaling.model_flops`` per second over the device's peak
       dense bf16 FLOP/s, from ``PEAK_TFLOPS`` by device kind), trace+lower
       and compile seconds, the apply trace time (``jax.make_jaxpr`` of a
       fresh wrapper) and the eager call of ``nn.jit(TransformerLM)`` vs
       ``jax.jit`` of the same apply (a float32 forward of one sequence).
stack  ``benchmarks.stack``'s residual blocks under ``nn.Stack`` policies
       None / 'full' / 'nested' / 'offload' / nested+offload against
       Linen's ``nn.scan``, scan of ``nn.remat`` and ``nn.remat_scan``:
       the gradient's peak device memory from the device's own allocator
       statistics (``device.memory_stats()['peak_bytes_in_use']``, each row
       in a fresh process, since the peak cannot be reset), the compiler's
       estimate (``memory_analysis``) next to it, and step time (rows
       round-robin in one process). ``--stack_search`` also finds the
       largest depth that runs for 'full' and 'nested' (doubling, then
       bisection, each probe a fresh process).
jit    ``benchmarks.lifted_transforms``' eager-call figures (``nn.jit`` vs
       ``jax.jit`` vs Linen's ``nn.jit``) on a tiny MLP and a small scan.

One phase runs only when named (``--phases=lm,stack,jit,attention``):

attention  liftmods' LM step (the lm phase's size, batch and bf16 policy)
       with ``nn.fused_dot_product_attention`` (``is_causal=True``,
       ``--attention_implementation``: ``auto`` is ``'cudnn'`` on a GPU,
       ``'xla'`` elsewhere) against the same LM with Linen's attention and
       ``nn.make_causal_mask``, through ``examples/lm``'s
       ``Config.causal_attention_fn``: step time (interleaved rounds) and
       the ratio, compile time, and both first losses.

Each phase runs in a child process of its own, for three reasons: the
benchmark binaries it reuses define absl flags of the same names (``stack``
and ``models`` both define ``--repeats``), so they cannot share a process;
a device's peak memory counter only grows, so peaks need fresh processes;
and a phase that runs out of memory or time is recorded and the others go
on. The parent never starts a JAX backend (on a GPU it would reserve memory
the children need). Each phase has a time budget (``--lm_budget_s``, ...):
its child stops timing rounds when it is spent and is killed 20 s after.
After every phase ``accelerator.json`` (every figure, the device kind and
the jax/jaxlib/flax versions) and ``accelerator.md`` (one table) are
rewritten under ``--out_dir``, so an interrupted run keeps what it measured.

Sizes come from ``--preset``: ``device`` (a GPU or TPU; the LM size from the
device's memory: 1B parameters with 40 GiB or more for the allocator),
``cpu`` (the demo LM's size) or ``tiny`` (the test suite's smoke run);
``auto`` picks ``device`` or ``cpu`` by backend. Any size flag set to a
non-zero value overrides the preset.

  python -m benchmarks.accelerator                       # make bench-accel
  python -m benchmarks.accelerator --phases=stack --stack_search
  python -m benchmarks.accelerator --lm_size=350m --lm_batch=16
  python -m benchmarks.accelerator --preset=tiny --out_dir=/tmp/accel
  python -m benchmarks.accelerator --require_backend=gpu  # never CPU figures

On a GPU machine whose Python already has a CUDA JAX (and no network), run
it in that environment: ``make bench-accel VENV= PY=python3
ACCEL_REQUIRE=gpu`` (docs/benchmarks.md, "On a GPU or TPU").
"""
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import aot, common
import liftmods as lnn
from liftmods.stack import offload_supported

PHASES = ('lm', 'stack', 'jit')
OPTIONAL_PHASES = ('attention',)  # run only when --phases names them
REQUIRABLE = ('gpu', 'tpu', 'accelerator')  # --require_backend's choices
# benchmarks.stack's row labels measured here, each with the row it is
# compared with in the table.
STACK_ROWS = ('liftmods_none', 'liftmods_full', 'liftmods_nested',
              'offload_carries', 'offload_nested', 'linen_scan',
              'linen_scan_remat', 'linen_remat_scan_8x8')
STACK_TABLE = (('liftmods_none', 'linen_scan'),
               ('liftmods_full', 'linen_scan_remat'),
               ('liftmods_nested', 'linen_remat_scan_8x8'),
               ('liftmods_nested', 'linen_scan_remat'),
               ('offload_carries', 'linen_scan_remat'),
               ('offload_nested', 'linen_remat_scan_8x8'))
SEARCH_ROWS = ('liftmods_full', 'liftmods_nested')
# LM sizes besides benchmarks.scaling.SIZES: vocab, seq, layers, heads, d.
LM_SIZES = {'tiny': (256, 32, 2, 2, 32), 'demo': (256, 128, 4, 4, 128),
            '350m': (32768, 2048, 24, 16, 1024)}
# (GiB the device's allocator may use, LM size), largest first.
DEVICE_LM_SIZES = ((40, '1b'), (20, '350m'), (0, '125m'))
PRESETS = {
    'device': dict(lm_size='', lm_batch=8, lm_rounds=5, lm_steps=3,
                   lm_jit_calls=20, stack_depth=64, stack_hidden=512,
                   stack_batch=16384, stack_rounds=5, search_step=64,
                   jit_depth=24, jit_rounds=5, jit_calls=300),
    'cpu': dict(lm_size='demo', lm_batch=8, lm_rounds=5, lm_steps=3,
                lm_jit_calls=20, stack_depth=64, stack_hidden=64,
                stack_batch=512, stack_rounds=5, search_step=16,
                jit_depth=24, jit_rounds=5, jit_calls=200),
    'tiny': dict(lm_size='tiny', lm_batch=2, lm_rounds=2, lm_steps=2,
                 lm_jit_calls=5, stack_depth=8, stack_hidden=16,
                 stack_batch=32, stack_rounds=2, search_step=8,
                 jit_depth=4, jit_rounds=2, jit_calls=10),
}
# Peak dense bfloat16 TFLOP/s per chip (no sparsity), by a substring of
# jax's device_kind, most specific first: NVIDIA's data sheets (H100 SXM /
# PCIe / NVL, H200, GH200, A100, L40S, L4, A10, B200) and, for TPUs,
# benchmarks.aot.CHIPS (Cloud TPU docs).
PEAK_TFLOPS = (
    ('H100 PCIe', 756), ('H100 NVL', 835), ('H100', 989), ('GH200', 989),
    ('H200 NVL', 835), ('H200', 989), ('B200', 2250), ('A100', 312),
    ('L40S', 362), ('L4', 121), ('A10', 125),
    ('TPU v6 lite', aot.CHIPS['v6e']['peak_flops'] / 1e12),
    ('TPU v5 lite', aot.CHIPS['v5e']['peak_flops'] / 1e12),
    ('TPU v5', aot.CHIPS['v5p']['peak_flops'] / 1e12),
    ('TPU v4', aot.CHIPS['v4']['peak_flops'] / 1e12),
)
ROOT = pathlib.Path(__file__).resolve().parent.parent
GRACE_S = 20  # a child is killed this long after its budget
MIB = 2.0**20

flags.DEFINE_string('out_dir', 'bench-out/accel',
                    'where accelerator.json and accelerator.md are written')
flags.DEFINE_list('phases', list(PHASES), 'phases to run, from '
                  f'{PHASES + OPTIONAL_PHASES}')
flags.DEFINE_enum('preset', 'auto', ['auto', *PRESETS],
                  'sizes: device (GPU/TPU), cpu, tiny (smoke test); auto: '
                  'device or cpu by backend')
# Size flags: 0 or '' (the default) takes the preset's value.
SIZE_FLAGS = {
    'lm_size': 'LM size: tiny, demo, 125m, 350m, 1b, 8b, 70b (on a device '
               'the preset picks one by memory)',
    'lm_batch': 'LM sequences per step',
    'lm_rounds': 'interleaved rounds of LM steps, traces and eager calls',
    'lm_steps': 'timed LM steps per library per round',
    'lm_jit_calls': 'eager LM forward calls per round',
    'stack_depth': 'stack depth (a multiple of 8: remat_scan runs 8 x D/8)',
    'stack_hidden': 'stack width H',
    'stack_batch': 'stack batch',
    'stack_rounds': 'round-robin rounds of stack steps',
    'search_step': 'depth resolution of --stack_search',
    'jit_depth': 'depth of the eager-call scan model',
    'jit_rounds': 'alternating rounds of eager calls',
    'jit_calls': 'blocked eager calls per round',
}
for _name, _help in SIZE_FLAGS.items():
  if isinstance(PRESETS['cpu'][_name], str):
    flags.DEFINE_string(_name, '', _help)
  else:
    flags.DEFINE_integer(_name, 0, _help)
BUDGETS = {'lm': 220, 'stack': 150, 'search': 180, 'jit': 50,
           'attention': 200}
for _name, _seconds in BUDGETS.items():
  flags.DEFINE_float(f'{_name}_budget_s', _seconds,
                     f'seconds for the {_name} phase (its child is stopped '
                     f'{GRACE_S} s after)')
flags.DEFINE_list('stack_rows', list(STACK_ROWS),
                  'benchmarks.stack rows to measure')
flags.DEFINE_enum('stack_isolate', 'auto', ['auto', 'always', 'never'],
                  'measure each stack row\'s device peak in a fresh process '
                  '(auto: where the device reports memory_stats)')
flags.DEFINE_bool('stack_search', False, 'also find the largest depth that '
                  'runs for policy full and nested (--search_budget_s)')
flags.DEFINE_float('peak_tflops', 0, 'peak bf16 TFLOP/s for MFU (0: from '
                   'the device kind)')
flags.DEFINE_enum('require_backend', '', ['', *REQUIRABLE],
                  'refuse to measure unless JAX\'s default backend is this '
                  '(accelerator: any but the CPU), so that CPU figures are '
                  'never reported as GPU or TPU ones')
flags.DEFINE_enum('attention_implementation', 'auto',
                  ['auto', 'default', 'xla', 'cudnn'],
                  'implementation= of the attention phase\'s fused attention '
                  '(auto: cudnn on a GPU, else xla; default: JAX\'s choice)')
flags.DEFINE_string('child', '', 'internal: run this part here')
flags.DEFINE_string('child_out', '', 'internal: the child\'s JSON file')
flags.DEFINE_float('child_budget_s', 0, 'internal: the child\'s seconds')
F = flags.FLAGS


# --- shared by the children ---------------------------------------------------


def preset() -> str:
  if F.preset != 'auto':
    return F.preset
  return 'cpu' if jax.default_backend() == 'cpu' else 'device'


def setting(name: str):
  """A size flag's value, or the preset's where the flag is left at 0/''."""
  return getattr(F, name) or PRESETS[preset()][name]


def device_info() -> dict:
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  return {'backend': jax.default_backend(), 'kind': device.device_kind,
          'count': jax.device_count(),
          'platform_version': getattr(device.client, 'platform_version', ''),
          'memory_kinds': sorted(m.kind for m in device.addressable_memories()),
          'memory_stats': bool(stats), 'bytes_limit': stats.get('bytes_limit')}


def peak_tflops(kind: str, override: float = 0.0) -> tuple[float | None, str]:
  """``(peak dense bf16 TFLOP/s, where it comes from)`` for a device kind
  (``override``, if non-zero, wins)."""
  if override:
    return override, '--peak_tflops'
  for name, tflops in PEAK_TFLOPS:
    if name.lower() in kind.lower():
      return tflops, f'PEAK_TFLOPS[{name!r}]'
  return None, f'no peak known for {kind!r}: pass --peak_tflops'


def alternating(calls: dict, rounds: int, per_round: int,
                budget_s: float) -> dict:
  """Times ``calls`` ({label: fn}, each call blocked) in rounds of
  ``per_round`` calls per label, the label order rotating by one each
  round, so that load changes hit every label alike. Stops early, after at
  least two rounds, once ``budget_s`` has passed. Returns {label: {median,
  best, rounds}} with ``rounds`` the per-round medians (seconds)."""
  labels, start = list(calls), time.perf_counter()
  out = {label: {'rounds': [], 'best': float('inf')} for label in labels}
  for r in range(rounds):
    for label in labels[r % len(labels):] + labels[:r % len(labels)]:
      t = common.time_calls(calls[label], per_round, warmup=0)
      out[label]['rounds'].append(t['median'])
      out[label]['best'] = min(out[label]['best'], t['best'])
    if r and time.perf_counter() - start > budget_s:
      break
  for t in out.values():
    t['median'] = statistics.median(t['rounds'])
  return out


def ratio(timed: dict, a: str, b: str) -> dict:
  """``a / b``: the median over rounds of per-round ratios, and best over
  best."""
  per_round = [x / y for x, y in zip(timed[a]['rounds'], timed[b]['rounds'])]
  return {'median': statistics.median(per_round),
          'best': timed[a]['best'] / timed[b]['best']}


def first_line(error: BaseException) -> str:
  return f'{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}'


def out_of_memory(error: BaseException) -> bool:
  return 'RESOURCE_EXHAUSTED' in str(error) or 'out of memory' in str(
      error).lower()


class Record(dict):
  """The child's results, written to ``--child_out`` on every ``save``."""

  def save(self):
    pathlib.Path(F.child_out).write_text(json.dumps(self, indent=1))


# --- lm: the examples/lm train step -------------------------------------------


class Stepper:
  """Calls a compiled, donating train step, keeping the state it returns."""

  def __init__(self, compiled, state, batch):
    self.compiled, self.state, self.batch = compiled, state, batch

  def __call__(self):
    self.state, loss = self.compiled(self.state, self.batch)
    return loss


def lm_size() -> str:
  size = setting('lm_size')
  if size:
    return size
  limit = (jax.devices()[0].memory_stats() or {}).get('bytes_limit', 0)
  return next(s for gib, s in DEVICE_LM_SIZES if limit >= gib * 2.0**30)


def compile_step(model, optimizer, tokens, unbox, library: str):
  """``model``'s train step lowered under ``library``'s bf16 policy and
  compiled: ``(Stepper, {'lower_s', 'compile_s', 'first_loss'})``."""
  from benchmarks import scaling  # pylint: disable=import-outside-toplevel
  from examples.lm import train as lm_train  # pylint: disable=import-outside-toplevel
  state, _ = lm_train.init_state(model, optimizer, 0, unbox=unbox)
  step = lm_train.make_train_step(model, optimizer, 0)
  start = time.perf_counter()
  with scaling.precision_scope(library, 'bf16'):
    lowered = step.lower(state, tokens)
  lowered_at = time.perf_counter()
  stepper = Stepper(lowered.compile(), state, tokens)
  compiled_at = time.perf_counter()
  return stepper, {'lower_s': lowered_at - start,
                   'compile_s': compiled_at - lowered_at,
                   'first_loss': float(stepper())}


def lm_child(rec: Record, deadline: float):
  from benchmarks import scaling  # pylint: disable=import-outside-toplevel
  import flax.linen as fnn  # pylint: disable=import-outside-toplevel
  from examples.lm import model as lm  # pylint: disable=import-outside-toplevel
  from examples.lm import train as lm_train  # pylint: disable=import-outside-toplevel

  size, batch = lm_size(), setting('lm_batch')
  cfg = lm.Config(*{**scaling.SIZES, **LM_SIZES}[size], mlp_ratio=4,
                  dropout_rate=0.0)
  flops = scaling.model_flops(cfg, batch)
  peak, source = peak_tflops(rec['device']['kind'], F.peak_tflops)
  rec.update(size=size, batch=batch, seq=cfg.max_len, layers=cfg.num_layers,
             d_model=cfg.d_model, params=scaling.n_params(cfg),
             tokens_per_step=batch * cfg.max_len, model_flops_per_step=flops,
             peak_tflops=peak, peak_source=source)
  print(f'lm: {size} ({rec["params"] / 1e6:,.1f}M parameters), batch '
        f'{batch} x {cfg.max_len}, bf16 compute', flush=True)
  models = {'liftmods': lm.TransformerLM(cfg),
            'flax.linen': scaling.linen_lm('bf16').TransformerLM(cfg)}
  unbox = {'liftmods': lnn.unbox, 'flax.linen': fnn.unbox}
  optimizer = lm_train.make_optimizer(lm_train.TrainConfig())
  tokens = jnp.asarray(np.random.default_rng(0).integers(
      0, cfg.vocab_size, (batch, cfg.max_len + 1)), jnp.int32)
  steppers = {}
  for name, model in models.items():
    steppers[name], rec[name] = compile_step(model, optimizer, tokens,
                                             unbox[name], name)
    print(f'  {name}: lowered in {rec[name]["lower_s"]:.1f} s, compiled in '
          f'{rec[name]["compile_s"]:.1f} s, first loss '
          f'{rec[name]["first_loss"]:.4f}', flush=True)
    rec.save()

  remaining = lambda share: share * max(0.0, deadline - time.perf_counter())
  timed = alternating(steppers, setting('lm_rounds'), setting('lm_steps'),
                      remaining(0.5))
  for name, t in timed.items():
    rec[name].update(step_median_s=t['median'], step_best_s=t['best'],
                     step_rounds_s=t['rounds'],
                     tokens_per_s=batch * cfg.max_len / t['median'],
                     mfu=flops / t['median'] / (peak * 1e12) if peak else None)
  rec['step_ratio'] = ratio(timed, 'liftmods', 'flax.linen')
  rec['compile_ratio'] = (rec['liftmods']['compile_s'] /
                          rec['flax.linen']['compile_s'])
  rec.save()

  def trace(name):
    model, params = models[name], steppers[name].state['params']

    def call():
      with scaling.precision_scope(name, 'bf16'):
        jax.make_jaxpr(lambda p, t: model.apply({'params': p}, t))(
            params, tokens[:, :-1])

    return call

  traced = alternating({name: trace(name) for name in models},
                       setting('lm_rounds'), 1, remaining(0.3))
  rec['trace'] = {name: {'median_s': t['median'], 'best_s': t['best']}
                  for name, t in traced.items()}
  rec['trace']['ratio'] = ratio(traced, 'liftmods', 'flax.linen')
  rec.save()

  # The eager call of nn.jit(TransformerLM) against jax.jit of the same
  # apply: one float32 forward of one sequence, nothing mutable, no rngs.
  params, one = steppers['liftmods'].state['params'], tokens[:1, :-1]
  lifted = lnn.jit(lm.TransformerLM)(cfg)
  calls = {'nn.jit': lambda: lifted.apply({'params': params}, one),
           'jax.jit': lambda f=jax.jit(models['liftmods'].apply):
                      f({'params': params}, one)}
  for call in calls.values():
    jax.block_until_ready(call())
  called = alternating(calls, setting('lm_rounds'), setting('lm_jit_calls'),
                       remaining(0.9))
  rec['forward_call'] = {name: {'median_s': t['median'], 'best_s': t['best']}
                         for name, t in called.items()}
  rec['forward_call']['ratio'] = ratio(called, 'nn.jit', 'jax.jit')
  rec.save()


# --- attention: the LM step with fused attention -----------------------------


def attention_implementation() -> str | None:
  choice = F.attention_implementation
  if choice == 'auto':
    return 'cudnn' if jax.default_backend() == 'gpu' else 'xla'
  return None if choice == 'default' else choice


def attention_child(rec: Record, deadline: float):
  """liftmods' LM train step with Linen's attention and with
  ``nn.fused_dot_product_attention``, interleaved (same parameters, same
  batch, bf16 policy)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import functools  # pylint: disable=import-outside-toplevel
  from benchmarks import scaling  # pylint: disable=import-outside-toplevel
  from examples.lm import model as lm  # pylint: disable=import-outside-toplevel
  from examples.lm import train as lm_train  # pylint: disable=import-outside-toplevel

  size, batch = lm_size(), setting('lm_batch')
  implementation = attention_implementation()
  cfg = lm.Config(*{**scaling.SIZES, **LM_SIZES}[size], mlp_ratio=4,
                  dropout_rate=0.0)
  # fallback=False: a call the fused path cannot take fails the phase
  # rather than timing the default path twice.
  fused = functools.partial(lnn.fused_dot_product_attention,
                            implementation=implementation, is_causal=True,
                            fallback=False)
  configs = {'default': cfg,
             'fused': dataclasses.replace(cfg, causal_attention_fn=fused)}
  rec.update(size=size, batch=batch, seq=cfg.max_len,
             heads=cfg.num_heads, head_dim=cfg.d_model // cfg.num_heads,
             implementation=implementation or 'default')
  print(f'attention: LM {size}, batch {batch} x {cfg.max_len}, fused '
        f'implementation={implementation}', flush=True)
  optimizer = lm_train.make_optimizer(lm_train.TrainConfig())
  tokens = jnp.asarray(np.random.default_rng(0).integers(
      0, cfg.vocab_size, (batch, cfg.max_len + 1)), jnp.int32)
  steppers = {}
  for name, config in configs.items():
    steppers[name], rec[name] = compile_step(
        lm.TransformerLM(config), optimizer, tokens, lnn.unbox, 'liftmods')
    print(f'  {name}: compiled in {rec[name]["compile_s"]:.1f} s, first '
          f'loss {rec[name]["first_loss"]:.4f}', flush=True)
    rec.save()
  timed = alternating(steppers, setting('lm_rounds'), setting('lm_steps'),
                      0.9 * max(0.0, deadline - time.perf_counter()))
  for name, t in timed.items():
    rec[name].update(step_median_s=t['median'], step_best_s=t['best'],
                     step_rounds_s=t['rounds'],
                     tokens_per_s=batch * cfg.max_len / t['median'])
  rec['step_ratio'] = ratio(timed, 'fused', 'default')
  rec.save()


# --- stack: nn.Stack policies vs Linen ----------------------------------------


def stack_models(sb, depth: int, hidden: int) -> dict:
  """``{label: model}`` of ``benchmarks.stack``'s rows in --stack_rows."""
  models = {label: model for label, d, model in sb.rows(depth, hidden)
            if d == depth}
  unknown = set(F.stack_rows) - set(models)
  if unknown:
    raise app.UsageError(f'--stack_rows: unknown {sorted(unknown)}')
  return {label: models[label] for label in F.stack_rows}


def stack_child(rec: Record, deadline: float, probe: bool):
  """Compiles and runs the gradient of every row of --stack_rows.

  With ``probe`` (one row per fresh process) records the device's peak
  memory and whether it runs at all; otherwise also times the rows
  round-robin."""
  from benchmarks import stack as sb  # pylint: disable=import-outside-toplevel
  F.compile_repeats = 1  # benchmarks.stack's flag: compile each row once
  depth, hidden = setting('stack_depth'), setting('stack_hidden')
  device = jax.devices()[0]
  x = jax.random.normal(jax.random.key(1), (setting('stack_batch'), hidden))
  key = jax.random.key(0)
  # One set of variables for all rows (remat_scan's reshaped from it), or
  # in a probe the row's own only, so that its peak holds nothing else.
  v = None if probe else sb.stack_net(depth, hidden).init(key, x[:1])
  rec.update(depth=depth, hidden=hidden, batch=setting('stack_batch'),
             offload_supported=offload_supported(), rows={})
  compiled = {}
  for label, model in stack_models(sb, depth, hidden).items():
    row = rec['rows'][label] = {}
    if probe:
      args = jax.jit(model.init)(key, x[:1])
    else:
      args = sb.remat_scan_layout(v, depth) if 'remat_scan' in label else v
    # The device's peak counter only grows: a row's own peak needs a
    # fresh process (probe).
    before = device.memory_stats() if probe else None
    try:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always', lnn.StackOffloadWarning)
        _, _, compile_s, fn = sb.measure(model, args, x)
        jax.block_until_ready(fn(args))
    except Exception as e:  # pylint: disable=broad-except
      row.update(fits=False, status=('does not fit: ' if out_of_memory(e)
                                     else 'failed: ') + first_line(e))
      print(f'  {label}: {row["status"]}', flush=True)
      rec.save()
      continue
    report = aot.report_from(label, fn, compile_s)
    row.update(fits=True, status='ok', compile_s=compile_s,
               compiler_peak_bytes=report.peak, compiler_temp_bytes=report.temp,
               compiler_host_bytes=report.host)
    if label.startswith('offload'):
      unsupported = [w for w in caught
                     if issubclass(w.category, lnn.StackOffloadWarning)]
      row['offload'] = ('pinned host memory' if not unsupported else
                        f'unsupported: {unsupported[0].message}')
    if before is not None:
      after = device.memory_stats()
      row.update(device_peak_bytes=after['peak_bytes_in_use'],
                 live_before_bytes=before['bytes_in_use'])
    compiled[label] = lambda fn=fn, args=args: fn(args)
    print(f'  {label}: compiler peak {_mib(report.peak)} (temp '
          f'{_mib(report.temp)}, host {_mib(report.host)}), device peak '
          f'{_mib(row.get("device_peak_bytes"))}, compile {compile_s:.2f} s',
          flush=True)
    rec.save()
  if probe or not compiled:
    return
  timed = alternating(compiled, setting('stack_rounds'), 1,
                      0.8 * max(0.0, deadline - time.perf_counter()))
  for label, t in timed.items():
    rec['rows'][label].update(step_median_s=t['median'], step_best_s=t['best'],
                              step_rounds_s=t['rounds'])
  rec['step_ratios'] = {f'{a}/{b}': ratio(timed, a, b)
                        for a, b in dict.fromkeys(STACK_TABLE + sb.PAIRS)
                        if a in timed and b in timed}
  rec.save()


# --- jit: eager dispatch on tiny models --------------------------------------


def jit_child(rec: Record, deadline: float):
  del deadline  # the rounds are short; the parent's timeout bounds them
  from benchmarks import lifted_transforms as lt  # pylint: disable=import-outside-toplevel
  F.depth = setting('jit_depth')  # benchmarks.lifted_transforms' flags
  F.dispatch_rounds, F.dispatch_calls = (setting('jit_rounds'),
                                         setting('jit_calls'))
  rec['models'] = lt.jit_overhead_figures(jax.random.key(0))
  rec.save()


CHILDREN = {'device': lambda rec, deadline: None, 'lm': lm_child, 'stack': lambda rec, deadline: stack_child(
    rec, deadline, probe=False), 'stack_probe': lambda rec, deadline:
            stack_child(rec, deadline, probe=True), 'jit': jit_child,
            'attention': attention_child}


def run_child():
  start = time.perf_counter()
  rec = Record(device=device_info(), preset=preset(), status='running')
  rec.save()
  try:
    CHILDREN[F.child](rec, start + 0.85 * F.child_budget_s)
    rec['status'] = 'ok'
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    rec.update(status=first_line(e), oom=out_of_memory(e))
  rec['wall_s'] = time.perf_counter() - start
  rec.save()


# --- the parent: one child per phase (and per isolated row) -------------------


def spawn(part: str, budget_s: float, *extra: str) -> dict:
  """Runs ``--child=part`` in a fresh process with this command's flags
  (``extra`` override them); returns its record, its ``status`` saying
  how it ended."""
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / 'child.json'
    command = [sys.executable, '-m', 'benchmarks.accelerator', *sys.argv[1:],
               f'--child={part}', f'--child_out={path}',
               f'--child_budget_s={budget_s}', *extra]
    status = None
    try:
      code = subprocess.run(command, cwd=ROOT, timeout=budget_s + GRACE_S,
                            check=False).returncode
      if code:
        status = f'exited with {code}'
    except subprocess.TimeoutExpired:
      status = f'killed after {budget_s + GRACE_S:.0f} s (its budget)'
    rec = json.loads(path.read_text()) if path.exists() else {}
  if status or 'status' not in rec:
    rec['status'] = status or 'no record'
  return rec


def backend_refusal(required: str, device: dict) -> str | None:
  """Why figures measured on ``device`` (a ``device_info()`` record) must
  not be reported when ``--require_backend=required`` was asked for, or
  None when they may."""
  backend = device.get('backend')
  if not required or backend == required or (
      required == 'accelerator' and backend not in (None, 'cpu')):
    return None
  return (f'--require_backend={required}, but JAX\'s default backend in '
          f'this environment is {backend!r} ({device.get("kind")}); no '
          'figures are measured, so none can pass for accelerator ones. '
          'On a machine with a CUDA JAX already installed run in that '
          'environment (make bench-accel VENV= PY=python3); with network, '
          'pip install -e \'.[cuda13]\' (or .[cuda12], .[tpu]) first. '
          'docs/benchmarks.md, "On a GPU or TPU".')


def check_backend(results: dict):
  """Records the device a child sees; stops the run (exit status 1) when
  it is not the backend ``--require_backend`` asked for."""
  if not F.require_backend:
    return
  rec = spawn('device', 120)
  results['device'] = rec.get('device') or {}
  results['required_backend'] = F.require_backend
  refusal = backend_refusal(F.require_backend, results['device'])
  if refusal:
    sys.exit(f'benchmarks.accelerator: refusing to run: {refusal}')


def note_device(results: dict, rec: dict):
  if not results.get('device'):
    results['device'] = rec.get('device')


def run_lm(results: dict):
  deadline = time.perf_counter() + F.lm_budget_s
  sizes = [s for _, s in DEVICE_LM_SIZES]
  extra, too_large = (), []
  while True:
    rec = spawn('lm', max(0.0, deadline - time.perf_counter()), *extra)
    size = rec.get('size')
    # Too large for the device: the next size down, while time is left.
    if not (rec.get('oom') and size in sizes[:-1] and not F.lm_size and
            deadline - time.perf_counter() > 60):
      break
    too_large.append(size)
    extra = (f'--lm_size={sizes[sizes.index(size) + 1]}',)
  results['lm'] = dict(rec, out_of_memory_sizes=too_large)
  note_device(results, rec)


def run_stack(results: dict):
  deadline = time.perf_counter() + F.stack_budget_s
  rec = spawn('stack', F.stack_budget_s)
  results['stack'] = rec
  note_device(results, rec)
  stats = (rec.get('device') or {}).get('memory_stats')
  isolate = F.stack_isolate == 'always' or (F.stack_isolate == 'auto' and
                                            stats)
  rec['device_peak'] = ('each row in a fresh process' if isolate else
                        'not measured: the backend reports no memory_stats'
                        if not stats else 'not measured (--stack_isolate)')
  for label in rec.get('rows', {}) if isolate else ():
    left = deadline - time.perf_counter()
    row = rec['rows'][label]
    if left < 5:
      row['device_peak'] = 'skipped: the stack budget is spent'
      continue
    got = probe_row(label, rec['depth'], left)
    for key in ('device_peak_bytes', 'live_before_bytes'):
      if key in got:
        row[key] = got[key]
    row['device_peak'] = got['status']
  if F.stack_search:
    settings = PRESETS[rec.get('preset', 'device')]
    rec['search'] = search_depths(
        rec, F.search_step or settings['search_step'], F.search_budget_s,
        probe_row)


def probe_row(label: str, depth: int, seconds: float) -> dict:
  """One stack row at ``depth`` compiled and run in a fresh process: its
  record (``fits``, ``status``, device peak), or its process's status."""
  rec = spawn('stack_probe', seconds, f'--stack_rows={label}',
              f'--stack_depth={depth}')
  return rec.get('rows', {}).get(label) or {'status': rec['status']}


def search_depths(stack_rec: dict, step: int, budget_s: float,
                  probe) -> dict:
  """The largest depth (a multiple of ``step`` above the stack's depth) at
  which each of SEARCH_ROWS runs: doubling from the stack's depth until a
  depth does not fit in memory, then bisecting. ``probe(label, depth,
  seconds)`` is :func:`probe_row`; ``budget_s`` is shared equally."""
  if not (stack_rec.get('device') or {}).get('memory_stats'):
    return {'status': 'skipped: needs a device with its own memory limit '
                      '(the backend reports no memory_stats)'}
  if not stack_rec.get('depth'):
    return {'status': 'skipped: the stack phase did not start'}
  deadline = time.perf_counter() + budget_s
  out = {'step': step, 'status': 'ok'}
  for i, label in enumerate(SEARCH_ROWS):
    fits, refused, probes = 0, None, {}
    depth = stack_rec['depth']
    row_deadline = time.perf_counter() + (
        deadline - time.perf_counter()) / (len(SEARCH_ROWS) - i)
    while depth and row_deadline - time.perf_counter() >= 10:
      row = probe(label, depth, row_deadline - time.perf_counter())
      probes[depth] = row['status']
      if row.get('fits'):
        fits = depth
      elif row['status'].startswith('does not fit'):
        refused = min(refused or depth, depth)
      else:
        break  # neither: an error, kept in probes
      if refused is None:
        depth *= 2
      elif refused - fits <= step:
        depth = 0
      else:
        depth = fits + step * max(1, (refused - fits) // (2 * step))
    out[label] = {'largest_fitting': fits, 'smallest_refused': refused,
                  'exact': refused is not None and refused - fits <= step,
                  'probes': probes}
    print(f'search {label}: runs at {fits}, fails at {refused}', flush=True)
  return out


def run_jit(results: dict):
  rec = spawn('jit', F.jit_budget_s)
  results['jit'] = rec
  note_device(results, rec)


def run_attention(results: dict):
  # The size the lm phase fitted on this device, unless one was asked for.
  fitted = (results.get('lm') or {}).get('size')
  extra = (f'--lm_size={fitted}',) if fitted and not F.lm_size else ()
  rec = spawn('attention', F.attention_budget_s, *extra)
  results['attention'] = rec
  note_device(results, rec)


RUNNERS = {'lm': run_lm, 'stack': run_stack, 'jit': run_jit,
           'attention': run_attention}


def versions() -> dict:
  out = {'python': platform.python_version()}
  for package in ('jax', 'jaxlib', 'flax', 'liftmods', 'optax', 'numpy'):
    try:
      out[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      out[package] = None
  return out


# --- the table ----------------------------------------------------------------


def _ms(seconds):
  if seconds is None:
    return 'n/a'
  if seconds < 1e-3:
    return f'{seconds * 1e6:,.1f} µs'
  return f'{seconds * 1e3:,.2f} ms' if seconds < 1 else f'{seconds:,.2f} s'


def _x(r):
  """A ratio dict ({median, best}) or number as a cell."""
  if r is None:
    return 'n/a'
  if isinstance(r, dict):
    return f'**{r["median"]:.2f}×** (best {r["best"]:.2f}×)'
  return f'{r:.2f}×'


def _mib(n):
  return 'not measured' if n is None else f'{n / MIB:,.1f} MiB'


def _timed(t):
  return f'{_ms(t.get("median_s"))} (best {_ms(t.get("best_s"))})'


def lm_rows(lm: dict) -> list:
  if 'liftmods' not in lm or 'flax.linen' not in lm:
    return [('LM', lm.get('status', 'not run'), '', '')]
  ours, theirs = lm['liftmods'], lm['flax.linen']
  if 'step_median_s' not in ours:
    return [('LM step', lm.get('status', 'not run'), '', '')]
  name = (f'LM {lm["size"]} ({lm["params"] / 1e6:,.1f}M params, batch '
          f'{lm["batch"]}×{lm["seq"]}, bf16)')

  def mfu(r):
    return 'n/a' if r.get('mfu') is None else f'{100 * r["mfu"]:.1f}%'

  step = lambda r: _timed({'median_s': r['step_median_s'],
                           'best_s': r['step_best_s']})
  rows = [
      (f'{name}: train step', step(ours), step(theirs), _x(lm['step_ratio'])),
      ('LM: tokens/s (median step)', f'{ours["tokens_per_s"]:,.0f}',
       f'{theirs["tokens_per_s"]:,.0f}',
       _x(ours['tokens_per_s'] / theirs['tokens_per_s'])),
      (f'LM: MFU (peak {lm["peak_tflops"] or "unknown"} TFLOP/s)', mfu(ours),
       mfu(theirs), ''),
      ('LM: trace+lower / XLA compile',
       f'{ours["lower_s"]:.2f} s / {ours["compile_s"]:.2f} s',
       f'{theirs["lower_s"]:.2f} s / {theirs["compile_s"]:.2f} s',
       _x(lm['compile_ratio']) + ' (compile)'),
      ('LM: first-step loss', f'{ours["first_loss"]:.5f}',
       f'{theirs["first_loss"]:.5f}', ''),
  ]
  if 'trace' in lm:
    rows.append(('LM: apply trace', _timed(lm['trace']['liftmods']),
                 _timed(lm['trace']['flax.linen']), _x(lm['trace']['ratio'])))
  if 'forward_call' in lm:
    call = lm['forward_call']
    rows.append(('LM: eager f32 forward, batch 1: nn.jit / jax.jit',
                 f'{_timed(call["nn.jit"])} vs {_timed(call["jax.jit"])}',
                 '—', _x(call['ratio'])))
  return rows


def attention_rows(att: dict) -> list:
  if 'step_ratio' not in att:
    return [('LM with fused attention', att.get('status', 'not run'), '', '')]
  fused, default = att['fused'], att['default']
  step = lambda r: _timed({'median_s': r['step_median_s'],
                           'best_s': r['step_best_s']})
  return [
      (f'LM {att["size"]} (batch {att["batch"]}×{att["seq"]}, bf16) step: '
       'nn.fused_dot_product_attention(implementation='
       f'{att["implementation"]}) vs default attention',
       f'{step(fused)} vs {step(default)}', '—', _x(att['step_ratio'])),
      ('LM: first-step loss, fused / default attention',
       f'{fused["first_loss"]:.5f} / {default["first_loss"]:.5f}', '—', ''),
  ]


def _stack_cell(row: dict) -> str:
  if not row.get('fits'):
    return row.get('status', 'not run')
  cell = (f'device {_mib(row.get("device_peak_bytes"))}, compiler '
          f'{_mib(row["compiler_peak_bytes"])}, step '
          f'{_ms(row.get("step_median_s"))}')
  if row.get('compiler_host_bytes'):
    cell += f', host {_mib(row["compiler_host_bytes"])}'
  if str(row.get('offload', '')).startswith('unsupported'):
    cell += ' (offload unsupported: kept on device)'
  return cell


def stack_rows(stack: dict) -> list:
  rows = stack.get('rows', {})
  if not rows:
    return [('stack', stack.get('status', 'not run'), '', '')]
  out = []
  for a, b in STACK_TABLE:
    if a not in rows or b not in rows:
      continue
    ra, rb = rows[a], rows[b]
    peak = 'device_peak_bytes' if all(
        r.get('device_peak_bytes') for r in (ra, rb)) else 'compiler_peak_bytes'
    cells = []
    if ra.get(peak) and rb.get(peak):
      cells.append(f'peak {ra[peak] / rb[peak]:.2f}×'
                   f'{" (compiler)" if peak.startswith("compiler") else ""}')
    if f'{a}/{b}' in stack.get('step_ratios', {}):
      cells.append('step ' + _x(stack['step_ratios'][f'{a}/{b}']))
    out.append((f'stack D={stack["depth"]} H={stack["hidden"]} batch '
                f'{stack["batch"]}: {a} vs {b}', _stack_cell(ra),
                _stack_cell(rb), ', '.join(cells)))
  search = stack.get('search', {})
  if all(label in search for label in SEARCH_ROWS):
    full, nested = (search[label] for label in SEARCH_ROWS)
    out.append(('stack: largest depth that runs, full / nested',
                f'{full["largest_fitting"]} / {nested["largest_fitting"]}',
                '', f'step {search["step"]}'))
  return out


def jit_rows(jit: dict) -> list:
  models = jit.get('models', {})
  if not models:
    return [('eager calls', jit.get('status', 'not run'), '', '')]
  return [(f'eager call, {label}: nn.jit vs jax.jit',
           f'{r["median_us"]:,.1f} µs vs {r["jax_jit_us"]:,.1f} µs',
           f'Linen nn.jit {r["linen_us"]:,.1f} µs',
           f'**{r["vs_jax_jit"]:.2f}×** jax.jit (best '
           f'{r["vs_jax_jit_best"]:.2f}×)'
           f'; {r["vs_linen_nn_jit"]:.2f}× Linen') for label, r in
          models.items()]


def markdown(results: dict) -> str:
  device = results.get('device') or {}
  v = results['versions']
  backend = device.get('backend', 'unknown')
  where = (f'**{device.get("kind")}** ({backend})' if backend != 'cpu' else
           f'**CPU** ({device.get("kind")}, {os.cpu_count()} cores: not an '
           'accelerator)')
  lines = [f'`{results["command"]}` on {where}; jax {v["jax"]}, jaxlib '
           f'{v["jaxlib"]}, flax {v["flax"]}, liftmods {v["liftmods"]}; '
           f'{results.get("total_wall_s", 0):.0f} s in all.', '',
           '| figure | liftmods | flax.linen | liftmods / linen |',
           '|---|---|---|---|']
  rows = []
  for phase, make in (('lm', lm_rows), ('stack', stack_rows),
                      ('jit', jit_rows), ('attention', attention_rows)):
    if phase in results:
      rows += make(results[phase])
  lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
  return '\n'.join(lines) + '\n'


def write(out: pathlib.Path, results: dict):
  (out / 'accelerator.json').write_text(json.dumps(results, indent=1))
  (out / 'accelerator.md').write_text(markdown(results))


def main(argv):
  del argv
  if F.child:
    return run_child()
  unknown = set(F.phases) - set(PHASES + OPTIONAL_PHASES)
  if unknown:
    raise app.UsageError(f'--phases: unknown {sorted(unknown)}')
  if F.stack_depth % 8:
    raise app.UsageError('--stack_depth must be a multiple of 8')
  out = pathlib.Path(F.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  results = {'command': ' '.join(['python -m benchmarks.accelerator',
                                  *sys.argv[1:]]),
             'versions': versions(), 'phases': {}}
  check_backend(results)
  for phase in F.phases:
    began = time.perf_counter()
    RUNNERS[phase](results)
    results['phases'][phase] = {'wall_s': time.perf_counter() - began,
                                'status': results[phase]['status']}
    results['total_wall_s'] = time.perf_counter() - start
    write(out, results)
  print('\n' + markdown(results))
  print(f'written: {out / "accelerator.json"}, {out / "accelerator.md"}')


if __name__ == '__main__':
  app.run(main)
