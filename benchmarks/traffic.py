"""Bytes a compiled program moves per step, by network and collective kind.

A program compiled for several TPU slices talks over two networks: the
chips' interconnect (ICI) within a slice and the data-center network (DCN)
between slices. Read from the optimized HLO text (``compiled.as_text()``):

- a collective (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute) whose replica groups (or source-target pairs) join
  devices of different slices crosses DCN; one whose groups stay within a
  slice stays on ICI;
- the TPU compiler gives each slice a program of its own and lowers the
  cross-slice part of a collective to a ``send`` handed to its "megascale"
  runtime (``_xla_megascale_transfer_type="ALL_REDUCE"``, ...): such a send
  is DCN traffic of that kind (named as the collective: 'all-reduce'), and
  every collective left in the per-slice program is ICI.

Bytes are per device and per step: the size of a collective's result (for a
megascale send, of the data sent), times how often it runs: an op inside a
loop body counts once per iteration (``_trip_count``), nested loops
multiply. The result size is the volume a collective delivers, not the
wire bytes of its algorithm (a ring all-reduce sends about twice it).
"""
import collections
import dataclasses
import math
import re

import numpy as np

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
               'collective-permute')
DCN, ICI = 'dcn', 'ici'
_MEGASCALE = '_xla_host_transfer_handler_name="xla_megascale_runtime"'
# The megascale name of a cross-slice collective-permute (a ppermute).
_MEGASCALE_KINDS = {'one-to-one': 'collective-permute'}
_HEADER = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$')
_CALLEES = re.compile(
    r'\b(body|condition|calls|to_apply|branch_computations|true_computation|'
    r'false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)')
_OP = re.compile(r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][\w\-]*)\(')


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One collective (or megascale send) of a compiled program."""
  kind: str  # 'all-reduce', ... ; a megascale send: its transfer type
  network: str  # DCN or ICI
  bytes: int  # per device, one run
  runs: int  # per step (loop trip counts multiplied)
  computation: str


def _itemsize(dtype: str) -> int:
  if dtype in ('pred', 'token'):
    return 1 if dtype == 'pred' else 0
  bits = re.search(r'\d+', dtype)
  return max(1, int(bits.group()) // 8) if bits else 4


def _arrays(shape_text: str) -> list[int]:
  """Bytes of each array in a result shape ('f32[8,16]{1,0}', a tuple)."""
  return [math.prod(int(d) for d in dims.split(',') if d) * _itemsize(dtype)
          for dtype, dims in re.findall(r'([a-z]+\d*)\[([\d,]*)\]',
                                        shape_text)]


def _result_bytes(op: str, shape_text: str) -> int:
  sizes = _arrays(shape_text)
  if op in ('all-gather-start', 'collective-permute-start'):
    # (operands, results[, u32 contexts]): only the results arrive.
    sizes = [s for s in sizes if s > 4]
    sizes = sizes[len(sizes) // 2:]
  return sum(sizes)


def _groups(line: str, devices: int) -> list[list[int]]:
  """The device groups of a collective line (ids as the program numbers
  them); one group of every device when it names none."""
  pairs = re.search(r'source_target_pairs=\{(.*?)\}\}', line)
  if pairs:
    return [[int(i) for i in p.split(',')]
            for p in re.findall(r'\{(\d+,\d+)', pairs.group(1) + '}')]
  iota = re.search(
      r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', line)
  if iota:
    shape = [int(d) for d in iota.group(1).split(',')]
    dims = [int(d) for d in iota.group(2).split(',')]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(p) for p in iota.group(3).split(',')])
    return ids.reshape(shape[0], -1).tolist()
  listed = re.search(r'replica_groups=\{(.*?\})?\}', line)
  if listed and listed.group(1):
    return [[int(i) for i in g.split(',') if i]
            for g in re.findall(r'\{([\d,]*)\}', listed.group(1))]
  return [list(range(devices))]


@dataclasses.dataclass
class _Computation:
  lines: list = dataclasses.field(default_factory=list)
  calls: list = dataclasses.field(default_factory=list)  # (callee, while)
  constants: dict = dataclasses.field(default_factory=dict)  # integer scalars
  firsts: dict = dataclasses.field(default_factory=dict)  # tuple -> operand 0
  copies: dict = dataclasses.field(default_factory=dict)  # copy -> operand
  counters: set = dataclasses.field(default_factory=set)  # element 0 of a tuple
  bound: int | None = None  # ROOT compare(counter, N), direction=LT


def _scan_line(comp: _Computation, line: str):
  name = re.match(r'\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=', line)
  if not name:
    return
  name = name.group(1)
  const = re.search(r'\s[su]\d+\[\][^=]*?\sconstant\((-?\d+)\)', line)
  if const:
    comp.constants[name] = int(const.group(1))
  first = re.search(r'\stuple\(%?([\w.\-]+)', line)
  if first:
    comp.firsts[name] = first.group(1)
  copy = re.search(r'\scopy\(%?([\w.\-]+)\)', line)
  if copy:
    comp.copies[name] = copy.group(1)
  if re.search(r'get-tuple-element\(.*\), index=0\b', line):
    comp.counters.add(name)
  bound = re.search(r'compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=LT',
                    line)
  if line.lstrip().startswith('ROOT') and bound:
    counter, limit = bound.groups()
    if counter in comp.counters and limit in comp.constants:
      comp.bound = comp.constants[limit]
  loop = re.search(r'\swhile\(%?([\w.\-]+)\)', line)
  for attr, names in _CALLEES.findall(line):
    for callee in re.findall(r'%?([\w.\-]+)', names):
      comp.calls.append((callee, (line, loop.group(1)) if loop and
                         attr == 'body' else None))


def _parse(hlo: str) -> tuple[str, dict]:
  """(the entry computation's name, {name: _Computation} in text order)."""
  comps, current, entry = {}, None, None
  for line in hlo.splitlines():
    head = _HEADER.match(line)
    if head and not line.startswith(' '):
      current = comps[head.group(1)] = _Computation()
      entry = head.group(1) if line.startswith('ENTRY') else entry
      continue
    if current is not None:
      current.lines.append(line)
      _scan_line(current, line)
  return entry, comps


def _trip_count(comps: dict, caller: _Computation, line: str,
                operand: str) -> int:
  """Iterations of the while loop on ``line``: XLA's ``known_trip_count``
  where the backend prints it (CPU, GPU); otherwise (TPU) the bound ``N`` of
  its condition ``counter < N`` less the counter's constant start (through
  copies; 0 when the start is not a constant: a loop XLA peeled reads one
  iteration high then); 1 when neither is readable."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
  if known:
    return int(known.group(1))
  cond = re.search(r'condition=%?([\w.\-]+)', line)
  name = cond.group(1) if cond else None
  bound = comps[name].bound if name in comps else None
  if bound is None:
    return 1
  start = caller.firsts.get(operand)
  while start in caller.copies:
    start = caller.copies[start]
  return max(1, bound - caller.constants.get(start, 0))


def _runs(entry: str, comps: dict) -> dict:
  """Runs per step of each computation. HLO text prints a computation
  after those it calls, so callers come first in reverse order."""
  runs = collections.Counter({entry: 1})
  for name in reversed(list(comps)):
    comp = comps[name]
    for callee, loop in comp.calls:
      times = _trip_count(comps, comp, *loop) if loop else 1
      runs[callee] += runs[name] * times
  return runs


def _program_devices(hlo: str) -> int:
  partitions = re.search(r'num_partitions=(\d+)', hlo)
  replicas = re.search(r'replica_count=(\d+)', hlo)
  return (int(partitions.group(1)) if partitions else 1) * (
      int(replicas.group(1)) if replicas else 1)


def transfers(hlo: str, slice_of) -> list[Transfer]:
  """Every collective and megascale send of ``hlo``, with its network.

  Args:
    hlo: optimized HLO text of one compiled program.
    slice_of: the slice of each device, indexed as the program numbers
      devices (``aot.device_slices(mesh)``).
  """
  slice_of = list(slice_of)
  devices, slices = _program_devices(hlo), len(set(slice_of))
  per_slice_program = slices > 1 and devices * slices == len(slice_of)
  if not per_slice_program and devices != len(slice_of):
    raise ValueError(
        f'the program runs on {devices} devices; slice_of names '
        f'{len(slice_of)} devices in {slices} slices, which is neither that '
        'count nor that count per slice.')
  entry, comps = _parse(hlo)
  runs = _runs(entry, comps)
  found = []
  for name, comp in comps.items():
    for line in comp.lines:
      op = _OP.match(line)
      if not op:
        continue
      shape_text, kind = op.groups()
      if kind == 'send' and _MEGASCALE in line:
        ty = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
        kind = ty.group(1).lower().replace('_', '-') if ty else 'send'
        kind = _MEGASCALE_KINDS.get(kind, kind)
        found.append(Transfer(kind, DCN,
                              _arrays(shape_text)[0], runs[name], name))
        continue
      base = kind[:-len('-start')] if kind.endswith('-start') else kind
      if base not in COLLECTIVES:
        continue
      network = ICI
      if not per_slice_program:
        spans = {len({slice_of[i] for i in g}) for g in _groups(line, devices)}
        network = DCN if max(spans) > 1 else ICI
      found.append(Transfer(base, network, _result_bytes(kind, shape_text),
                            runs[name], name))
  return found


def traffic(hlo: str, slice_of) -> dict:
  """``{(network, kind): bytes per device per step}`` of ``hlo``.

  Args:
    hlo: optimized HLO text of one compiled program.
    slice_of: the slice of each device (see ``transfers``).
  """
  totals = collections.Counter()
  for t in transfers(hlo, slice_of):
    totals[t.network, t.kind] += t.bytes * t.runs
  return dict(totals)


def network_bytes(table: dict, network: str) -> int:
  """The bytes of ``table`` (from ``traffic``) on one network."""
  return sum(b for (net, _), b in table.items() if net == network)


def _size(b: int) -> str:
  return f'{b / 2**20:,.2f} MiB' if b >= 2**20 else f'{b / 2**10:,.1f} KiB'


def summary(table: dict) -> str:
  """'dcn all-reduce 1.00 MiB; ici all-gather 20.0 KiB' of ``traffic``."""
  if not table:
    return 'none'
  return '; '.join(f'{net} {kind} {_size(b)}'
                   for (net, kind), b in sorted(table.items()))


