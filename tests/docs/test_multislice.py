"""Multi-slice plans without libtpu: slice counts in topology names, the
hybrid mesh's shapes and its errors (pure arithmetic over device counts),
the DCN / ICI classifier of ``benchmarks/traffic.py`` on hand-written
HLO, and the arithmetic of the sweep across slices
(``benchmarks/layouts.py``). The same paths compiled for real slices are in
tests/tpu."""
import json
import pathlib
import subprocess
import sys
import types

import pytest

from benchmarks import aot
from benchmarks import layouts
from benchmarks import traffic

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize('name,expected', [
    ('v5e:4x4', ('v5e:4x4', 1)), ('2xv5e:4x4', ('v5e:4x4', 2)),
    ('4xv5p:8x8x8', ('v5p:8x8x8', 4)), ('v5litepod-16', ('v5litepod-16', 1)),
])
def test_split_slices_reads_the_count_prefix(name, expected):
  assert aot.split_slices(name) == expected


def test_with_slices_folds_the_flag_into_the_name():
  assert aot.with_slices('v5p:8x8x8', 4) == '4xv5p:8x8x8'
  assert aot.with_slices('v5e:2x2', 1) == 'v5e:2x2'
  assert aot.with_slices('2xv5e:2x2', 2) == '2xv5e:2x2'
  with pytest.raises(aot.MeshTopologyError, match=r'names 2 slices but '
                     r'--num_slices=4'):
    aot.with_slices('2xv5e:2x2', 4)
  with pytest.raises(aot.MeshTopologyError, match='at least 1'):
    aot.with_slices('v5e:2x2', 0)
  with pytest.raises(aot.MeshTopologyError, match='at least 1, not 0'):
    aot.split_slices('0xv5e:2x2')


def test_chip_of_a_multislice_name_is_the_slices_chip():
  assert aot.chip('4xv5p:8x8x8') == aot.CHIPS['v5p']
  assert aot.chip('2xv5e:16x16')['hbm_gib'] == 16


def test_parse_dcn_axes():
  assert aot.parse_dcn_axes(['data:2']) == {'data': 2}
  assert aot.parse_dcn_axes('stage:2,data:2') == {'stage': 2, 'data': 2}
  assert aot.parse_dcn_axes([]) == {}
  for bad in ('data', 'data:x', 'data:0'):
    with pytest.raises(aot.MeshTopologyError, match=f'entry {bad!r}: expected '
                       'AXIS:SLICES'):
      aot.parse_dcn_axes([bad])


def test_default_dcn_puts_every_slice_on_the_first_axis():
  assert aot.default_dcn({'stage': 2, 'data': -1}, 1) == {}
  assert aot.default_dcn({'stage': 4, 'data': -1}, 4) == {'stage': 4}
  assert aot.default_dcn({'data': -1, 'model': 4}, 2) == {'data': 2}


@pytest.mark.parametrize('axes,dcn,slices,per_slice,ici,over', [
    # data parallel across 2 slices of 16: data 8 = 2 slices x 4 chips
    ({'data': -1, 'model': 4}, {'data': 2}, 2, 16,
     {'data': 4, 'model': 4}, {'data': 2, 'model': 1}),
    # one stage per slice, the batch over each slice's chips
    ({'stage': 4, 'data': -1}, {'stage': 4}, 4, 256,
     {'stage': 1, 'data': 256}, {'stage': 4, 'data': 1}),
    # both: 2 stages x 2 data replicas across 4 slices
    ({'stage': 2, 'data': -1}, {'stage': 2, 'data': 2}, 4, 8,
     {'stage': 1, 'data': 8}, {'stage': 2, 'data': 2}),
    # one slice: the plain mesh
    ({'data': -1}, {}, 1, 4, {'data': 4}, {'data': 1}),
])
def test_hybrid_shapes_split_each_axis_into_slices_and_chips(
    axes, dcn, slices, per_slice, ici, over):
  assert aot.hybrid_shapes('t', axes, dcn, slices, per_slice) == (ici, over)


@pytest.mark.parametrize('axes,dcn,slices,per_slice,message', [
    ({'data': -1}, {'pipe': 2}, 2, 4,
     r"2xv5e:2x2: DCN axis 'pipe' is not an axis of the mesh \('data',\)"),
    ({'stage': 2, 'data': -1}, {'stage': 2}, 4, 4,
     r"the DCN axes \{'stage': 2\} span 2 slices; the topology has 4"),
    ({'stage': 3, 'data': -1}, {'data': 2}, 2, 4,
     r"mesh \{'stage': 3, 'data': -1\} cannot use its 8 devices: they are "
     r"not a multiple of the other axes' 3"),
    ({'stage': 2, 'data': 3}, {'data': 2}, 2, 3,
     r"mesh axis 'data' of size 3 cannot span 2 slices \(3 is not a "
     r'multiple of 2\)'),
    ({'stage': 2, 'data': 4}, {'stage': 2}, 2, 8,
     r"mesh \{'stage': 2, 'data': 4\} needs 4 devices per slice "
     r"\(\{'stage': 1, 'data': 4\}, with \{'stage': 2\} across\); a slice "
     r'has 8'),
    ({'data': 8}, {}, 1, 4, r"mesh \{'data': 8\} needs 8 devices; a slice "
     r'has 4\.'),
    ({'a': -1, 'b': -1}, {'a': 2}, 2, 4, r'one axis size to the devices '
     r'\(-1\), not 2'),
])
def test_hybrid_shapes_errors_name_the_axis_and_the_numbers(
    axes, dcn, slices, per_slice, message):
  with pytest.raises(aot.MeshTopologyError, match=message):
    aot.hybrid_shapes('2xv5e:2x2', axes, dcn, slices, per_slice)


def test_topology_mesh_refuses_slices_the_compiler_did_not_give(monkeypatch):
  fake = [types.SimpleNamespace(slice_index=s) for s in (0, 0, 0, 1)]
  monkeypatch.setattr(aot, 'topology_devices', lambda _: fake)
  with pytest.raises(aot.MeshTopologyError, match=r"2xv5e:2x2: expected 2 "
                     r'slices of equal size; the compiler gave devices per '
                     r'slice \{0: 3, 1: 1\}'):
    aot.topology_mesh('2xv5e:2x2', {'data': -1})


# -- traffic by network ------------------------------------------------------

# A global program over 8 devices (slices 0-3 and 4-7 in the test's map):
# a loop of 5 runs whose body has a cross-slice collective-permute, a fusion
# calling an in-slice reduce-scatter, and a nested loop of 3 runs with an
# all-gather over iota groups [4,2]<=[2,4]T(1,0) ({0,4},{1,5},...: across
# slices); the entry has an async all-reduce over all devices and an async
# all-gather within slices.
GLOBAL_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_rs (p: f32[64]) -> f32[16] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%p), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
}

%inner_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %ag = bf16[16]{0} all-gather(%x), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %x)
}

%inner_cond (t: (s32[], f32[8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%outer_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %cp = f32[8]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}
  %f = f32[16]{0} fusion(%y), kind=kOutput, calls=%fused_rs
  %w = (s32[], f32[8]{0}) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %cp)
}

%outer_cond (t: (s32[], f32[8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %ars = f32[32]{0} all-reduce-start(%x), channel_id=5, replica_groups={}, to_apply=%add
  %ard = f32[32]{0} all-reduce-done(%ars)
  %ags = (f32[8]{0}, f32[32]{0}) all-gather-start(%x), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = f32[32]{0} all-gather-done(%ags)
  %w = (s32[], f32[8]{0}) while(%t), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
}
"""
TWO_SLICES = [0, 0, 0, 0, 1, 1, 1, 1]


def test_traffic_classifies_each_collective_by_its_groups_and_counts_runs():
  assert traffic.traffic(GLOBAL_HLO, TWO_SLICES) == {
      ('dcn', 'collective-permute'): 5 * 8 * 4,
      ('ici', 'reduce-scatter'): 5 * 16 * 4,
      ('dcn', 'all-gather'): 5 * 3 * 16 * 2,
      ('dcn', 'all-reduce'): 32 * 4,  # replica_groups={}: every device
      ('ici', 'all-gather'): 32 * 4,  # the async result, not its operand
  }


def test_the_same_program_on_one_slice_is_all_ici():
  table = traffic.traffic(GLOBAL_HLO, [0] * 8)
  assert traffic.network_bytes(table, 'dcn') == 0
  assert traffic.network_bytes(table, 'ici') == (
      5 * 8 * 4 + 5 * 16 * 4 + 5 * 3 * 16 * 2 + 32 * 4 + 32 * 4)


def test_slices_split_elsewhere_change_the_network():
  # slices {0,1}, {2,3}, ...: the permute pairs {0,4} cross, the iota
  # groups {0,4},{1,5} cross, the in-slice groups of 4 cross too.
  table = traffic.traffic(GLOBAL_HLO, [0, 0, 1, 1, 2, 2, 3, 3])
  assert traffic.network_bytes(table, 'ici') == 0


# The TPU compiler's per-slice program (4 devices of a 2-slice job): the
# cross-slice half of an all-reduce and a ppermute are megascale sends, in a
# loop whose trip count only its condition gives (counter < 4, from 0).
PER_SLICE_HLO = """\
HloModule jit_f, is_scheduled=true, num_partitions=4

%body (t: (s32[], f32[64,128])) -> (s32[], f32[64,128]) {
  %t = (s32[], f32[64,128]{1,0}) parameter(0)
  %g = f32[64,128]{1,0} get-tuple-element(%t), index=1
  %send = (f32[64,128]{1,0:T(8,128)}, u32[], token[]) send(%g, %after-all), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce_0",_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv = (f32[64,128]{1,0:T(8,128)}, u32[], token[]) recv(%after-all), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_REDUCE"}
  %send.1 = (bf16[8,128]{1,0}, u32[], token[]) send(%h, %after-all), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ONE_TO_ONE"}
  %ar = f32[64,128]{1,0} all-reduce(%g), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %r = (s32[], f32[64,128]{1,0}) tuple(%i, %ar)
}

%cond (t: (s32[], f32[64,128])) -> pred[] {
  %limit = s32[]{:T(128)} constant(4)
  %t = (s32[], f32[64,128]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %limit), direction=LT
}

ENTRY %main.0_spmd (x: f32[64,128]) -> f32[64,128] {
  %x = f32[64,128]{1,0} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %t = (s32[], f32[64,128]{1,0}) tuple(%zero, %x)
  %w = (s32[], f32[64,128]{1,0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[64,128]{1,0} get-tuple-element(%w), index=1
}
"""


def test_megascale_sends_are_dcn_and_the_per_slice_program_is_ici():
  found = traffic.transfers(PER_SLICE_HLO, TWO_SLICES)
  assert [(t.network, t.kind, t.bytes, t.runs) for t in found] == [
      ('dcn', 'all-reduce', 64 * 128 * 4, 4),
      ('dcn', 'collective-permute', 8 * 128 * 2, 4),
      ('ici', 'all-reduce', 64 * 128 * 4, 4)]
  assert traffic.summary(traffic.traffic(PER_SLICE_HLO, TWO_SLICES)) == (
      'dcn all-reduce 128.0 KiB; dcn collective-permute 8.0 KiB; '
      'ici all-reduce 128.0 KiB')
  assert traffic.summary({('dcn', 'all-reduce'): 3 * 2**20}) == (
      'dcn all-reduce 3.00 MiB')
  assert traffic.summary({}) == 'none'


def test_trip_count_from_the_condition_counts_from_the_counters_start():
  started = PER_SLICE_HLO.replace('constant(0)', 'constant(1)')
  assert {t.runs for t in traffic.transfers(started, TWO_SLICES)} == {3}
  # a peeled loop: the counter starts at a copy of a constant
  copied = started.replace(
      'tuple(%zero, %x)',
      'tuple(%one, %x)\n  %one = s32[]{:T(128)} copy(%zero)')
  assert {t.runs for t in traffic.transfers(copied, TWO_SLICES)} == {3}
  unreadable = PER_SLICE_HLO.replace('direction=LT', 'direction=NE')
  assert {t.runs for t in traffic.transfers(unreadable, TWO_SLICES)} == {1}


def test_traffic_refuses_a_slice_map_of_another_device_count():
  with pytest.raises(ValueError, match=r'runs on 8 devices; slice_of names '
                     r'12 devices in 2 slices'):
    traffic.traffic(GLOBAL_HLO, [0] * 6 + [1] * 6)


# -- the sweep across slices (benchmarks/layouts.py) -------------------------

@pytest.mark.parametrize('sharding,sizes,split', [
    # two slices of 128 chips
    ('dcn_fsdp', {'slice': 2, 'data': 128}, 128),  # a replica per slice
    ('stage_fsdp', {'stage': 2, 'data': 128}, 256),  # half the layers each
    ('fsdp', {'data': 256}, 256),
    ('fsdp_tp', {'data': 64, 'model': 4}, 256),
    ('data', {'data': 256}, 1),
])
def test_state_split_counts_only_the_axes_parameters_are_split_over(
    sharding, sizes, split):
  assert layouts.mesh_sizes(sharding, 256, 2) == sizes
  assert layouts.state_split(sharding, 256, 2) == split


def test_one_slice_layouts_keep_a_size_one_slice_axis():
  assert layouts.mesh_sizes('dcn_fsdp', 16, 1) == {'slice': 1, 'data': 16}
  assert layouts.state_split('stage_fsdp', 16, 1) == 16
  with pytest.raises(aot.MeshTopologyError, match=r"sharding 'fsdp_tp': mesh "
                     r"\{'data': -1, 'model': 4\} cannot use 6 chips"):
    layouts.mesh_sizes('fsdp_tp', 6, 1)
  with pytest.raises(ValueError, match=r"sharding 'pipe': expected one of "
                     r"\['data', 'fsdp'"):
    layouts.state_split('pipe', 16, 1)


def test_sweep_step_must_divide_into_one_stage_per_slice():
  layouts.check_sweep_step('stage_fsdp', '4xv5p:4x4x8', 16)
  layouts.check_sweep_step('dcn_fsdp', '4xv5p:4x4x8', 6)  # no stages
  with pytest.raises(ValueError, match=r'--sweep_step=6: stage_fsdp on '
                     r'4xv5p:4x4x8 splits the layers over 4 stages \(one per '
                     r'slice\), so the step must be a multiple of 4\.'):
    layouts.check_sweep_step('stage_fsdp', '4xv5p:4x4x8', 6)
  with pytest.raises(ValueError, match='--sweep_step=0: expected at least 1'):
    layouts.check_sweep_step('fsdp', 'v5e:4x4', 0)


def test_sweep_step_counts_the_chunks_of_an_interleaved_pipeline():
  layouts.check_sweep_step('stage_fsdp', '2xv5p:4x4x8', 4, repeats=2)
  layouts.check_sweep_step('dcn_fsdp', '2xv5p:4x4x8', 2, repeats=2)
  with pytest.raises(ValueError, match=r'--sweep_step=6: stage_fsdp on '
                     r'2xv5p:4x4x8 splits the layers over 2 stages \(one per '
                     r'slice\) x 2 repeats, so the step must be a multiple of '
                     r'4\.'):
    layouts.check_sweep_step('stage_fsdp', '2xv5p:4x4x8', 6, repeats=2)


# benchmarks.scaling's flags, parsed in a process of their own (other
# benchmark modules define flags of the same names).
_SCALING_FLAGS = """
import json, sys
from absl import app
from benchmarks import scaling
out = {}
for name, argv in json.loads(sys.argv[1]).items():
  scaling.F.unparse_flags()
  scaling.F(['scaling'] + argv)
  try:
    specs = scaling.sweep_specs()
  except app.UsageError as e:
    out[name] = str(e)
    continue
  pipes = [scaling.pipeline_for(s['sharding'], s['topology'], s['micro'],
                                s['mode'], s['repeats']) for s in specs]
  out[name] = [[s['sharding'], s['repeats']] + (
      [] if p is None else [p.stages, p.microbatches, p.repeats, p.mode,
                            p.iterations, p.bubble_fraction])
      for s, p in zip(specs, pipes)]
print(json.dumps(out))
"""
_TWO_V5P = ['--sizes=8b', '--slices=2xv5p:4x4x8', '--policies=full',
            '--libraries=liftmods', '--sharding=dcn_fsdp,stage_fsdp']


def _scaling_plans(**argvs):
  result = subprocess.run(
      [sys.executable, '-c', _SCALING_FLAGS, json.dumps(argvs)], cwd=ROOT,
      capture_output=True, text=True, check=True)
  return json.loads(result.stdout.splitlines()[-1])


def test_scaling_pipeline_repeats_reach_the_stage_rows_pipeline():
  plans = _scaling_plans(
      interleaved=_TWO_V5P + ['--pipeline_mode=1f1b', '--pipeline_repeats=2',
                              '--sweep_step=4'],
      default=_TWO_V5P + ['--sweep_step=2'],
      bad_step=_TWO_V5P + ['--pipeline_mode=1f1b', '--pipeline_repeats=2',
                           '--sweep_step=6'],
      bad_micro=_TWO_V5P + ['--pipeline_mode=1f1b', '--pipeline_repeats=2',
                            '--pipeline_micro=3'],
      bad_repeats=_TWO_V5P + ['--pipeline_repeats=0'])
  # Interleaved 1F1B, S=2 M=8 v=2: M v + v S + S - 2 = 20 iterations, the
  # formula bubble (S - 1) / (M v + S - 1) = 1/17; dcn_fsdp has no pipeline.
  assert plans['interleaved'] == [
      ['dcn_fsdp', 2], ['stage_fsdp', 2, 2, 8, 2, '1f1b', 20, 1 / 17]]
  assert plans['default'] == [
      ['dcn_fsdp', 1], ['stage_fsdp', 1, 2, 8, 1, 'gpipe', 9, 1 / 9]]
  assert plans['bad_step'] == (
      '--sweep_step=6: stage_fsdp on 2xv5p:4x4x8 splits the layers over 2 '
      'stages (one per slice) x 2 repeats, so the step must be a multiple of '
      '4.')
  assert plans['bad_micro'].startswith(
      'stage_fsdp on 2xv5p:4x4x8 (--pipeline_micro=3, --pipeline_mode=1f1b, '
      "--pipeline_repeats=2): Pipeline: interleaved mode='1f1b' (repeats=2) ")
  assert 'microbatches must be a multiple of stages' in plans['bad_micro']
  assert plans['bad_repeats'] == (
      'stage_fsdp on 2xv5p:4x4x8 (--pipeline_micro=8, --pipeline_mode=gpipe, '
      '--pipeline_repeats=0): Pipeline.repeats must be a positive int; got 0.')


def test_sweep_skips_the_rows_that_cannot_be_built():
  row = lambda library, policy, sharding: dict(
      library=library, policy=policy, sharding=sharding)
  assert layouts.sweep_skip(row('liftmods', 'full', 'stage_fsdp')) is None
  assert layouts.sweep_skip(row('linen', 'full', 'dcn_fsdp')) is None
  assert 'no pipeline' in layouts.sweep_skip(row('linen', 'full',
                                                 'stage_fsdp'))
  assert 'remat_scan' in layouts.sweep_skip(row('linen', 'nested', 'fsdp'))
  for policy in ('nested', 'nested_offload'):  # groups would cross stages
    assert 'nested policy under a pipeline' in layouts.sweep_skip(
        row('liftmods', policy, 'stage_fsdp'))
  assert layouts.sweep_skip(row('liftmods', 'nested', 'dcn_fsdp')) is None


def _fake(layers, fits, temp=0, traffic_table=None, needs=None):
  if fits:
    return aot.Report(f'L={layers}', 100.0, argument=2 * aot.MIB, temp=temp,
                      traffic=traffic_table)
  return aot.Report(f'L={layers}', 5.0, fits=False, needs_gib=needs,
                    available_gib=95.74)


def test_sweep_row_gives_the_networks_of_the_largest_fitting_program():
  spec = dict(sharding='dcn_fsdp', library='liftmods', policy='full',
              precision='f32')
  big = {('dcn', 'all-reduce'): 3 * aot.MIB, ('ici', 'all-gather'): aot.MIB,
         ('ici', 'all-reduce'): aot.MIB / 2}
  reports = {5408: _fake(5408, False, needs=900.0),
             560: _fake(560, False, needs=96.5),
             544: _fake(544, True, temp=10 * aot.MIB, traffic_table=big),
             512: _fake(512, True, temp=aot.MIB,
                        traffic_table={('dcn', 'all-reduce'): aot.MIB})}
  row = layouts.format_sweep(spec, reports, 16, lambda n: n * 1e8)
  assert row == ('| dcn_fsdp | liftmods | full | f32 | 544 | 54.40 | 12 | 10 '
                 '| 3.0 | 1.5 | 560 | 96.50 of 95.74 | 4 (2) | 210 |')
  assert row.count('|') == layouts.SWEEP_HEADER.count('|')


def test_sweep_row_when_nothing_fits():
  spec = dict(sharding='stage_fsdp', library='liftmods', policy='none',
              precision='f32')
  row = layouts.format_sweep(spec, {5408: _fake(5408, False, needs=900.0),
                                    16: _fake(16, False)}, 16, lambda n: n)
  assert row == ('| stage_fsdp | liftmods | none | f32 | fewer than 16 | - | '
                 '- | - | - | - | 16 | n/a | 2 (0) | 10 |')


def test_sweep_row_of_a_search_the_compiler_stopped():
  spec = dict(sharding='stage_fsdp', library='liftmods', policy='offload',
              precision='f32')
  error = RuntimeError('INTERNAL: during context [post-optimization]: a | b\n'
                       'more')
  row = layouts.format_failed(spec, error)
  assert row == ('| stage_fsdp | liftmods | offload | f32 | compile failed: '
                 'INTERNAL: during context [post-optimization]: a / b | - | '
                 '- | - | - | - | - | - | - | - |')
  assert row.count('|') == layouts.SWEEP_HEADER.count('|')


def test_the_nested_rows_skipped_under_stages_are_ones_nn_stack_refuses():
  import liftmods as nn  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(x)

  pipe = nn.Pipeline(stages=2, microbatches=2)
  with pytest.raises(ValueError, match='a nested policy groups layers across '
                     'the whole stack, which a pipeline splits into stages'):
    nn.Stack(Block, 4, policy='nested', pipeline=pipe)()
