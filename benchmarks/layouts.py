"""The LM's shardings over one or several TPU slices, as arithmetic.

``benchmarks.scaling`` compiles its rows under one of ``SHARDINGS``; this
module holds what needs no compiler (and no absl flags, so tests import it
freely): the mesh sizes of a sharding over a slice count, how many ways it
splits the parameters (where ``--sweep`` starts), which rows a sweep can
compile, and the sweep's table row.
"""
import math

from benchmarks import aot

SHARDINGS = {  # mesh axes, logical rules
    'data': ({'data': -1}, (('batch', 'data'),)),
    'fsdp': ({'data': -1}, (('batch', 'data'), ('embed', 'data'))),
    'fsdp_tp': ({'data': -1, 'model': 4},
                (('batch', 'data'), ('embed', 'data'), ('heads', 'model'),
                 ('mlp', 'model'), ('vocab', 'model'))),
    # Several slices (size 0: one per slice; on one slice, 1): data
    # parallel across slices, FSDP within each ...
    'dcn_fsdp': ({'slice': 0, 'data': -1},
                 (('batch', ('slice', 'data')), ('embed', 'data'))),
    # ... or one pipeline stage per slice (liftmods' nn.Pipeline), FSDP
    # within each.
    'stage_fsdp': ({'stage': 0, 'data': -1},
                   (('batch', 'data'), ('embed', 'data'), ('layers', 'stage'))),
}


def _known(sharding: str) -> tuple:
  if sharding not in SHARDINGS:
    raise ValueError(f'sharding {sharding!r}: expected one of '
                     f'{list(SHARDINGS)}.')
  return SHARDINGS[sharding]


def mesh_sizes(sharding: str, chips: int, slices: int) -> dict:
  """The mesh axis sizes of ``sharding`` over ``chips`` chips in ``slices``
  slices (an axis of size 0 has one entry per slice, -1 takes the rest).

  Args:
    sharding: a name from ``SHARDINGS``.
    chips: chips of every slice together.
    slices: how many slices they form.
  """
  axes, _ = _known(sharding)
  sizes = {a: slices if s == 0 else s for a, s in axes.items()}
  known = math.prod(s for s in sizes.values() if s != -1)
  if chips % known:
    raise aot.MeshTopologyError(
        f'sharding {sharding!r}: mesh {sizes} cannot use {chips} chips (not '
        f'a multiple of {known}).')
  return {a: chips // known if s == -1 else s for a, s in sizes.items()}


def state_split(sharding: str, chips: int, slices: int) -> int:
  """The most ways ``sharding`` splits one parameter (and its AdamW state):
  the product of the mesh axes its rules map parameter dimensions to (every
  rule but the batch's). Replicas (``dcn_fsdp``'s slices) do not split.

  Args:
    sharding: a name from ``SHARDINGS``.
    chips: chips of every slice together.
    slices: how many slices they form.
  """
  sizes = mesh_sizes(sharding, chips, slices)
  _, rules = SHARDINGS[sharding]
  axes = set()
  for name, target in rules:
    if name != 'batch':
      axes.update((target,) if isinstance(target, str) else target)
  return math.prod(sizes[a] for a in axes)


def check_sweep_step(sharding: str, topology: str, step: int,
                     repeats: int = 1):
  """Raises ValueError when ``--sweep``'s layer steps cannot be laid out
  under ``sharding`` on ``topology``: ``stage_fsdp`` gives each slice a
  stage, and ``nn.Pipeline`` needs the layers divisible by the stages times
  its ``repeats`` (the chunks of each stage).

  Args:
    sharding: a name from ``SHARDINGS``.
    topology: a topology name ('2xv5p:4x4x8').
    step: the sweep's layer-count step.
    repeats: ``stage_fsdp``'s ``nn.Pipeline`` repeats (``--pipeline_repeats``).
  """
  _known(sharding)
  if step < 1:
    raise ValueError(f'--sweep_step={step}: expected at least 1.')
  stages = aot.split_slices(topology)[1]
  if sharding != 'stage_fsdp' or not step % (stages * repeats):
    return
  chunks = '' if repeats == 1 else f' x {repeats} repeats'
  raise ValueError(
      f'--sweep_step={step}: stage_fsdp on {topology} splits the layers '
      f'over {stages} stages (one per slice){chunks}, so the step must be a '
      f'multiple of {stages * repeats}.')


NESTED = ('nested', 'nested_offload')  # policies that group across layers


def sweep_skip(spec: dict) -> str | None:
  """Why ``--sweep`` does not search the row ``spec`` (a ``compile_row``
  keyword dict), or None when it does."""
  if spec['sharding'] == 'stage_fsdp' and spec['policy'] in NESTED:
    return ('nn.Stack refuses a nested policy under a pipeline (its groups '
            'would cross the stages)')
  if spec['library'] != 'linen':
    return None
  if spec['policy'] == 'nested':
    return 'Linen remat_scan cannot stack partitioned parameters'
  if spec['sharding'] == 'stage_fsdp':
    return 'flax.linen has no pipeline (stage_fsdp)'
  return None


SWEEP_HEADER = ('| sharding | library | stack | precision | largest fitting '
                'layers | parameters (B) | peak MiB | temp MiB | DCN MiB/step '
                '| ICI MiB/step | first refused layers | needs (GiB of usable) '
                '| compiles (fitting) | compile s |')


def network_cell(report: aot.Report, network: str) -> str:
  """MiB per chip per step on ``network`` (benchmarks/traffic.py)."""
  mib = report.network_mib(network)
  return '-' if mib is None else f'{mib:,.1f}'


def format_sweep(spec: dict, reports: dict, step: int, params) -> str:
  """One table row (``SWEEP_HEADER``) of a search's ``reports``.

  Args:
    spec: the row's ``compile_row`` keywords (sharding, library, policy,
      precision).
    reports: {layers: aot.Report} of every count the search compiled.
    step: the search's layer step.
    params: layers -> the model's parameter count at that depth.
  """
  fits, refused = aot.fit_bounds(reports)
  cells = [spec['sharding'], spec['library'], spec['policy'],
           spec['precision']]
  if fits:
    best = reports[fits]
    cells += [f'{fits:,}', f'{params(fits) / 1e9:.2f}',
              f'{best.peak / aot.MIB:,.0f}', f'{best.temp / aot.MIB:,.0f}',
              network_cell(best, 'dcn'), network_cell(best, 'ici')]
  else:
    cells += [f'fewer than {step}'] + ['-'] * 5
  top = reports.get(refused)
  cells += [f'{refused:,}' if refused else '-',
            'n/a' if top is None or top.needs_gib is None
            else f'{top.needs_gib:.2f} of {top.available_gib:.2f}']
  cells += [f'{len(reports)} ({sum(r.fits for r in reports.values())})',
            f'{sum(r.compile_s for r in reports.values()):,.0f}']
  return '| ' + ' | '.join(str(c) for c in cells) + ' |'


def format_failed(spec: dict, error: BaseException) -> str:
  """The table row (``SWEEP_HEADER``) of a search the compiler stopped
  with an error other than lack of memory: its first line, in the
  largest-fitting column.

  Args:
    spec: the row's ``compile_row`` keywords.
    error: what the compile raised.
  """
  first = (str(error).splitlines() or [type(error).__name__])[0]
  message = f'compile failed: {first[:160]}'.replace('|', '/')
  cells = [spec['sharding'], spec['library'], spec['policy'],
           spec['precision'], message] + ['-'] * 9
  return '| ' + ' | '.join(cells) + ' |'
