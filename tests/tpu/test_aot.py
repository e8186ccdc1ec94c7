"""Programs compiled ahead of time for a TPU slice (v5e:2x2) on any machine.

The compile tests need libtpu (``pip install -e '.[tpu]'``) and skip without
it; the offload decision and the error parsing need nothing.
"""
import subprocess
import sys
import warnings

import flax.linen as fnn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from jax.sharding import NamedSharding, PartitionSpec
import pytest

import liftmods as lnn
from benchmarks import aot
from liftmods import stack as stack_lib

from tests.tpu.marks import ROOT, needs_libtpu


def abstract_mesh(platform):
  device = AbstractDevice(device_kind='any', num_cores=1, platform=platform)
  return AbstractMesh((2,), ('data',), (AxisType.Explicit,),
                      abstract_device=device)


@pytest.mark.parametrize('platform,expected', [('tpu', True), ('gpu', True),
                                               ('cpu', False)])
def test_offload_follows_the_target_mesh_not_the_default_backend(
    platform, expected):
  with jax.sharding.use_abstract_mesh(abstract_mesh(platform)):
    assert stack_lib.target_platform() == platform
    assert stack_lib.offload_supported() is expected
  assert stack_lib.target_platform() == jax.default_backend()


def test_offload_warning_names_the_target_platform():
  layer = lnn.Stack(lnn.Dense, 2, policy='offload')(4)
  x = jnp.ones((2, 4))
  # the same variables; initialized without the policy, which on this CPU
  # would warn outside the checks below
  variables = lnn.Stack(lnn.Dense, 2)(4).init(jax.random.key(0), x)
  loss = lambda v: jnp.sum(layer.apply(v, x))
  with jax.sharding.use_abstract_mesh(abstract_mesh('cpu')):
    with pytest.warns(lnn.StackOffloadWarning,
                      match=r'target platform \(cpu\).*jax.set_mesh'):
      jax.eval_shape(jax.grad(loss), variables)
  with jax.sharding.use_abstract_mesh(abstract_mesh('tpu')):
    with warnings.catch_warnings():
      warnings.simplefilter('error', lnn.StackOffloadWarning)
      jax.make_jaxpr(jax.grad(loss))(variables)


def test_parse_oom_reads_both_tpu_messages():
  assert aot.parse_oom(
      'RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory '
      'required for HLO temporaries (20.56G) exceeds available HBM (15.75G)'
  ) == pytest.approx((20.56, 15.75))
  assert aot.parse_oom('Used 19.59G of 15.75G hbm. Exceeded hbm capacity by '
                       '3.84G.') == pytest.approx((19.59, 15.75))
  assert aot.parse_oom('Used 512.0M of 15.75G hbm') == pytest.approx(
      (0.5, 15.75))
  assert aot.parse_oom(
      'RESOURCE_EXHAUSTED: Allocation (size=341449900032) would exceed '
      'memory (size=137438953472) :: %s0 = inlined_call_operand'
  ) == pytest.approx((318.0, 128.0), abs=0.01)
  assert aot.parse_oom('INTERNAL: something else') is None


def test_topology_without_libtpu_says_what_to_install(monkeypatch):
  monkeypatch.setattr(aot, 'libtpu_available', lambda: False)
  with pytest.raises(aot.LibtpuMissingError, match=r'pip install -e "\.\[tpu\]"'):
    aot.topology_devices('v5e:2x2')


# -- compiled for v5e:2x2 ---------------------------------------------------

DEPTH, HIDDEN, BATCH = 16, 512, 16384  # activations leave on-chip memory


class Block(lnn.Module):

  @lnn.compact
  def __call__(self, x):
    h = lnn.gelu(lnn.Dense(4 * x.shape[-1])(lnn.LayerNorm()(x)))
    return x + lnn.Dense(x.shape[-1])(h)


class LinenBlock(fnn.Module):

  @fnn.compact
  def __call__(self, x, _):
    h = fnn.gelu(fnn.Dense(4 * x.shape[-1])(fnn.LayerNorm()(x)))
    return x + fnn.Dense(x.shape[-1])(h), None


def stack_grad_report(model, params_of, label):
  mesh = aot.topology_mesh('v5e:2x2', {'data': -1})
  x = jax.ShapeDtypeStruct((BATCH, HIDDEN), jnp.float32,
                           sharding=NamedSharding(mesh, PartitionSpec('data')))
  with jax.set_mesh(mesh):
    v = jax.eval_shape(lambda: params_of(model.init(
        jax.random.key(0), jnp.ones((1, HIDDEN)))))
  v = aot.abstract(v, NamedSharding(mesh, PartitionSpec()))
  grad = jax.grad(lambda v, x: jnp.mean(model.apply(v, x)))

  def lower():
    with jax.set_mesh(mesh):
      return jax.jit(grad).lower(v, x)

  report, _ = aot.compile_report(label, lower)
  assert report.fits, report.verdict()
  return report


@pytest.fixture(scope='module')
def stack_reports():
  def liftmods(policy):
    return lnn.Stack(Block, DEPTH, policy=policy)(name='blocks')

  linen = fnn.scan(fnn.remat(LinenBlock, prevent_cse=False),
                   variable_axes={'params': 0},
                   split_rngs={'params': True}, length=DEPTH)(name='blocks')
  with warnings.catch_warnings():
    warnings.simplefilter('error', lnn.StackOffloadWarning)
    return {
        'full': stack_grad_report(liftmods('full'), lnn.unbox, 'full'),
        'offload': stack_grad_report(liftmods('offload'), lnn.unbox,
                                     'offload'),
        'linen': stack_grad_report(
            _LinenHolder(linen), lambda v: v, 'linen'),
    }


class _LinenHolder(fnn.Module):
  """Calls a Linen scan whose body returns (carry, None)."""
  stack: fnn.Module

  def __call__(self, x):
    return self.stack(x, None)[0]


@needs_libtpu
def test_offload_moves_carries_to_host_and_shrinks_device_temp(stack_reports):
  full, offload = stack_reports['full'], stack_reports['offload']
  assert full.host == 0
  carries = DEPTH * (BATCH // 4) * HIDDEN * 4  # one f32 carry per layer
  assert offload.host >= carries
  assert offload.temp < full.temp


@needs_libtpu
def test_liftmods_full_compiles_to_linen_scan_of_remat(stack_reports):
  full, linen = stack_reports['full'], stack_reports['linen']
  for field in ('argument', 'output', 'host'):
    assert getattr(full, field) == getattr(linen, field), field
  # The two programs are scheduled slightly differently (measured: 32 KiB
  # of 161 MiB apart).
  assert full.temp == pytest.approx(linen.temp, rel=1e-3)


@needs_libtpu
def test_scaling_rows_compile_sharded_train_step():
  from benchmarks import scaling  # pylint: disable=g-import-not-at-top
  from examples.lm.model import Config  # pylint: disable=g-import-not-at-top
  # Wide enough that TPU tile padding of the small vectors is negligible.
  cfg = Config(vocab_size=1024, max_len=128, num_layers=2, num_heads=4,
               d_model=512, dropout_rate=0.0)
  row = scaling.compile_row('tiny', 'v5e:2x2', 'fsdp', 'liftmods', 'full', 2,
                            cfg=cfg)
  r = row.report
  assert r.fits and r.compile_s > 0
  # FSDP over 4 chips: every kernel / embedding is split 4 ways, so the
  # state per device is a quarter of it plus the replicated vectors.
  mesh = aot.topology_mesh('v5e:2x2', {'data': -1})
  n_params = scaling.n_params(cfg)
  total_state = 3 * 4 * n_params + 4  # params, mu, nu (f32) + step
  assert total_state / 4 < row.state_bytes < total_state / 4 + 3 * 4 * (
      4 * 10 * cfg.d_model * cfg.num_layers)
  # The compiler's argument bytes are those (state + this device's tokens)
  # up to the padding of small arrays to TPU tiles.
  tokens = (row.batch // mesh.size) * (cfg.max_len + 1) * 4
  assert row.state_bytes + tokens <= r.argument < 1.02 * (
      row.state_bytes + tokens)
  assert r.alias > 0  # the state is donated


@needs_libtpu
def test_scaling_bf16_row_keeps_f32_state_and_needs_less_temp():
  from benchmarks import scaling  # pylint: disable=g-import-not-at-top
  from examples.lm.model import Config  # pylint: disable=g-import-not-at-top
  cfg = Config(vocab_size=1024, max_len=256, num_layers=2, num_heads=4,
               d_model=512, dropout_rate=0.0)
  f32, bf16 = (scaling.compile_row('tiny', 'v5e:2x2', 'fsdp', 'liftmods',
                                   'full', 4, cfg=cfg, precision=p)
               for p in ('f32', 'bf16'))
  assert f32.report.fits and bf16.report.fits
  assert (f32.precision, bf16.precision) == ('f32', 'bf16')
  # Parameters and AdamW state stay float32: the same state and argument
  # bytes (state + tokens) in both programs.
  assert bf16.state_bytes == f32.state_bytes
  assert bf16.report.argument == f32.report.argument
  # The activations inside the blocks (attention scores, the MLP's hidden
  # units) are bfloat16: fewer temporary bytes for the same model.
  assert bf16.report.temp < 0.95 * f32.report.temp


_PIPELINE_ROWS = """
import jax, jax.numpy as jnp, liftmods as nn
from benchmarks import pipeline
x = jax.ShapeDtypeStruct((32, 256), jnp.float32)
for stages, pipe in ((1, None), (2, nn.Pipeline(stages=2, microbatches=4))):
  stack = nn.Stack(pipeline.Block, 4, policy='full', pipeline=pipe)(256)
  r = pipeline.tpu_report('row', stack, stages, x, 'v5e:2x2')
  print('ROW', r.fits, r.argument)
"""


@needs_libtpu
def test_pipelined_train_step_holds_a_stage_share_per_chip():
  # Its own process: benchmarks.pipeline defines absl flags that other
  # benchmark binaries imported here define too.
  out = subprocess.run([sys.executable, '-c', _PIPELINE_ROWS], cwd=ROOT,
                       capture_output=True, text=True, check=True).stdout
  rows = [line.split()[1:] for line in out.splitlines()
          if line.startswith('ROW')]
  (plain_fits, plain), (piped_fits, piped) = rows
  assert plain_fits == piped_fits == 'True'
  # Parameters and Adam state: the whole stack on every chip unpipelined,
  # one stage's layers (half) pipelined over two stages.
  state = 3 * 4 * 4 * (4 * 256 * 256 + 5 * 256)
  assert state <= int(plain) < 1.05 * state
  assert state / 2 <= int(piped) < 1.05 * state / 2
