r"""The LM of ``examples/lm`` from ~125M to ~70B parameters on TPU slices.

Each row compiles one AdamW train step (``examples.lm.train.make_train_step``
and ``make_optimizer``, f32 parameters and optimizer state) of
``examples.lm.model.TransformerLM`` scaled by its ``Config`` for a TPU slice
(``benchmarks/aot.py``; no TPU needed, only libtpu), under a sharding and a
layer-stack policy, for liftmods and for the same model under flax.linen:

- sharding ``data``: batch over all chips, parameters replicated;
  ``fsdp``: the ``embed`` dimension of every parameter (and optimizer
  state) split over all chips too; ``fsdp_tp``: a ``('data', 'model')``
  mesh with 4-way tensor parallelism (heads, MLP units, vocabulary).
- over several slices (a topology such as ``2xv5e:4x4``): ``dcn_fsdp``,
  data parallel across the slices (over DCN) and FSDP within each;
  ``stage_fsdp``, one ``nn.Pipeline`` stage per slice (``--pipeline_mode``,
  ``--pipeline_micro``, ``--pipeline_repeats``: above 1, the circular
  schedule or interleaved 1F1B; liftmods only) and FSDP within each. Every
  row gives its bytes per chip per step over DCN and over ICI
  (``benchmarks/traffic.py``).
- stack ``none``: no rematerialization; ``full``: each block recomputed
  (``nn.Stack(policy='full')`` / Linen ``nn.scan(nn.remat(...))``);
  ``named``: also keeps the MLP activation named ``mlp_up``; ``nested``:
  sqrt(L) groups on the ``(L, ...)`` layout (Linen: ``nn.remat_scan`` with
  its ``(groups, L/groups, ...)`` layout); ``offload``: the carries between
  blocks in pinned host memory; ``nested_offload``: both (liftmods only).

Columns (per device): parameter + optimizer MiB (from the shardings), peak
MiB (arguments + outputs - donated + temporaries), host MiB, the compiler's
verdict (a refused program reads "does not fit: needs X of Y GiB"), model
TFLOP per step (6 N T + 12 L d S T, all chips), XLA's estimated step seconds
(its cost model; n/a when it gives none) and the MFU that estimate implies
against the chip's peak bf16 FLOP/s (``aot.CHIPS``), compile seconds.

``--sweep`` (one size and topology; each sharding, library and policy)
searches the largest multiple of ``--sweep_step`` layers the compiler fits,
starting from a count whose parameters and AdamW state alone, split as the
sharding splits them (``layouts.state_split``), exceed the HBM: refusals
come back in seconds and their "needs X GiB" locate the limit, so mostly
only the answer compiles in full (``aot.largest_fitting``). Across slices
(``--slices=2xv5p:4x4x8 --sharding=dcn_fsdp,stage_fsdp``) each row also
gives the DCN and ICI bytes per step of the largest program that fits;
``stage_fsdp`` needs a step that is a multiple of the slice count (times
``--pipeline_repeats``).

Precision (``--precision=f32,bf16``): ``f32`` computes in float32; ``bf16``
computes in bfloat16 with float32 parameters, optimizer state and loss. The
liftmods model gets it from one ``nn.precision_policy`` entered around
tracing (the model code is unchanged). Linen has no model-wide policy and
``examples/lm``'s ``Config`` has no dtype to thread through, so the Linen
bf16 rows run the model file against a namespace whose layer classes
(``Dense``, ``Embed``, ``LayerNorm``, ``SelfAttention``) default to
``dtype=bfloat16``: the program that editing every layer call to pass
``dtype`` would give.

  python -m benchmarks.scaling                  # default rows, a few minutes
  python -m benchmarks.scaling --rows=bf16      # 1b fsdp full, f32 and bf16
  python -m benchmarks.scaling --rows=fits      # a row only liftmods fits
  python -m benchmarks.scaling --full           # every size/slice/policy
  python -m benchmarks.scaling --sizes=125m --slices=v5e:2x2 --policies=full
  python -m benchmarks.scaling --sweep --sizes=1b --slices=v5e:4x4 \
      --chip_batch=4 --policies=none,full,named,nested,offload
  python -m benchmarks.scaling --sweep --sizes=8b --slices=2xv5p:4x4x8 \
      --sharding=dcn_fsdp,stage_fsdp --policies=full --libraries=liftmods \
      --chip_batch=4 --sweep_step=16
"""
import contextlib
import dataclasses
import functools
import math
import re
import time

from absl import app, flags
import flax
import flax.linen as fnn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks import aot
from benchmarks.layouts import SHARDINGS
from benchmarks import layouts
from benchmarks.models import lm_model_module
import liftmods as lnn
from liftmods.sharded_init import mesh_shardings
from examples.lm import model as lm
from examples.lm import train as lm_train

SIZES = {  # vocab, seq, layers, heads, d_model
    '125m': (50304, 2048, 12, 12, 768),
    '1b': (32768, 2048, 20, 16, 2048),
    '8b': (32768, 2048, 40, 32, 4096),
    '70b': (32768, 2048, 88, 64, 8192),
}
POLICIES = ('none', 'full', 'named', 'nested', 'offload', 'nested_offload')
LINEN_POLICIES = ('none', 'full', 'named', 'nested')
PRECISIONS = ('f32', 'bf16')
# (size, slice, sharding, per-chip batch, policies, precisions, layers (0:
# the size's)): the named row sets of --rows.
ROW_SETS = {
    'default': (
        ('1b', 'v5e:4x4', 'fsdp', 4, ('full',), ('f32',), 0),
        ('70b', 'v5e:16x16', 'fsdp', 1,
         ('full', 'nested', 'offload', 'nested_offload'), ('f32',), 0),
    ),
    'bf16': (
        ('1b', 'v5e:4x4', 'fsdp', 4, ('full',), ('f32', 'bf16'), 0),
    ),
    # The 1b width at 112 layers: the 112 carries between blocks (64 MiB
    # each per chip) no longer fit next to the rest, so scan-of-remat is
    # refused, while the (L, ...) layout's nested and offload forms keep
    # about 2 sqrt(L) carries or none on the device.
    # In bf16 the blocks' internals shrink (the carries stay f32), and
    # scan-of-remat fits at 112 layers; at 128 it is refused again.
    'fits': (
        ('1b', 'v5e:4x4', 'fsdp', 4, ('full', 'nested', 'offload'),
         ('f32',), 112),
        ('1b', 'v5e:4x4', 'fsdp', 4, ('full', 'nested', 'offload'),
         ('bf16',), 128),
    ),
}
FULL_SLICES = ('v5e:4x4', 'v5e:16x16', 'v5p:4x4x8', 'v5p:8x8x16')

flags.DEFINE_bool('full', False, 'every size x slice x policy (long)')
flags.DEFINE_list('sizes', [], f'model sizes from {list(SIZES)}')
flags.DEFINE_list('slices', [], 'TPU topologies, e.g. v5e:4x4')
flags.DEFINE_list('policies', [], f'stack policies from {POLICIES}')
flags.DEFINE_string('sharding', 'fsdp', f'one or more (comma-separated) of '
                    f'{list(SHARDINGS)}; dcn_fsdp and stage_fsdp span the '
                    'slices of a topology such as 2xv5e:4x4')
flags.DEFINE_integer('pipeline_micro', 8, 'microbatches of stage_fsdp')
flags.DEFINE_string('pipeline_mode', 'gpipe', 'nn.Pipeline mode of '
                    'stage_fsdp (gpipe, 1f1b, zero_bubble)')
flags.DEFINE_integer('pipeline_repeats', 1, 'nn.Pipeline repeats of '
                     'stage_fsdp: layer chunks per stage; above 1, gpipe is '
                     'the circular schedule and 1f1b interleaved 1F1B')
flags.DEFINE_integer('chip_batch', 1, 'sequences per chip (with --sizes)')
flags.DEFINE_integer('layers', 0, 'override the layer count (0: the size\'s)')
flags.DEFINE_integer('seq', 0, 'override the sequence length (0: the size\'s)')
flags.DEFINE_string('init_sharded', '', 'instead of train steps, compile '
                    'nn.init_sharded of SIZE for SLICE (fsdp_tp rules), e.g. '
                    '70b@v5p:8x8x16')
flags.DEFINE_list('libraries', ['liftmods', 'linen'], 'liftmods and/or linen')
flags.DEFINE_list('precision', ['f32'], f'compute precisions from {PRECISIONS} '
                  '(with --sizes); bf16 keeps f32 parameters, optimizer state '
                  'and loss')
flags.DEFINE_bool('sweep', False, 'per sharding, library and stack policy, '
                  'search the largest layer count the compiler fits (with '
                  'one --sizes and one --slices entry; --layers is ignored)')
flags.DEFINE_integer('sweep_step', 8, 'layer-count step of --sweep')
flags.DEFINE_string('rows', 'default', f'a named row set from {list(ROW_SETS)}'
                    ' (without --sizes/--slices/--policies/--full)')
F = flags.FLAGS


def _flag(name: str, default):
  """A flag's value once flags are parsed (a binary), else ``default`` (a
  caller importing this module)."""
  return F[name].value if F.is_parsed() else default


def config(size: str, layers: int = 0) -> lm.Config:
  vocab, seq, size_layers, heads, d_model = SIZES[size]
  return lm.Config(vocab_size=vocab, max_len=_flag('seq', 0) or seq,
                   num_layers=layers or _flag('layers', 0) or size_layers,
                   num_heads=heads, d_model=d_model, mlp_ratio=4,
                   dropout_rate=0.0)


def n_params(cfg: lm.Config) -> int:
  d, L = cfg.d_model, cfg.num_layers
  per_block = 4 * d * d + 4 * d + 2 * cfg.mlp_ratio * d * d + (
      cfg.mlp_ratio + 1) * d + 4 * d
  return L * per_block + (cfg.vocab_size + cfg.max_len) * d + 2 * d


def model_flops(cfg: lm.Config, batch: int) -> float:
  """Training FLOPs of one step (PaLM, appendix B): 6 N per token for the
  matrices and 12 L d S per token for attention."""
  tokens = batch * cfg.max_len
  return (6 * n_params(cfg) +
          12 * cfg.num_layers * cfg.d_model * cfg.max_len) * tokens


def groups(length: int) -> int:
  """Linen ``remat_scan`` needs lengths that multiply to L: the divisor of
  L nearest sqrt(L)."""
  return min((g for g in range(1, length + 1) if length % g == 0),
             key=lambda g: abs(g - length**0.5))


def batch_split(stack, batch_axes='data'):
  """``stack`` with its input and output split over the batch (mesh axes
  ``batch_axes``): under FSDP the parameters' ``embed`` axis shares the data
  axis, and without this GSPMD may keep whole activations on every chip."""
  split = lambda x: jax.lax.with_sharding_constraint(
      x, PartitionSpec(batch_axes))
  return lambda x, train: split(stack(split(x), train))


def batch_axes(sharding: str):
  """The mesh axes the batch is split over under ``sharding``."""
  return dict(SHARDINGS[sharding][1])['batch']


def mesh_for(sharding: str, topology: str) -> jax.sharding.Mesh:
  """The mesh of ``sharding`` over ``topology``: an axis of size 0 has one
  entry per slice and spans them (DCN); otherwise the first axis does."""
  axes, _ = SHARDINGS[sharding]
  slices = aot.split_slices(topology)[1]
  per_slice = [a for a, size in axes.items() if size == 0]
  sized = {a: slices if size == 0 else size for a, size in axes.items()}
  dcn = {per_slice[0]: slices} if per_slice and slices > 1 else None
  return aot.topology_mesh(topology, sized, dcn)


def pipeline_for(sharding: str, topology: str, micro: int, mode: str,
                 repeats: int = 1) -> lnn.Pipeline | None:
  """The ``nn.Pipeline`` of a ``stage_fsdp`` row, else None.

  Args:
    sharding: a name from ``SHARDINGS``.
    topology: a topology name; one stage per slice ('2xv5p:4x4x8': 2).
    micro: microbatches.
    mode: the schedule ('gpipe', '1f1b', 'zero_bubble').
    repeats: layer chunks per stage (``R > 1``: circular GPipe, interleaved
      1F1B).

  Raises:
    ValueError: the pipeline cannot be built; the message names the flags.
  """
  if sharding != 'stage_fsdp':
    return None
  stages = aot.split_slices(topology)[1]
  try:
    return lnn.Pipeline(stages=stages, microbatches=micro, repeats=repeats,
                        mode=mode)
  except ValueError as e:
    raise ValueError(
        f'stage_fsdp on {topology} (--pipeline_micro={micro}, '
        f'--pipeline_mode={mode}, --pipeline_repeats={repeats}): {e}') from e


def liftmods_stack(policy, batch='data'):
  spec = {
      'none': None, 'full': 'full', 'nested': 'nested', 'offload': 'offload',
      'named': lnn.StackPolicy(save_block_internals=('mlp_up',)),
      'nested_offload': lnn.StackPolicy(nested=True, save_carries='offload'),
  }[policy]

  def make(config, decode, name):
    pipeline = None if decode else config.pipeline
    return batch_split(lnn.Stack(lm.Block, config.num_layers, policy=spec,
                                 pipeline=pipeline)(config, decode, name=name),
                       batch)

  return make


BF16 = lnn.Precision(compute_dtype=jnp.bfloat16, param_dtype=jnp.float32,
                     output_dtype=jnp.float32)


def precision_scope(library: str, precision: str):
  """What a row is traced under: liftmods' bf16 rows in one model-wide
  precision policy; everything else as written (Linen's bf16 comes from
  its layers' dtype, see ``linen_lm``)."""
  if library == 'liftmods' and precision == 'bf16':
    return lnn.precision_policy(BF16)
  return contextlib.nullcontext()


class _LinenBf16:
  """flax.linen, except that the layers the LM builds compute in bfloat16
  unless told otherwise (their parameters stay float32)."""

  def __init__(self):
    def bf16(base):
      return type(base.__name__, (base,), {
          '__annotations__': {'dtype': object}, 'dtype': jnp.bfloat16,
          '__module__': base.__module__})

    self.Dense = bf16(fnn.Dense)
    self.Embed = bf16(fnn.Embed)
    self.LayerNorm = bf16(fnn.LayerNorm)
    self.SelfAttention = bf16(fnn.SelfAttention)

  def __getattr__(self, name):
    return getattr(fnn, name)


@functools.cache
def linen_lm(precision: str = 'f32'):
  """``examples/lm/model.py`` built with flax.linen; for ``'bf16'`` its
  ``nn`` is :class:`_LinenBf16` (the file itself unchanged)."""
  module = lm_model_module('flax.linen')
  if precision == 'bf16':
    module.nn = _LinenBf16()
  return module


def linen_stack(policy, precision='f32'):
  def make(config, decode, name):
    del decode
    block = linen_lm(precision).Block
    if policy == 'nested':
      class Body(block):
        def __call__(self, x):
          return super().__call__(x, True)

      g = groups(config.num_layers)
      stacked = fnn.remat_scan(
          Body, lengths=(g, config.num_layers // g),
          split_rngs={'params': True, 'dropout': True})(config, name=name)
      return batch_split(lambda x, train: stacked(x))

    class Body(block):  # pylint: disable=function-redefined
      def __call__(self, x, train):
        return super().__call__(x, train), None

    body = Body
    if policy == 'full':
      body = fnn.remat(Body, static_argnums=(2,), prevent_cse=False)
    elif policy == 'named':
      body = fnn.remat(
          Body, static_argnums=(2,), prevent_cse=False,
          policy=jax.checkpoint_policies.save_only_these_names('mlp_up'))
    scanned = fnn.scan(body, variable_axes={'params': 0},
                       split_rngs={'params': True, 'dropout': True},
                       in_axes=(fnn.broadcast,), length=config.num_layers,
                       metadata_params={fnn.PARTITION_NAME: 'layers'})(
                           config, False, name=name)
    return batch_split(lambda x, train: scanned(x, train)[0])

  return make


def build(library: str, cfg: lm.Config, policy: str, precision: str = 'f32',
          batch='data'):
  if library == 'liftmods':
    return lm.TransformerLM(cfg, stack_fn=liftmods_stack(policy, batch))
  return linen_lm(precision).TransformerLM(
      cfg, stack_fn=linen_stack(policy, precision))


def param_shardings(library, model, mesh, rules, tokens):
  """Abstract parameters and their NamedShardings from the partitioning
  metadata, with each library's own tools."""
  with jax.set_mesh(mesh):  # the target devices decide e.g. host offload
    boxed = jax.eval_shape(lambda t: model.init(jax.random.key(0), t),
                           tokens)['params']
  if library == 'liftmods':
    with lnn.logical_axis_rules(rules):
      shardings = mesh_shardings(boxed, mesh, rules)
    return lnn.unbox(boxed), shardings
  specs = fnn.get_partition_spec(boxed)
  return fnn.unbox(boxed), fnn.logical_to_mesh_sharding(
      specs, mesh, rules)


def sharded_bytes(tree) -> int:
  total = 0
  for a in jax.tree_util.tree_leaves(tree):
    shape = a.sharding.shard_shape(a.shape)
    total += jnp.dtype(a.dtype).itemsize * math.prod(shape)
  return total


@dataclasses.dataclass
class Row:
  size: str
  topology: str
  sharding: str
  library: str
  policy: str
  batch: int
  state_bytes: int
  report: aot.Report
  model_flops: float
  precision: str = 'f32'
  layers: int = 0


def compile_row(size, topology, sharding, library, policy, chip_batch,
                cfg=None, precision='f32', layers=0, micro=8, mode='gpipe',
                repeats=1):
  """One row: the train step compiled for ``topology`` in ``precision``
  (``cfg`` overrides the size's config, ``layers`` its layer count;
  ``micro``, ``mode`` and ``repeats`` are a ``stage_fsdp`` row's
  pipeline)."""
  cfg = cfg or config(size, layers)
  _, rules = SHARDINGS[sharding]
  mesh = mesh_for(sharding, topology)
  batch = chip_batch * mesh.size
  tokens = jax.ShapeDtypeStruct((1, cfg.max_len), jnp.int32)
  pipe = pipeline_for(sharding, topology, micro, mode, repeats)
  extra = dict(precision=precision, layers=cfg.num_layers)
  if pipe is not None and library != 'liftmods':
    report = aot.Report(f'{size} {library} {policy}', 0.0, fits=False,
                        error='flax.linen has no pipeline (stage_fsdp)')
    return Row(size, topology, sharding, library, policy, batch, 0, report,
               model_flops(cfg, batch), **extra)
  cfg = dataclasses.replace(cfg, pipeline=pipe)
  model = build(library, cfg, policy, precision, batch_axes(sharding))
  try:
    params, p_shardings = param_shardings(library, model, mesh, rules, tokens)
  except flax.errors.PartitioningUnspecifiedError:
    # nn.remat_scan takes no metadata_params, so it cannot stack parameters
    # that carry partitioning metadata.
    report = aot.Report(f'{size} {library} {policy}', 0.0, fits=False,
                        error='Linen remat_scan cannot stack partitioned '
                        'parameters (no metadata_params)')
    return Row(size, topology, sharding, library, policy, batch, 0, report,
               model_flops(cfg, batch), **extra)
  optimizer = lm_train.make_optimizer(lm_train.TrainConfig())
  replicated = NamedSharding(mesh, PartitionSpec())
  opt_state = jax.eval_shape(optimizer.init, params)
  opt_shardings = optax.tree_map_params(
      optimizer, lambda _, s: s, opt_state, p_shardings,
      transform_non_params=lambda _: replicated)
  shardings = {'step': replicated, 'params': p_shardings,
               'opt_state': opt_shardings}
  state = aot.abstract({'step': jax.ShapeDtypeStruct((), jnp.int32),
                        'params': params, 'opt_state': opt_state}, shardings)
  batch_sharding = NamedSharding(mesh, PartitionSpec(batch_axes(sharding)))
  tokens = jax.ShapeDtypeStruct((batch, cfg.max_len + 1), jnp.int32,
                                sharding=batch_sharding)
  step = lm_train.make_train_step(model, optimizer, 0,
                                  state_shardings=shardings,
                                  batch_sharding=batch_sharding)

  def lower():
    with (jax.set_mesh(mesh), lnn.logical_axis_rules(rules),
          precision_scope(library, precision)):
      return step.lower(state, tokens)

  label = (f'{size} L={cfg.num_layers} {topology} {sharding} {library} '
           f'{policy} {precision} b={batch}')
  if pipe is not None:
    label += f' {pipe.mode} M={pipe.microbatches}'
    if pipe.repeats > 1:
      label += f' R={pipe.repeats}'
  report, _ = aot.compile_report(label, lower, mesh)
  return Row(size, topology, sharding, library, policy, batch,
             sharded_bytes(state), report, model_flops(cfg, batch), **extra)


def mfu(row: Row) -> float | None:
  est = row.report.est_seconds
  if not row.report.fits or est is None:
    return None
  chips = len(aot.topology_devices(row.topology))
  return row.model_flops / chips / est / aot.chip(row.topology)['peak_flops']


def mfu_cell(m: float | None) -> str:
  """The est. MFU column. An estimate shorter than the model's FLOPs take
  at the chip's peak (MFU above 100%) cannot hold; XLA's cost model gives
  such estimates for some scanned programs, and the cell says so."""
  if m is None:
    return 'n/a'
  if m > 1:
    return f'{100 * m:.0f}% (above peak: the estimate cannot hold)'
  return f'{100 * m:.0f}%'


HEADER = ('| size | layers | slice | sharding | library | stack | precision | '
          'batch | param+opt MiB | peak MiB | temp MiB | host MiB | fits | '
          'model TFLOP/step | est. s (XLA model) | est. MFU | DCN MiB/step | '
          'ICI MiB/step | compile s |')


def format_row(row: Row) -> str:
  r = row.report
  m = mfu(row)
  cells = [row.size, row.layers, row.topology, row.sharding, row.library,
           row.policy, row.precision, row.batch,
           f'{row.state_bytes / aot.MIB:,.0f}']
  if r.fits:
    cells += [f'{r.peak / aot.MIB:,.0f}', f'{r.temp / aot.MIB:,.0f}',
              f'{r.host / aot.MIB:,.0f}', 'fits']
  else:
    cells += ['-', '-', '-', r.verdict()]
  cells += [f'{row.model_flops / 1e12:,.1f}',
            'n/a' if r.est_seconds is None else f'{r.est_seconds:.3f}',
            mfu_cell(m), layouts.network_cell(r, 'dcn'),
            layouts.network_cell(r, 'ici'),
            f'{r.compile_s:.1f}']
  return '| ' + ' | '.join(str(c) for c in cells) + ' |'


def shardings(spec: str) -> list[str]:
  """The shardings of ``--sharding`` ('fsdp' or 'dcn_fsdp,stage_fsdp').

  Args:
    spec: comma-separated names from ``SHARDINGS``.
  """
  names = [n.strip() for n in spec.split(',') if n.strip()]
  for name in names:
    if name not in SHARDINGS:
      raise app.UsageError(f'--sharding={spec}: {name!r} is not one of '
                           f'{list(SHARDINGS)}')
  if not names:
    raise app.UsageError(f'--sharding={spec!r}: name at least one of '
                         f'{list(SHARDINGS)}')
  return names


def plan():
  """``compile_row`` keyword arguments of every row."""
  libraries = F.libraries
  precisions = tuple(F.precision)
  for p in precisions:
    if p not in PRECISIONS:
      raise app.UsageError(f'--precision={p}: expected one of {PRECISIONS}')
  if F.sizes or F.slices or F.policies:
    combos = [(s, t, sh, F.chip_batch, tuple(F.policies or POLICIES),
               precisions, F.layers)
              for s in (F.sizes or ['125m']) for t in (F.slices or ['v5e:4x4'])
              for sh in shardings(F.sharding)]
  elif F.full:
    combos = [(s, t, sh, 1, POLICIES, precisions, F.layers) for s in SIZES
              for t in FULL_SLICES for sh in SHARDINGS]
  else:
    if F.rows not in ROW_SETS:
      raise app.UsageError(f'--rows={F.rows}: expected one of {list(ROW_SETS)}')
    combos = ROW_SETS[F.rows]
  for (size, topology, sharding, chip_batch, policies, row_precisions,
       layers) in combos:
    try:  # a refused pipeline before any compile
      pipeline_for(sharding, topology, F.pipeline_micro, F.pipeline_mode,
                   F.pipeline_repeats)
    except ValueError as e:
      raise app.UsageError(str(e)) from e
    for policy in policies:
      for precision in row_precisions:
        for library in libraries:
          if library == 'linen' and policy not in LINEN_POLICIES:
            continue
          yield dict(size=size, topology=topology, sharding=sharding,
                     library=library, policy=policy, chip_batch=chip_batch,
                     precision=precision, layers=layers,
                     micro=F.pipeline_micro, mode=F.pipeline_mode,
                     repeats=F.pipeline_repeats)


def largest_f32(hlo_text: str) -> int:
  """Elements of the largest f32 array in an HLO module's text."""
  return max((math.prod(int(d) for d in m.group(1).split(',') if d)
              for m in re.finditer(r'f32\[([\d,]+)\]', hlo_text)), default=0)


def init_sharded_report(size: str, topology: str):
  """``nn.init_sharded`` of ``size`` compiled for ``topology``: per-device
  bytes vs total / chips and the largest array in the per-device program."""
  cfg = config(size)
  axes, rules = SHARDINGS['fsdp_tp']
  mesh = aot.topology_mesh(topology, axes)
  model = build('liftmods', cfg, 'full')
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  tokens = jax.ShapeDtypeStruct((1, cfg.max_len), jnp.int32)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    # A preset rule set: names it leaves out are replicated on purpose.
    lowered, _ = lnn.init_sharded(model, mesh, rules, warn_unmapped=False).lower(
        key, tokens)
    compiled = lowered.compile()
  report = aot.report_from(f'init_sharded {size}', compiled,
                           time.perf_counter() - start)
  total = 4 * n_params(cfg)
  aot.print_table(f'nn.init_sharded, {size} ({n_params(cfg) / 1e9:.1f}B f32 '
                  f'parameters) on {topology}', [report])
  print(f'total / chips = {total / mesh.size / aot.MIB:,.1f} MiB; output per '
        f'device {report.output / aot.MIB:,.1f} MiB; largest f32 array in the '
        f'per-device program {4 * largest_f32(compiled.as_text()) / aot.MIB:,.1f}'
        f' MiB (whole embedding: {4 * cfg.vocab_size * cfg.d_model / aot.MIB:,.1f}'
        ' MiB)')


def sweep_start(size: str, topology: str, step: int,
                sharding: str = 'fsdp') -> int:
  """A layer count the compiler surely refuses: the smallest multiple of
  ``step`` at which the f32 parameters and AdamW moments alone, split as
  finely as ``sharding`` splits any parameter over the chips of
  ``topology`` (``layouts.state_split``), exceed a chip's HBM."""
  chips = len(aot.topology_devices(topology))
  split = layouts.state_split(sharding, chips, aot.split_slices(topology)[1])
  hbm = aot.chip(topology)['hbm_gib'] * aot.GIB
  layers = step
  while 3 * 4 * n_params(config(size, layers)) / split <= hbm:
    layers += step
  return layers


def sweep_probe(spec):
  """``compile_row`` of ``spec`` at a given layer count -> its Report,
  printed as it comes."""
  def probe(layers):
    report = compile_row(**dict(spec, layers=layers)).report
    line = f'  {report.label}: {report.verdict()} ({report.compile_s:.0f} s)'
    if report.traffic is not None:
      line += (f'; DCN {report.network_mib("dcn"):,.1f} MiB, ICI '
               f'{report.network_mib("ici"):,.1f} MiB per chip per step ('
               f'{aot.traffic_lib.summary(report.traffic)})')
    print(line, flush=True)
    return report

  return probe


def sweep_specs():
  """The rows of ``plan()`` that ``--sweep`` searches; says which it skips
  and refuses a layer step that a sharding cannot lay out."""
  specs = []
  for spec in plan():
    why = layouts.sweep_skip(spec)
    if why:
      print(f'skipped: {spec["sharding"]} {spec["library"]} {spec["policy"]}'
            f': {why}')
      continue
    try:
      layouts.check_sweep_step(spec['sharding'], spec['topology'],
                               F.sweep_step, spec['repeats'])
    except ValueError as e:
      raise app.UsageError(str(e)) from e
    specs.append(spec)
  return specs


def sweep_main():
  """``--sweep``: for each row of ``plan()`` (each sharding, library and
  policy), the largest multiple of ``--sweep_step`` layers that the
  compiler fits, then one table."""
  if len(F.sizes) != 1 or len(F.slices) != 1:
    raise app.UsageError('--sweep takes one --sizes and one --slices entry')
  (size,), (topology,), step = F.sizes, F.slices, F.sweep_step
  rows, seconds, starts = [], 0.0, {}
  for spec in sweep_specs():
    sharding = spec['sharding']
    if sharding not in starts:
      starts[sharding] = sweep_start(size, topology, step, sharding)
    try:
      reports = aot.largest_fitting(sweep_probe(spec), step, starts[sharding])
    except Exception as e:  # pylint: disable=broad-except
      # A compiler error other than lack of memory ends this row's search,
      # not the other rows'.
      rows.append(layouts.format_failed(spec, e))
      print(rows[-1], flush=True)
      continue
    rows.append(layouts.format_sweep(spec, reports, step,
                                     lambda n: n_params(config(size, n))))
    print(rows[-1], flush=True)  # kept if a long search is stopped later
    seconds += sum(r.compile_s for r in reports.values())
  pipe = (f'; stage_fsdp: {F.pipeline_mode}, {F.pipeline_micro} microbatches'
          f', repeats={F.pipeline_repeats}'
          if 'stage_fsdp' in shardings(F.sharding) else '')
  print(f'\nLargest fitting layer count (steps of {step}), {size} width on '
        f'{topology}, {F.chip_batch} sequences per chip{pipe}; per device '
        'at that count: peak and temp MiB, MiB per step over DCN and ICI.')
  print(layouts.SWEEP_HEADER)
  print('|' + '---|' * 14)
  print('\n'.join(rows))
  print(f'\nTotal compile time {seconds:,.0f} s.')


def main(argv):
  del argv
  aot.topology_devices('v5e:2x2')  # a clear error without libtpu
  if F.init_sharded:
    size, topology = F.init_sharded.split('@')
    return init_sharded_report(size, topology)
  if F.sweep:
    return sweep_main()
  print('AdamW train step of examples/lm (f32 parameters and optimizer '
        'state), compiled per slice; per-device figures; est. s and MFU come '
        'from XLA\'s cost model.')
  print(HEADER)
  print('|' + '---|' * 19)
  start = time.perf_counter()
  for spec in plan():
    row = compile_row(**spec)
    print(format_row(row), flush=True)
    if row.report.traffic:
      print(f'  bytes per chip per step: '
            f'{aot.traffic_lib.summary(row.report.traffic)}', flush=True)
  print(f'\nPeak bf16 FLOP/s per chip (Cloud TPU docs): ' + ', '.join(
      f'{k} {v["peak_flops"] / 1e12:.0f}T' for k, v in aot.CHIPS.items()) +
        f'. Total compile time {time.perf_counter() - start:.0f} s.')


if __name__ == '__main__':
  app.run(main)
