"""Two slices of v5e:2x2 ('2xv5e:2x2'), compiled with libtpu on any machine:
the devices and their slices, the hybrid mesh, and the bytes a compiled
step sends over DCN and ICI. Skipped without libtpu; the arithmetic and the
HLO classifier are tested without it in tests/docs/test_multislice.py."""
import collections
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import pytest

from benchmarks import aot
from benchmarks import traffic

from tests.tpu.marks import ROOT, needs_libtpu

TWO = '2xv5e:2x2'


@needs_libtpu
def test_two_slices_give_four_devices_each():
  devices = aot.topology_devices(TWO)
  assert collections.Counter(aot.slice_indices(devices)) == {0: 4, 1: 4}
  assert aot.slice_indices(aot.topology_devices('v5e:2x2')) == [0] * 4


@needs_libtpu
def test_hybrid_mesh_puts_the_slices_outermost_on_their_axis():
  mesh = aot.topology_mesh(TWO, {'data': -1, 'model': 2}, {'data': 2})
  assert dict(mesh.shape) == {'data': 4, 'model': 2}
  slices = [[d.slice_index for d in row] for row in mesh.devices]
  assert slices == [[0, 0], [0, 0], [1, 1], [1, 1]]
  stages = aot.topology_mesh(TWO, {'stage': 2, 'data': -1})  # default: first
  assert [{d.slice_index for d in row} for row in stages.devices] == [{0},
                                                                       {1}]
  assert aot.device_slices(stages) == [0, 0, 0, 0, 1, 1, 1, 1]


@needs_libtpu
def test_a_mesh_that_does_not_fit_the_slices_names_axis_and_numbers():
  with pytest.raises(aot.MeshTopologyError,
                     match=r"2xv5e:2x2: the DCN axes \{'stage': 4\} span 4 "
                     r'slices; the topology has 2'):
    aot.topology_mesh(TWO, {'stage': 4, 'data': -1}, {'stage': 4})
  with pytest.raises(aot.MeshTopologyError,
                     match=r"mesh \{'data': 2, 'model': 2\} needs 2 devices "
                     r'per slice'):
    aot.topology_mesh(TWO, {'data': 2, 'model': 2}, {'data': 2})


def _grad_traffic(topology, axes, dcn):
  """Bytes per step of the gradient of a 512x512 matmul loss, the kernel
  split over 'model' and the batch over every device."""
  mesh = aot.topology_mesh(topology, axes, dcn)
  kernel = NamedSharding(mesh, PartitionSpec(None, 'model'))
  args = (jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=kernel),
          jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(
              mesh, PartitionSpec(('data', 'model')))))
  grad = jax.jit(jax.grad(lambda w, x: jnp.sum((x @ w)**2)),
                 out_shardings=kernel)

  def lower():
    with jax.set_mesh(mesh):
      return grad.lower(*args)

  report, _ = aot.compile_report('grad', lower, mesh)
  assert report.fits
  return report.traffic


@needs_libtpu
def test_data_parallel_across_slices_all_reduces_the_gradient_over_dcn():
  # data 2 = the two slices; the kernel's gradient, a quarter per chip
  # (512 x 128 f32), is summed across them: that is the DCN traffic.
  across = _grad_traffic(TWO, {'data': 2, 'model': 4}, {'data': 2})
  assert {k for k in across if k[0] == 'dcn'} == {('dcn', 'all-reduce')}
  assert across['dcn', 'all-reduce'] == 512 * 128 * 4
  assert traffic.network_bytes(across, 'ici') > 0  # the batch's all-gather
  # The same mesh within one slice of 8 chips: nothing crosses DCN.
  within = _grad_traffic('v5e:2x4', {'data': 2, 'model': 4}, {})
  assert traffic.network_bytes(within, 'dcn') == 0
  assert traffic.network_bytes(within, 'ici') > 0


_PIPELINE_ROWS = """
import json
import jax, jax.numpy as jnp, liftmods as nn
from benchmarks import pipeline
x = jax.ShapeDtypeStruct((32, 256), jnp.float32)
for stages, pipe in ((1, None), (2, nn.Pipeline(stages=2, microbatches=4))):
  stack = nn.Stack(pipeline.Block, 4, policy='full', pipeline=pipe)(256)
  r = pipeline.tpu_report('row', stack, stages, x, '2xv5e:2x2')
  table = {'/'.join(k): b for k, b in r.traffic.items()}
  print('ROW', r.fits, json.dumps(table))
"""


@needs_libtpu
def test_stages_across_slices_send_only_activations_over_dcn():
  # Its own process: benchmarks.pipeline defines absl flags.
  out = subprocess.run([sys.executable, '-c', _PIPELINE_ROWS], cwd=ROOT,
                       capture_output=True, text=True, check=True).stdout
  rows = [line.split(' ', 2)[1:] for line in out.splitlines()
          if line.startswith('ROW')]
  (plain_fits, plain), (piped_fits, piped) = rows
  assert plain_fits == piped_fits == 'True'
  plain, piped = ({tuple(k.split('/')): b for k, b in json.loads(t).items()}
                  for t in (plain, piped))
  # Unpipelined, the batch over both slices: DCN carries the gradients'
  # all-reduce, a quarter of them per chip (the rest is reduced within the
  # slice): 4 layers of 263,424 f32 parameters.
  grads = 4 * 263424 * 4
  assert {k for k in plain if k[0] == 'dcn'} == {('dcn', 'all-reduce')}
  assert grads / 4 <= plain['dcn', 'all-reduce'] < 1.01 * grads / 4
  # One stage per slice (GPipe, M=4, S=2): only the activations cross, a
  # microbatch (8 rows of 256 f32) split over 4 chips, once forward and once
  # backward in each of the M + S - 1 = 5 iterations.
  assert {k for k in piped if k[0] == 'dcn'} == {('dcn', 'collective-permute')}
  assert piped['dcn', 'collective-permute'] == 2 * 5 * (8 // 4) * 256 * 4


@needs_libtpu
def test_lm_rows_across_slices_keep_dcn_to_what_the_layout_must_carry():
  from benchmarks import scaling  # pylint: disable=g-import-not-at-top
  from examples.lm.model import Config  # pylint: disable=g-import-not-at-top
  cfg = Config(vocab_size=512, max_len=64, num_layers=2, num_heads=4,
               d_model=256, dropout_rate=0.0)
  data, stages = (scaling.compile_row('tiny', TWO, sharding, 'liftmods',
                                      'full', 4, cfg=cfg)
                  for sharding in ('dcn_fsdp', 'stage_fsdp'))
  assert data.report.fits and stages.report.fits, (
      data.report.verdict(), stages.report.verdict())
  # Data parallel across slices, FSDP within: DCN carries only the
  # gradients' all-reduce, each chip at least its FSDP shard of them (a
  # quarter; measured 1.39 times that at this small width) and well under
  # the whole.
  dcn = {k: b for k, b in data.report.traffic.items() if k[0] == 'dcn'}
  assert set(dcn) == {('dcn', 'all-reduce')}
  grads = 4 * scaling.n_params(cfg)
  assert grads / 4 <= dcn['dcn', 'all-reduce'] < grads / 2
  # One stage per slice (GPipe, M=8): the stack's activations cross DCN, a
  # microbatch (32 / 8 rows of 64 x 256 f32) split over a slice's 4 chips,
  # forward and backward in each of the M + S - 1 = 9 iterations (and,
  # measured, 2 KiB more, once).
  assert 'gpipe M=8' in stages.report.label
  activations = 2 * 9 * (32 // 8 // 4) * 64 * 256 * 4
  permute = stages.report.traffic['dcn', 'collective-permute']
  assert activations <= permute < 1.01 * activations


@needs_libtpu
def test_sweep_starts_where_each_layout_s_state_alone_overflows():
  from benchmarks import scaling  # pylint: disable=g-import-not-at-top
  # Data parallel across two v5p-128 slices keeps a slice's FSDP shard, as
  # one slice does; a stage per slice splits the layers over all 256 chips,
  # as FSDP over both slices would.
  one = scaling.sweep_start('8b', 'v5p:4x4x8', 16, 'fsdp')
  assert scaling.sweep_start('8b', '2xv5p:4x4x8', 16, 'dcn_fsdp') == one
  assert scaling.sweep_start('8b', '2xv5p:4x4x8', 16, 'stage_fsdp') == (
      scaling.sweep_start('8b', '2xv5p:4x4x8', 16, 'fsdp'))
  # the first multiple of 16 layers whose f32 parameters and two AdamW
  # moments, over 128 chips, exceed a v5p chip's 95 GiB
  state = lambda layers: 12 * scaling.n_params(scaling.config('8b', layers))
  assert state(one - 16) / 128 <= 95 * aot.GIB < state(one) / 128


@needs_libtpu
def test_sweep_probe_reports_each_count_with_its_networks(monkeypatch, capsys):
  from benchmarks import scaling  # pylint: disable=g-import-not-at-top
  # A tiny width (vocab, seq, layers, heads, d_model) under the sweep's
  # probe: one stage per slice of 2xv5e:2x2, GPipe with 4 microbatches.
  monkeypatch.setitem(scaling.SIZES, 'tiny', (512, 64, 2, 4, 256))
  spec = dict(size='tiny', topology=TWO, sharding='stage_fsdp',
              library='liftmods', policy='full', chip_batch=4,
              precision='f32', layers=0, micro=4, mode='gpipe')
  report = scaling.sweep_probe(spec)(4)
  assert report.fits and 'L=4' in report.label
  # a microbatch (32 / 4 rows of 64 x 256 f32) over a slice's 4 chips,
  # each way in each of the M + S - 1 = 5 iterations
  permute = report.traffic['dcn', 'collective-permute']
  assert 2 * 5 * 2 * 64 * 256 * 4 <= permute < 1.01 * 2 * 5 * 2 * 64 * 256 * 4
  printed = capsys.readouterr().out
  assert f'{report.label}: fits' in printed and 'MiB per chip per step' in (
      printed)
  assert traffic.summary(report.traffic) in printed  # by collective


@needs_libtpu
def test_interleaved_stage_rows_send_more_microbatches_over_dcn():
  from benchmarks import scaling  # pylint: disable=g-import-not-at-top
  from examples.lm.model import Config  # pylint: disable=g-import-not-at-top
  cfg = Config(vocab_size=512, max_len=64, num_layers=4, num_heads=4,
               d_model=256, dropout_rate=0.0)
  plain, interleaved = (
      scaling.compile_row('tiny', TWO, 'stage_fsdp', 'liftmods', 'full', 4,
                          cfg=cfg, micro=4, mode='1f1b', repeats=repeats)
      for repeats in (1, 2))
  assert plain.report.fits and interleaved.report.fits
  assert plain.report.label.endswith('1f1b M=4')
  assert interleaved.report.label.endswith('1f1b M=4 R=2')
  # Each send is a microbatch (32 / 4 rows of 64 x 256 f32) over a slice's
  # 4 chips, about two per iteration of the training loop: 1F1B runs
  # M + 2S - 2 = 6 iterations and sends 10 microbatches, interleaved
  # (v=2: a microbatch crosses the slices three times forward, not once)
  # runs M v + v S + S - 2 = 12 and sends 21; measured, with one 4-byte
  # permute besides. The 8B rows in docs/tpu.md send 18 and 37.
  micro = 2 * 64 * 256 * 4
  permutes = [r.report.traffic['dcn', 'collective-permute']
              for r in (plain, interleaved)]
  assert [p // micro for p in permutes] == [10, 21], permutes
  assert all(p % micro < 1024 for p in permutes), permutes
