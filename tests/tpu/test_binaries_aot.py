"""``--topology`` in benchmarks.spmd and benchmarks.models.

Each check runs the binary's module in a process of its own: the benchmark
binaries define absl flags with the same names (``batch``, ``layers``,
``repeats``, ...), so two of them cannot be imported into one process.
"""
import json
import subprocess
import sys

import pytest

from benchmarks import aot

from tests.tpu.marks import ROOT, needs_libtpu


def run_python(script, *args):
  result = subprocess.run([sys.executable, '-c', script, *args], cwd=ROOT,
                          capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-4000:]
  return result.stdout


_WITHOUT_LIBTPU = """
import sys
from absl import flags
from benchmarks import aot
aot.libtpu_available = lambda: False  # as on a machine without libtpu
binary = __import__('benchmarks.' + sys.argv[1], fromlist=['main'])
flags.FLAGS(['binary', '--topology=v5e:2x2'] + sys.argv[2:])
try:
  binary.main([])
except aot.LibtpuMissingError as e:
  print('LibtpuMissingError:', e)
else:
  print('no error')
"""


@pytest.mark.parametrize('binary,args', [
    ('spmd', ['--mesh=data:-1,fsdp:2,tensor:2']),
    ('models', ['--model=seq2seq']),
])
def test_topology_without_libtpu_says_what_to_install(binary, args):
  out = run_python(_WITHOUT_LIBTPU, binary, *args)
  assert out.startswith('LibtpuMissingError: --topology=v5e:2x2 compiles'), out
  assert 'pip install -e ".[tpu]"' in out


_SPMD = """
import json
from absl import flags
from benchmarks import spmd
flags.FLAGS(['spmd', '--topology=v5e:2x2', '--mesh=data:-1,fsdp:2,tensor:2',
             '--layers=2', '--hidden=512', '--heads=4', '--vocab=1024',
             '--batch=8', '--seq=128'])
results = spmd.aot_main()
print('JSON', json.dumps({name: dict(
    init_fits=r['init'].fits, step_fits=r['step'].fits,
    init_output=r['init'].output, step_argument=r['step'].argument,
    params=spmd.shard_bytes(r['params']),
    opt_state=spmd.shard_bytes(r['opt_state']),
    total=sum(x.size * x.dtype.itemsize
              for x in spmd.jax.tree.leaves(r['params'])),
    program=r['program']) for name, r in results.items()}))
"""


def last_json(out):
  return json.loads(next(line for line in reversed(out.splitlines())
                         if line.startswith('JSON '))[5:])


@needs_libtpu
def test_spmd_compiles_both_libraries_sharded_for_a_slice():
  r = last_json(run_python(_SPMD))
  ours, theirs = r['liftmods'], r['flax.linen']
  assert ours['init_fits'] and ours['step_fits']
  assert theirs['init_fits'] and theirs['step_fits']
  # The same shardings: the same bytes per device, and one program.
  for key in ('params', 'opt_state', 'step_argument', 'init_output'):
    assert ours[key] == theirs[key], key
  assert ours['program'] == theirs['program']
  # Every kernel and embedding is split over fsdp x tensor or one of them:
  # a device holds between a quarter and a half of the parameters.
  assert ours['total'] / 4 <= ours['params'] < ours['total'] / 2
  # The sharded init outputs exactly this device's share (up to the
  # padding of small arrays to TPU tiles).
  assert ours['params'] <= ours['init_output'] < 1.05 * ours['params']
  # The step's arguments: parameters, AdamW state, this device's tokens.
  tokens = 8 // 2 * 129 * 4
  state = ours['params'] + ours['opt_state']
  assert state + tokens <= ours['step_argument'] < 1.05 * (state + tokens)


_MODELS = """
import json
from absl import flags
from benchmarks import models
flags.FLAGS(['models', '--topology=v5e:2x2', '--model=seq2seq'])
reports = models.aot_main()
print('JSON', json.dumps({f'{m} {n}': dict(
    fits=r.fits, argument=r.argument, output=r.output, alias=r.alias,
    flops=r.flops) for (m, n), r in reports.items()}))
"""


@needs_libtpu
def test_models_compile_each_train_step_for_a_slice():
  r = last_json(run_python(_MODELS))
  assert all(row['fits'] for row in r.values()), r
  ours, theirs = r['seq2seq liftmods'], r['seq2seq flax.linen']
  # The same state and batch shard: the same argument bytes.
  assert ours['argument'] == theirs['argument']
  assert ours['flops'] == pytest.approx(theirs['flops'], rel=0.01)
  # The state is donated: the new state reuses its buffers.
  assert ours['alias'] > 0
  # seq2seq's replicated state: embedding 32x128, two LSTM cells of four
  # 128x128 input and four 128x128 hidden kernels and four biases, output
  # dense 128x32 + 32, f32, times three (parameters and Adam's mu and nu),
  # next to this chip's quarter of the (32, 24) int32 batch arrays.
  n = 32 * 128 + 2 * (8 * 128 * 128 + 4 * 128) + 128 * 32 + 32
  state = 3 * 4 * n
  batch = 3 * (32 // 4) * 24 * 4
  seq2seq = r['seq2seq liftmods']['argument']
  assert state + batch <= seq2seq < 1.05 * (state + batch)
