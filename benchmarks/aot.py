r"""Ahead-of-time compilation for a TPU slice, shared by the benchmark binaries.

With ``--topology=v5e:16x16`` (any name
``jax.experimental.topologies.get_topology_desc`` accepts) a binary lowers
and *compiles* its programs for that slice instead of running them: no TPU
is needed, only ``libtpu`` (``pip install -e '.[tpu]'``). The compiled
program's ``memory_analysis()`` and ``cost_analysis()`` give, per device:

- arg / out / alias / temp MiB: arguments, outputs, outputs that reuse
  donated argument buffers, and XLA temporaries in device memory (HBM);
- host MiB: bytes placed in pinned host memory (host offload);
- peak MiB: arg + out - alias + temp, the device memory the step needs;
- code MiB: size of the generated program;
- GFLOP and GB accessed: the compiler's counts for one step on one device;
- est. s: XLA's cost-model estimate of the step's seconds. It is the
  compiler's model, not a measurement; ``n/a`` where XLA gives none (or a
  negative placeholder, as it does for some loops);
- compile s: lowering + compilation on this machine.

A program whose memory exceeds the chip's HBM is refused by the TPU compiler
(``RESOURCE_EXHAUSTED``); ``compile_report`` turns that into a row reading
"does not fit: needs X of Y GiB" with the figures from the error.
``largest_fitting`` uses those refusals, which come back in seconds, to find
the largest size of a model the compiler fits with few full compiles.

  python -m benchmarks.stack --topology=v5e:2x2 --hidden=512 --batch=16384

Several slices joined by the data-center network: ``--num_slices=2`` (or
the name ``2xv5e:4x4``). ``topology_mesh`` then builds a hybrid mesh whose
DCN axes (``--dcn_axes=data:2``; by default the first axis) are split into
slices outermost, refusing with ``MeshTopologyError`` a mesh that does not
fit the slices; ``compile_report(..., mesh)`` adds the bytes per step on
each network (``benchmarks/traffic.py``).
"""
import collections
import dataclasses
import importlib.util
import math
import os
import re
import time

from absl import flags
import jax
import numpy as np

from benchmarks import traffic as traffic_lib

flags.DEFINE_string(
    'topology', '', 'compile for this TPU slice instead of running, e.g. '
    'v5e:2x2, v5e:16x16, v5p:8x8x16 (needs libtpu: pip install -e ".[tpu]")')
flags.DEFINE_integer(
    'num_slices', 1, 'with --topology: that many slices of it, joined by the '
    'data-center network (DCN); the same as --topology=Nx<topology> (read '
    'by binaries that call flag_topology(): benchmarks.pipeline)')
flags.DEFINE_list(
    'dcn_axes', [], 'mesh axes that span slices, as AXIS:SLICES (e.g. data:2 '
    'or stage:2,data:2); default: the mesh\'s first axis spans them all')

MIB = 2.0**20
GIB = 2.0**30
FLAGS = flags.FLAGS

# Per-chip peak dense bf16 FLOP/s and HBM capacity, from the Cloud TPU system
# architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e).
CHIPS = {
    'v4': dict(peak_flops=275e12, hbm_gib=32),
    'v5e': dict(peak_flops=197e12, hbm_gib=16),
    'v5p': dict(peak_flops=459e12, hbm_gib=95),
    'v6e': dict(peak_flops=918e12, hbm_gib=32),
}


class LibtpuMissingError(RuntimeError):
  """``--topology`` was given but libtpu is not installed."""


def libtpu_available() -> bool:
  """Whether the TPU compiler (libtpu) can be loaded in this environment."""
  return importlib.util.find_spec('libtpu') is not None


class MeshTopologyError(ValueError):
  """A mesh that does not fit the slices or devices of a topology."""


def split_slices(topology: str) -> tuple[str, int]:
  """``('v5e:4x4', 2)`` of ``'2xv5e:4x4'`` (two slices of v5e:4x4);
  ``(topology, 1)`` for a name without a slice count."""
  m = re.fullmatch(r'(\d+)x([a-z].*)', topology)
  if not m:
    return topology, 1
  if int(m.group(1)) < 1:
    raise MeshTopologyError(f'topology {topology!r}: the slice count must be '
                            f'at least 1, not {m.group(1)}.')
  return m.group(2), int(m.group(1))


def with_slices(topology: str, num_slices: int) -> str:
  """The name of ``num_slices`` slices of ``topology`` ('2xv5e:4x4').

  Args:
    topology: a slice name ('v5e:4x4'), or one with a count ('2xv5e:4x4').
    num_slices: how many slices; 1 keeps ``topology`` as it is.
  """
  base, count = split_slices(topology)
  if num_slices < 1:
    raise MeshTopologyError(f'--num_slices={num_slices}: expected at least 1.')
  if num_slices == 1:
    return topology
  if count != 1 and count != num_slices:
    raise MeshTopologyError(
        f'topology {topology!r} names {count} slices but --num_slices='
        f'{num_slices}; give the count once.')
  return f'{num_slices}x{base}'


def flag_topology() -> str:
  """``--topology`` with ``--num_slices`` folded in ('' without it)."""
  if not FLAGS.topology:
    return ''
  return with_slices(FLAGS.topology, FLAGS.num_slices)


def chip(topology: str) -> dict:
  """Peak FLOP/s and HBM GiB of the chip named by ``topology`` ('v5e:2x2',
  '2xv5e:2x2')."""
  name = split_slices(topology)[0].split(':')[0].split('-')[0]
  if name not in CHIPS:
    raise ValueError(f'topology {topology!r}: unknown chip {name!r}; known: '
                     f'{sorted(CHIPS)}.')
  return CHIPS[name]


def topology_devices(topology: str) -> list:
  """The abstract TPU devices of ``topology`` (compile-only, no TPU needed);
  ``'2xv5e:4x4'`` gives two slices' devices, each with its ``slice_index``.

  Raises LibtpuMissingError naming what to install when libtpu is absent.
  """
  if not libtpu_available():
    raise LibtpuMissingError(
        f'--topology={topology} compiles for a TPU slice and needs the TPU '
        'compiler: pip install -e ".[tpu]" (or pip install "jax[tpu]" at '
        f'the installed JAX version, {jax.__version__}); make venv-tpu '
        'creates such an environment.')
  # libtpu looks for TPU metadata on start-up; on a machine without TPUs
  # these keep it from querying (and warning about) hostnames.
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', 'v5litepod-4')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  # Compiling needs no TPU, so several processes (test workers) may load it.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  base, count = split_slices(topology)
  extra = {'num_slices': count} if count > 1 else {}
  return list(topologies.get_topology_desc(
      platform='tpu', topology_name=base, **extra).devices)


def slice_indices(devices) -> list[int]:
  """The slice of each of ``devices`` (0 for devices without one)."""
  return [getattr(d, 'slice_index', 0) for d in devices]


def parse_dcn_axes(spec) -> dict:
  """``{'data': 2}`` of ``['data:2']`` (the ``--dcn_axes`` form).

  Args:
    spec: entries ``AXIS:SLICES``, as a list or one comma-separated string.
  """
  entries = spec.split(',') if isinstance(spec, str) else list(spec)
  dcn = {}
  for entry in filter(None, (e.strip() for e in entries)):
    m = re.fullmatch(r'(\w+):(\d+)', entry)
    if not m or int(m.group(2)) < 1:
      raise MeshTopologyError(f'--dcn_axes entry {entry!r}: expected '
                              'AXIS:SLICES, e.g. data:2.')
    dcn[m.group(1)] = int(m.group(2))
  return dcn


def default_dcn(axes: dict, num_slices: int) -> dict:
  """The axes that span slices when a caller names none: ``--dcn_axes``
  once flags are parsed, else the mesh's first axis over every slice."""
  if num_slices == 1:
    return {}
  if FLAGS.is_parsed() and FLAGS.dcn_axes:
    return parse_dcn_axes(FLAGS.dcn_axes)
  return {next(iter(axes)): num_slices}


def _resolve(name: str, axes: dict, total: int) -> dict:
  """``axes`` with its one -1 size replaced by what the devices leave."""
  sizes = dict(axes)
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise MeshTopologyError(f'{name}: mesh {axes} may leave one axis size '
                            f'to the devices (-1), not {len(free)}.')
  if free:
    known = math.prod(s for s in sizes.values() if s != -1)
    if total % known:
      raise MeshTopologyError(
          f'{name}: mesh {axes} cannot use its {total} devices: they are not '
          f'a multiple of the other axes\' {known}.')
    sizes[free[0]] = total // known
  return sizes


def hybrid_shapes(name: str, axes: dict, dcn: dict, num_slices: int,
                  per_slice: int) -> tuple[dict, dict]:
  """The per-axis factors ``(within a slice, across slices)`` of a mesh.

  Args:
    name: the topology, for errors.
    axes: axis name -> size, one of which may be -1 (the rest).
    dcn: axis name -> how many slices it spans (their product is
      ``num_slices``; axes not named span none).
    num_slices: slices of the topology.
    per_slice: devices in each slice.

  Raises MeshTopologyError naming the axis and the numbers when the mesh
  does not fit.
  """
  for axis in dcn:
    if axis not in axes:
      raise MeshTopologyError(f'{name}: DCN axis {axis!r} is not an axis of '
                              f'the mesh {tuple(axes)}.')
  spans = math.prod(dcn.values())
  if spans != num_slices:
    raise MeshTopologyError(
        f'{name}: the DCN axes {dcn} span {spans} slices; the topology has '
        f'{num_slices}.')
  sizes = _resolve(name, axes, num_slices * per_slice)
  for axis, size in sizes.items():
    if size % dcn.get(axis, 1):
      raise MeshTopologyError(
          f'{name}: mesh axis {axis!r} of size {size} cannot span '
          f'{dcn[axis]} slices ({size} is not a multiple of {dcn[axis]}).')
  ici = {a: s // dcn.get(a, 1) for a, s in sizes.items()}
  if math.prod(ici.values()) != per_slice:
    where = '' if num_slices == 1 else f' per slice ({ici}, with {dcn} across)'
    raise MeshTopologyError(
        f'{name}: mesh {sizes} needs {math.prod(ici.values())} devices'
        f'{where}; a slice has {per_slice}.')
  return ici, {a: dcn.get(a, 1) for a in sizes}


def _per_slice(topology: str, devices, num_slices: int) -> int:
  """Devices in each slice, after checking there are ``num_slices`` equal
  ones."""
  counts = collections.Counter(slice_indices(devices))
  if len(counts) != num_slices or len(set(counts.values())) != 1:
    raise MeshTopologyError(
        f'{topology}: expected {num_slices} slices of equal size; the '
        f'compiler gave devices per slice {dict(sorted(counts.items()))}.')
  return len(devices) // num_slices


def topology_mesh(topology: str, axes: dict,
                  dcn: dict | None = None) -> jax.sharding.Mesh:
  """A mesh over the devices of ``topology``.

  Over several slices ('2xv5e:4x4') the mesh is hybrid: each axis of
  ``dcn`` is split into its slices (outermost) times the devices within a
  slice, so collectives over the other axes stay on the chips' interconnect.

  Args:
    topology: a topology name, with a slice count or not.
    axes: axis name -> size, one of which may be -1 (the rest of the
      devices).
    dcn: axis name -> how many slices it spans; default ``default_dcn``.
  """
  devices = topology_devices(topology)
  num_slices = split_slices(topology)[1]
  dcn = default_dcn(axes, num_slices) if dcn is None else dict(dcn)
  per_slice = _per_slice(topology, devices, num_slices)
  ici, over = hybrid_shapes(topology, axes, dcn, num_slices, per_slice)
  auto = (jax.sharding.AxisType.Auto,) * len(axes)
  if num_slices == 1:
    grid = np.array(devices).reshape(list(ici.values()))
  else:
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    grid = mesh_utils.create_hybrid_device_mesh(
        list(ici.values()), list(over.values()), devices,
        allow_split_physical_axes=True)
  return jax.sharding.Mesh(grid, tuple(axes), axis_types=auto)


def device_slices(mesh: jax.sharding.Mesh) -> list[int]:
  """The slice of each device of ``mesh`` in the order a compiled
  program's replica groups number them (the mesh's devices, flattened)."""
  return slice_indices(mesh.devices.flat)


def abstract(tree, shardings):
  """``ShapeDtypeStruct``s of ``tree`` (arrays or shape structs) carrying
  ``shardings`` (a matching tree, or one sharding for every leaf)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings),
        tree)
  return jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
      shardings)


@dataclasses.dataclass
class Report:
  """Compiled-program figures for one row (per device; bytes)."""
  label: str
  compile_s: float
  fits: bool = True
  argument: int = 0
  output: int = 0
  alias: int = 0
  temp: int = 0
  host: int = 0
  code: int = 0
  flops: float | None = None
  bytes_accessed: float | None = None
  est_seconds: float | None = None
  needs_gib: float | None = None
  available_gib: float | None = None
  error: str = ''
  # {(network, collective kind): bytes per device per step}, when the
  # program was compiled for a known mesh (benchmarks/traffic.py).
  traffic: dict | None = None

  @property
  def peak(self) -> int:
    return self.argument + self.output - self.alias + self.temp

  def network_mib(self, network: str) -> float | None:
    """MiB per device per step on ``network`` ('dcn' or 'ici'); None
    without traffic figures."""
    if self.traffic is None:
      return None
    return traffic_lib.network_bytes(self.traffic, network) / MIB

  def verdict(self) -> str:
    if self.fits:
      return 'fits'
    if self.needs_gib is not None:
      return (f'does not fit: needs {self.needs_gib:.2f} of '
              f'{self.available_gib:.2f} GiB')
    return f'not compiled: {self.error[:120]}'


_SIZE = r'([\d.]+)([KMGT]?)'
_UNITS = {'': 1 / GIB, 'K': 2**10 / GIB, 'M': 2**20 / GIB, 'G': 1.0,
          'T': 2.0**10}


def parse_oom(message: str):
  """``(needed GiB, available GiB)`` from a TPU RESOURCE_EXHAUSTED message,
  or None. Understands 'Used 20.56G of 15.75G hbm', 'required for ...
  (20.56G) exceeds available HBM (15.75G)' and, for pinned host memory,
  'Allocation (size=<bytes>) would exceed memory (size=<bytes>)'."""
  for pattern in (rf'Used {_SIZE} of {_SIZE} hbm',
                  rf'\({_SIZE}\) exceeds available \w+ \({_SIZE}\)',
                  rf'Allocation \(size={_SIZE}\) would exceed memory '
                  rf'\(size={_SIZE}\)'):
    m = re.search(pattern, message)
    if m:
      need, nu, have, hu = m.groups()
      return float(need) * _UNITS[nu], float(have) * _UNITS[hu]
  return None


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  return cost or {}


def _positive(value):
  return value if value is not None and value > 0 else None


def report_from(label: str, compiled, compile_s: float) -> Report:
  """The figures of an already compiled program."""
  mem = compiled.memory_analysis()
  cost = _cost(compiled)
  return Report(
      label, compile_s,
      argument=mem.argument_size_in_bytes, output=mem.output_size_in_bytes,
      alias=mem.alias_size_in_bytes, temp=mem.temp_size_in_bytes,
      host=(mem.host_temp_size_in_bytes + mem.host_argument_size_in_bytes +
            mem.host_output_size_in_bytes - mem.host_alias_size_in_bytes),
      code=mem.generated_code_size_in_bytes,
      flops=_positive(cost.get('flops')),
      bytes_accessed=_positive(cost.get('bytes accessed')),
      est_seconds=_positive(cost.get('optimal_seconds')))


def compile_report(label: str, lower,
                   mesh: jax.sharding.Mesh | None = None
                   ) -> tuple[Report, object]:
  """Runs ``lower()`` (-> ``jax.stages.Lowered``) and compiles it; returns
  ``(Report, compiled or None)``. A program the compiler refuses for lack of
  memory gives a "does not fit" report instead of an exception.

  Args:
    label: the report's row label.
    lower: returns the lowered program.
    mesh: the mesh it was lowered for; given, the report carries the bytes
      per step on each network (``Report.traffic``).
  """
  start = time.perf_counter()
  try:
    compiled = lower().compile()
  except Exception as e:  # pylint: disable=broad-except
    message = str(e)
    if 'RESOURCE_EXHAUSTED' not in message:
      raise
    oom = parse_oom(message)
    need, have = oom if oom else (None, None)
    return Report(label, time.perf_counter() - start, fits=False,
                  needs_gib=need, available_gib=have,
                  error=message.splitlines()[0]), None
  report = report_from(label, compiled, time.perf_counter() - start)
  if mesh is not None:
    report.traffic = traffic_lib.traffic(compiled.as_text(),
                                         device_slices(mesh))
  return report, compiled


def fit_bounds(reports: dict) -> tuple[int, int | None]:
  """``(largest size that fits or 0, smallest size refused or None)`` of
  ``reports`` ({size: Report})."""
  fits = max((n for n, r in reports.items() if r.fits), default=0)
  refused = min((n for n, r in reports.items() if not r.fits), default=None)
  return fits, refused


def limit_estimate(reports: dict) -> float:
  """The size at which the compiler's "needs X of Y GiB", taken as linear in
  the size, reaches Y: on the line through the two smallest refused sizes,
  or with one refusal, through it and the origin (an overestimate, as the
  figure has a positive intercept). 0 without any such figure."""
  points = sorted((n, r.needs_gib, r.available_gib)
                  for n, r in reports.items() if r.needs_gib)
  if not points:
    return 0.0
  (n1, need1, have), *rest = points
  slope = need1 / n1
  if rest and rest[0][1] > need1:
    slope = (rest[0][1] - need1) / (rest[0][0] - n1)
  return n1 - (need1 - have) / slope


def next_size(reports: dict, step: int) -> int | None:
  """The multiple of ``step`` to compile next, or None once the largest one
  that fits is known (the next one up refused).

  A refusal comes back in seconds and a program that fits takes minutes, so
  the search probes just above the estimated limit, expecting a refusal,
  and compiles the estimate itself only once the size above it is refused.
  When a size that fits lies above the estimate, it comes down from the
  smallest refusal a step at a time instead, each refusal sharpening the
  estimate, rather than compiling its way up."""
  fits, refused = fit_bounds(reports)
  if refused is None:
    return 2 * fits
  if refused - fits <= step:
    return None
  guess = max(0, step * math.floor(limit_estimate(reports) / step))
  if guess < fits:
    return refused - step
  guess = min(guess, refused - step)
  return guess if guess + step == refused else guess + step


def largest_fitting(probe, step: int, start: int) -> dict:
  """Compiles ``probe(n)`` (-> Report) for multiples ``n`` of ``step``,
  starting from ``start``, until the largest that fits is known; assumes
  that what fits at ``n`` fits below it. Returns {n: Report} of every size
  compiled (see ``fit_bounds``)."""
  reports, size = {}, start
  while size is not None:
    reports[size] = probe(size)
    size = next_size(reports, step)
  return reports


def _fmt(value, scale, digits=1):
  return 'n/a' if value is None else f'{value / scale:,.{digits}f}'


HEADER = ('| row | arg MiB | out MiB | alias MiB | temp MiB | host MiB | '
          'peak MiB | code MiB | GFLOP | GB accessed | est. s (XLA model) | '
          'compile s | fits |')


def table_row(r: Report) -> str:
  if not r.fits:
    return (f'| {r.label} |' + ' - |' * 10 + f' {r.compile_s:.1f} | '
            f'{r.verdict()} |')
  return (f'| {r.label} | {_fmt(r.argument, MIB)} | {_fmt(r.output, MIB)} | '
          f'{_fmt(r.alias, MIB)} | {_fmt(r.temp, MIB)} | {_fmt(r.host, MIB)} | '
          f'{_fmt(r.peak, MIB)} | {_fmt(r.code, MIB, 2)} | '
          f'{_fmt(r.flops, 1e9)} | {_fmt(r.bytes_accessed, 1e9, 2)} | '
          f'{_fmt(r.est_seconds, 1, 4)} | {r.compile_s:.1f} | fits |')


def print_table(title: str, reports):
  """A markdown table of ``reports`` with the caveats under it."""
  print(f'\n{title}')
  print(HEADER)
  print('|' + '---|' * 13)
  for r in reports:
    print(table_row(r))
  print('Per device. est. s is XLA\'s cost-model estimate of one step, not a '
        'measurement (n/a: none given).', flush=True)
