r"""Sharded training on a device mesh: liftmods vs flax.linen, in one process.

Model: ``benchmarks.spmd_model.decoder`` (embedding, RMSNorm/LayerNorm,
DenseGeneral attention projections, MLP, ``--layers`` scanned layers) with
logical axis names mapped by ``spmd_model.RULES`` onto a
(data, fsdp, tensor) mesh. Each library initialises its model sharded
(liftmods: ``nn.init_sharded``; Linen: its ``eval_shape`` ->
``get_partition_spec`` -> ``logical_to_mesh_sharding`` -> ``jit(init,
out_shardings=...)`` recipe) and runs an optax AdamW step under
``jax.jit`` with in/out shardings.

Figures, per library: trace+lower time of the sharded train step (fresh
function each time, so nothing is cached), per-device parameter and
optimizer-state bytes, per-device temp bytes of the sharded init and of the
train step (``compiled.memory_analysis()``), the bytes the compiled step's
collectives produce per device (``explicit_layers.collective_bytes``), and
the compiled step time. Targets are printed next to the figures.

The same liftmods model then runs on the same mesh made with
``AxisType.Explicit`` axes (``jax.make_mesh``'s default), with the same
rules and loss, and its rows are printed beside the Auto ones with the
ratios Explicit/Auto. flax.linen is tried on the Explicit mesh too; it fails
there, and the binary prints its error's class.

On CPU the mesh's devices are simulated: the binary sets
``--xla_force_host_platform_device_count`` (from ``--mesh``) before JAX is
imported. On GPU/TPU the mesh must fit the real devices.

With ``--topology`` (``benchmarks/aot.py``) nothing runs: the mesh is laid
over the abstract devices of that TPU slice (one ``--mesh`` size may be -1,
the rest of the chips), both libraries' shardings are computed from shapes
alone, and each library's sharded init and train step are compiled for the
slice; the binary prints their per-device ``aot`` rows side by side, the
parameter and optimizer bytes per device the shardings give, and whether the
two optimised train-step programs are identical.

  python -m benchmarks.spmd --mesh=data:2,fsdp:2,tensor:2 --layers=4 \
      --hidden=256
  python -m benchmarks.spmd --topology=v5e:2x2 --mesh=data:-1,fsdp:2,tensor:2
"""
import math
import os
import re
import sys


def _mesh_from_argv(argv) -> int:
  for i, arg in enumerate(argv):
    if arg.startswith('--mesh='):
      spec = arg.split('=', 1)[1]
    elif arg == '--mesh' and i + 1 < len(argv):
      spec = argv[i + 1]
    else:
      continue
    # A size of -1 (the rest of a --topology slice) counts as 1 here.
    return max(1, math.prod(max(1, int(p.split(':')[1]))
                            for p in spec.split(',')))
  return 8


if __name__ == '__main__':
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') +
      f' --xla_force_host_platform_device_count={_mesh_from_argv(sys.argv)}')

# pylint: disable=g-import-not-at-top,wrong-import-position
import time

from absl import app, flags
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import liftmods as lnn
from benchmarks import aot
from benchmarks import spmd_model
from benchmarks.explicit_layers import collective_bytes

flags.DEFINE_string('mesh', 'data:2,fsdp:2,tensor:2',
                    'mesh axes as name:size,... (data, fsdp, tensor); with '
                    '--topology one size may be -1 (the remaining chips)')
flags.DEFINE_integer('layers', 4, 'scanned decoder layers')
flags.DEFINE_integer('hidden', 256, 'embedding width (heads * head_dim)')
flags.DEFINE_integer('heads', 4, 'attention heads')
flags.DEFINE_integer('vocab', 1024, 'vocabulary size')
flags.DEFINE_integer('batch', 16, 'global batch size')
flags.DEFINE_integer('seq', 32, 'sequence length')
flags.DEFINE_integer('repeats', 5, 'timed trace+lower repetitions')
flags.DEFINE_integer('step_repeats', 10, 'timed step repetitions')
flags.DEFINE_string('dump_hlo', '', 'write both optimised train-step HLOs here')
F = flags.FLAGS


def mesh_axes() -> dict:
  """``--mesh`` as ``{name: size}``."""
  return {n: int(s) for n, s in (p.split(':') for p in F.mesh.split(','))}


def make_mesh(kind: AxisType = AxisType.Auto):
  """The ``--mesh`` axes over the local devices, every axis of type ``kind``."""
  axes = mesh_axes()
  return jax.make_mesh(tuple(axes.values()), tuple(axes),
                       axis_types=(kind,) * len(axes))


def topology_mesh():
  """The ``--mesh`` axes over the chips of ``--topology`` (no TPU needed;
  LibtpuMissingError without libtpu)."""
  return aot.topology_mesh(F.topology, mesh_axes())


def cross_entropy(logits, targets):
  """Mean next-token cross-entropy with one-hot labels. Picking the target
  logits by index is a gather along the vocabulary, which JAX refuses on an
  Explicit mesh where that dimension is sharded; every row of the table
  uses this one loss, so the two meshes run the same computation."""
  labels = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
  return optax.softmax_cross_entropy(logits, labels).mean()


def train_step(model, tx):
  """A fresh step function (a new object each call: no trace cache hits)."""

  def step(params, opt_state, tokens):

    def loss_fn(p):
      logits = model.apply({'params': p}, tokens[:, :-1])
      return cross_entropy(logits, tokens[:, 1:])

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def opt_shardings(tx, params, param_shardings, mesh):
  return optax.tree_map_params(
      tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
      transform_non_params=lambda _: NamedSharding(mesh, P()))


def liftmods_init(model, mesh, key, tokens):
  init = lnn.init_sharded(model, mesh, spmd_model.RULES)
  lowered, _ = init.lower(key, tokens)
  variables, shardings = init(key, tokens)
  return variables['params'], shardings['params'], lowered.compile()


def linen_init(model, mesh, key, tokens):
  abstract = jax.eval_shape(model.init, key, tokens)
  shardings = fnn.logical_to_mesh_sharding(
      fnn.get_partition_spec(abstract), mesh, spmd_model.RULES)
  init = jax.jit(model.init, out_shardings=shardings)
  compiled = init.lower(key, tokens).compile()
  params = fnn.unbox(init(key, tokens))['params']
  return params, fnn.unbox(shardings)['params'], compiled


def device_bytes(tree, device) -> int:
  return sum(s.data.nbytes for x in jax.tree.leaves(tree)
             for s in x.addressable_shards if s.device == device)


def ideal_bytes(tree) -> float:
  """Each array's bytes divided by the number of devices its dims split over."""
  total = 0.
  for x in jax.tree.leaves(tree):
    mesh, spec = x.sharding.mesh, x.sharding.spec
    n = math.prod(mesh.shape[a] for e in spec if e is not None
                  for a in (e if isinstance(e, tuple) else (e,)))
    total += x.nbytes / n
  return total


def _program(compiled) -> str:
  """Optimised HLO without names, source locations and stack-frame tables."""
  text = re.sub(r', metadata=\{[^}]*\}', '', compiled.as_text())
  text = re.sub(r', stack_frame_id=\d+', '', text)
  text = re.sub(r'^HloModule \S+', 'HloModule m', text)
  return '\n'.join(
      line for line in text.splitlines()
      if not re.match(r'\s*\d+ |(FileNames|FunctionNames|FileLocations|'
                      r'StackFrames)', line))


def measure(name, lib, mesh, key, tokens, batch):
  model = spmd_model.decoder(lib, cfg())
  tx = optax.adamw(1e-3)
  init = liftmods_init if lib is lnn else linen_init
  params, p_sh, init_compiled = init(model, mesh, key, tokens)
  o_sh = opt_shardings(tx, params, p_sh, mesh)
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  shardings = dict(in_shardings=(p_sh, o_sh, batch.sharding),
                   out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())))

  def trace():
    return jax.jit(train_step(model, tx), **shardings).trace(
        params, opt_state, batch)

  lowered = trace().lower()  # warms JAX's own caches
  compiled = lowered.compile()
  _, _, loss = compiled(params, opt_state, batch)
  dev = mesh.devices.flat[0]
  init_mem, step_mem = (init_compiled.memory_analysis(),
                        compiled.memory_analysis())
  return dict(
      name=name, trace=trace,
      run=lambda: compiled(params, opt_state, batch),
      param_bytes=device_bytes(params, dev), ideal_param=ideal_bytes(params),
      total_param=sum(x.nbytes for x in jax.tree.leaves(params)),
      opt_bytes=device_bytes(opt_state, dev), ideal_opt=ideal_bytes(opt_state),
      init_temp=init_mem.temp_size_in_bytes,
      init_out=init_mem.output_size_in_bytes,
      step_temp=step_mem.temp_size_in_bytes, loss=float(loss),
      collectives=collective_bytes(compiled.as_text()),
      program=_program(compiled))


def cfg():
  return spmd_model.Config(vocab=F.vocab, embed=F.hidden, heads=F.heads,
                           head_dim=F.hidden // F.heads, mlp=4 * F.hidden,
                           layers=F.layers)


def _mb(n):
  return f'{n / 2**20:,.3f} MiB'


# --- compiled for a TPU slice (--topology) ----------------------------------

def shard_bytes(tree) -> int:
  """Bytes of ``tree`` (ShapeDtypeStructs with shardings) on one device."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def abstract_init(lib, model, mesh, key, tokens):
  """``(params, param shardings, lower)`` of ``lib``'s sharded init from
  shapes alone: ``params`` are ShapeDtypeStructs carrying their shardings,
  ``lower()`` lowers the init as the CPU path runs it."""
  if lib is lnn:
    init = lnn.init_sharded(model, mesh, spmd_model.RULES)
    lowered, shardings = init.lower(key, tokens)
    params = lowered.out_info['params']
    p_sh = shardings['params']
    return (aot.abstract(params, p_sh), p_sh,
            lambda: init.lower(key, tokens)[0])
  boxed = jax.eval_shape(model.init, key, tokens)
  shardings = fnn.logical_to_mesh_sharding(
      fnn.get_partition_spec(boxed), mesh, spmd_model.RULES)
  p_sh = fnn.unbox(shardings)['params']
  init = jax.jit(model.init, out_shardings=shardings)
  return (aot.abstract(fnn.unbox(boxed)['params'], p_sh), p_sh,
          lambda: init.lower(key, tokens))


def compile_library(name, lib, mesh):
  """The sharded init and train step of ``lib`` compiled for the slice of
  ``mesh``: ``dict(init=Report, step=Report, params=..., opt_state=...,
  program=optimised step HLO or None)``."""
  model = spmd_model.decoder(lib, cfg())
  tx = optax.adamw(1e-3)
  replicated = NamedSharding(mesh, P())
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
  tokens = jax.ShapeDtypeStruct((F.batch, F.seq + 1), jnp.int32,
                                sharding=replicated)
  batch_axes = tuple(a for a in ('data', 'fsdp') if a in mesh.shape)
  batch = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype,
                               sharding=NamedSharding(mesh, P(batch_axes)))
  params, p_sh, lower_init = abstract_init(lib, model, mesh, key, tokens)
  o_sh = opt_shardings(tx, params, p_sh, mesh)
  opt_state = aot.abstract(jax.eval_shape(tx.init, params), o_sh)
  step = jax.jit(train_step(model, tx),
                 in_shardings=(p_sh, o_sh, batch.sharding),
                 out_shardings=(p_sh, o_sh, replicated))
  init_report, _ = aot.compile_report(f'{name} sharded init', lower_init)
  print(aot.table_row(init_report), flush=True)
  step_report, compiled = aot.compile_report(
      f'{name} train step', lambda: step.lower(params, opt_state, batch))
  print(aot.table_row(step_report), flush=True)
  return dict(init=init_report, step=step_report, params=params,
              opt_state=opt_state,
              program=_program(compiled) if compiled is not None else None)


def aot_main():
  mesh = topology_mesh()
  print(f'topology={F.topology}, mesh {dict(mesh.shape)}; decoder '
        f'layers={F.layers} hidden={F.hidden} heads={F.heads} '
        f'vocab={F.vocab}, batch={F.batch}x{F.seq}; compiled, not run; '
        f'jax {jax.__version__}', flush=True)
  results = {name: compile_library(name, lib, mesh)
             for name, lib in (('liftmods', lnn), ('flax.linen', fnn))}
  aot.print_table(
      f'Sharded init and AdamW train step compiled for {F.topology}',
      [r[k] for k in ('init', 'step') for r in results.values()])
  print('\nper device, from the shardings')
  for name, r in results.items():
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(r['params']))
    params, opt = shard_bytes(r['params']), shard_bytes(r['opt_state'])
    print(f'  {name:<11} params {_mb(params)} of {_mb(total)} (split over '
          f'{total / params:.2f} chips on average), opt state {_mb(opt)}')
  ours, theirs = results.values()
  same = ours['program'] is not None and ours['program'] == theirs['program']
  print(f'  optimised HLO of the two train steps identical: {same}')
  return results


def batch_on(mesh, tokens):
  """``tokens`` with the batch split over the mesh's data axes."""
  axes = tuple(a for a in ('data', 'fsdp') if a in mesh.shape)
  return jax.device_put(tokens, NamedSharding(mesh, P(axes)))


def linen_failure(mesh, key, tokens) -> str:
  """How flax.linen fails to build the train step on ``mesh`` (its error's
  class and first line), or 'ran' where it does not fail."""
  try:
    measure('flax.linen', fnn, mesh, key, tokens, batch_on(mesh, tokens))
  except Exception as e:  # pylint: disable=broad-exception-caught
    return f'{type(e).__name__}: {str(e).splitlines()[0][:100]}'
  return 'ran'


def time_all(results) -> None:
  """Median trace, lower, trace+lower and step times into each result,
  the libraries interleaved so that load on a shared machine hits all alike."""
  samples = {(r['name'], k): [] for r in results
             for k in ('trace', 'lower', 'step')}
  for r in results:
    jax.block_until_ready(r['run']())
  for i in range(max(F.repeats, F.step_repeats)):
    for r in results:
      if i < F.repeats:
        start = time.perf_counter()
        traced = r['trace']()
        mid = time.perf_counter()
        traced.lower()
        samples[r['name'], 'trace'].append(mid - start)
        samples[r['name'], 'lower'].append(time.perf_counter() - mid)
      if i < F.step_repeats:
        start = time.perf_counter()
        jax.block_until_ready(r['run']())
        samples[r['name'], 'step'].append(time.perf_counter() - start)
  for r in results:
    med = {k: float(np.median(samples[r['name'], k]))
           for k in ('trace', 'lower', 'step')}
    r['trace_time'], r['lower_time'] = med['trace'], med['lower']
    r['trace_lower'] = float(np.median(
        [a + b for a, b in zip(samples[r['name'], 'trace'],
                               samples[r['name'], 'lower'])]))
    r['step'] = {'median': med['step']}


_ms = lambda s: f'{s * 1e3:.1f} ms'


def _row(label, a, b, fmt, ratio=None):
  """One table row: ``a``, ``b`` and ``ratio`` (default ``a / b``)."""
  ratio = a / b if ratio is None else ratio
  print(f'{label:<34}{fmt(a):>16}{fmt(b):>16}{ratio:>10.2f}x')


def print_libraries(ours, theirs) -> None:
  print(f'\n{"":<34}{"liftmods":>16}{"flax.linen":>16}{"ratio":>11}')
  _row('trace+lower train step (median)', ours['trace_lower'],
       theirs['trace_lower'], _ms)
  _row('  of which trace (jaxpr)', ours['trace_time'], theirs['trace_time'],
       _ms)
  _row('  of which lower (to StableHLO)', ours['lower_time'],
       theirs['lower_time'], _ms)
  _row('step time (median)', ours['step']['median'], theirs['step']['median'],
       lambda s: f'{s * 1e3:.2f} ms')
  _row('params / device', ours['param_bytes'], theirs['param_bytes'], _mb)
  _row('opt state / device', ours['opt_bytes'], theirs['opt_bytes'], _mb)
  _row('sharded init temp / device', max(ours['init_temp'], 1),
       max(theirs['init_temp'], 1), _mb)
  _row('train step temp / device', max(ours['step_temp'], 1),
       max(theirs['step_temp'], 1), _mb)
  _row('step collectives / device', max(ours['collectives'], 1),
       max(theirs['collectives'], 1), _mb)
  print(f'{"loss":<34}{ours["loss"]:>16.6f}{theirs["loss"]:>16.6f}')


def print_explicit(auto, explicit, linen: str) -> None:
  """liftmods on the Explicit mesh beside the Auto one (ratios
  Explicit/Auto), and flax.linen's result on the Explicit mesh."""
  print(f'\nliftmods on a mesh with Explicit axes (the same model, rules and '
        f'loss)\n{"":<34}{"Auto":>16}{"Explicit":>16}{"Expl/Auto":>11}')

  def row(label, key, fmt, floor=0):
    a, b = max(auto[key], floor), max(explicit[key], floor)
    _row(label, a, b, fmt, ratio=b / a)

  row('train step temp / device', 'step_temp', _mb, 1)
  row('sharded init temp / device', 'init_temp', _mb, 1)
  row('step collectives / device', 'collectives', _mb, 1)
  row('params / device', 'param_bytes', _mb)
  row('trace+lower train step (median)', 'trace_lower', _ms)
  _row('step time (median)', auto['step']['median'],
       explicit['step']['median'], lambda s: f'{s * 1e3:.2f} ms',
       ratio=explicit['step']['median'] / auto['step']['median'])
  print(f'{"loss":<34}{auto["loss"]:>16.6f}{explicit["loss"]:>16.6f}'
        f'   |diff| {abs(auto["loss"] - explicit["loss"]):.2e}')
  outcome = 'ran' if linen == 'ran' else f'fails: {linen}'
  print(f'{"flax.linen on the Explicit mesh":<34}{outcome}')


def print_targets(ours, theirs) -> None:
  print('\ntargets')
  shards = ours['total_param'] / ours['ideal_param']
  checks = [
      ('params/device = total/shards (+-1%)',
       ours['param_bytes'] / ours['ideal_param'],
       abs(ours['param_bytes'] / ours['ideal_param'] - 1) <= 0.01),
      ('opt state/device = total/shards (+-1%)',
       ours['opt_bytes'] / ours['ideal_opt'],
       abs(ours['opt_bytes'] / ours['ideal_opt'] - 1) <= 0.01),
      ('init temp <= 1.2x its shard bytes',
       ours['init_temp'] / ours['init_out'],
       ours['init_temp'] <= 1.2 * ours['init_out']),
      ('trace+lower <= 0.5x Linen', ours['trace_lower'] / theirs['trace_lower'],
       ours['trace_lower'] <= 0.5 * theirs['trace_lower']),
      ('step time = Linen (same program)',
       ours['step']['median'] / theirs['step']['median'],
       ours['program'] == theirs['program']),
      ('step temp = Linen', ours['step_temp'] / max(theirs['step_temp'], 1),
       ours['step_temp'] == theirs['step_temp']),
  ]
  print(f'  (parameters split over {shards:.2f} devices on average; total '
        f'{_mb(ours["total_param"])})')
  for label, value, ok in checks:
    print(f'  {label:<40}{value:>8.3f}   {"yes" if ok else "NO"}')


def main(_):
  if F.topology:
    aot_main()
    return
  mesh, explicit_mesh = make_mesh(), make_mesh(AxisType.Explicit)
  key = jax.random.key(0)
  tokens = jax.random.randint(jax.random.key(1), (F.batch, F.seq + 1), 0,
                              F.vocab)
  print(f'devices: {jax.device_count()} x {jax.devices()[0].device_kind} '
        f'({jax.default_backend()}), mesh {dict(mesh.shape)}; decoder '
        f'layers={F.layers} hidden={F.hidden} heads={F.heads} '
        f'vocab={F.vocab}, batch={F.batch}x{F.seq}; jax {jax.__version__}')
  ours = measure('liftmods', lnn, mesh, key, tokens, batch_on(mesh, tokens))
  theirs = measure('flax.linen', fnn, mesh, key, tokens,
                   batch_on(mesh, tokens))
  explicit = measure('liftmods (Explicit)', lnn, explicit_mesh, key, tokens,
                     batch_on(explicit_mesh, tokens))
  linen = linen_failure(explicit_mesh, key, tokens)
  time_all((ours, theirs, explicit))
  print_libraries(ours, theirs)
  print_explicit(ours, explicit, linen)
  print_targets(ours, theirs)
  if F.dump_hlo:
    os.makedirs(F.dump_hlo, exist_ok=True)
    for r in (ours, theirs, explicit):
      name = r['name'].replace(' (Explicit)', '_explicit')
      with open(os.path.join(F.dump_hlo, name + '.hlo'), 'w') as f:
        f.write(r['program'])
  print(f'  optimised HLO of the two train steps identical: '
        f'{ours["program"] == theirs["program"]}')


if __name__ == '__main__':
  app.run(main)
