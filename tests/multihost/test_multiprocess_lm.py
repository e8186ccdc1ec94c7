"""Several real JAX processes on this machine (gloo collectives over
localhost): sharded init, byte counts and serialization errors on arrays
spread over processes, and the LM demo trained on 2 processes x 4 devices,
checkpointed, and resumed on 1 x 8 and 4 x 2."""
import json
import os
import random
import re
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.lm.model import TransformerLM
from examples.lm.train import init_state, make_optimizer
import liftmods as nn
from liftmods.testing import multiprocess
from tests.multihost.sharded_init_program import TINY
from examples.lm.train import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
FLAGS = ['--seq_len=32', '--layers=2', '--heads=2', '--d_model=32',
         '--steps=8', '--batch_size=8', '--learning_rate=1e-2',
         '--warmup_steps=4', '--eval_every=4', '--eval_batches=2',
         '--checkpoint_every=4', '--max_bytes=100000', '--sample_length=0',
         '--no_progress', '--save_params', '--devices=8']


def lm(workdir, processes: int, *extra):
  """Runs the demo on ``processes`` local processes; process 0's output."""
  argv = [sys.executable, '-m', 'examples.lm', *FLAGS,
          f'--workdir={workdir}', *extra]
  if processes == 1:
    env = dict(ENV, JAX_PLATFORMS='cpu')
    env.pop('XLA_FLAGS', None)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [multiprocess.Run(0, 0, proc.stdout, proc.stderr)]
  return multiprocess.launch(argv, processes, 8 // processes, cwd=ROOT,
                             env=ENV, timeout=300)


def outcome(workdir):
  workdir = pathlib.Path(workdir)
  history = json.loads((workdir / 'summary.json').read_text())['history']
  return history, dict(np.load(workdir / 'params.npz'))


@pytest.mark.integration
def test_sharded_init_on_two_processes_equals_one_process(tmp_path):
  multiprocess.launch(
      [sys.executable, '-m', 'tests.multihost.sharded_init_program',
       str(tmp_path)], 2, 4, cwd=ROOT, env=ENV, timeout=120)
  report = json.loads((tmp_path / 'out.json').read_text())
  got = dict(np.load(tmp_path / 'out.npz'))
  cfg = TrainConfig(model=TINY)
  want, _ = init_state(TransformerLM(TINY), make_optimizer(cfg), 0)
  flat = jax.tree_util.tree_flatten_with_path(want['params'])[0]
  assert sorted(got) == sorted(jax.tree_util.keystr(k) for k, _ in flat)
  # Another program (8 shards over two processes against whole arrays in
  # one): the same random bits, the initializers' float32 arithmetic to a
  # few ulps, which other compiled code may round otherwise on another CPU.
  for k, v in flat:
    np.testing.assert_allclose(got[jax.tree_util.keystr(k)], v, rtol=1e-6,
                               atol=1e-7)
  assert report['process_count'] == 2
  assert report['total_bytes'] == sum(v.nbytes for _, v in flat)
  # the same per-device figure as the one-process 8-device run prints
  assert report['device_bytes'] == 73_216 < report['total_bytes']
  assert not all(report['fully_addressable'])
  msg = report['to_bytes_error']
  assert msg is not None and 'sharded across 2 processes' in msg
  assert msg.startswith('blocks/') or msg.startswith('embed')
  assert 'orbax.checkpoint' in msg and 'process_allgather' in msg
  # The state tools move the global arrays without a fetch.
  assert report['state_same_leaves'] and report['state_merge_paths']
  want_blocks = nn.state.select(want['params'], 'blocks')
  assert report['state_mask_true'] == len(nn.state.paths(want_blocks))
  assert report['state_kernels'] == len(nn.state.paths(nn.state.select(
      want['params'], nn.state.PathRegex('.*kernel'))))
  # tabulate under the two-process mesh: the one-process rows, and the
  # per-device bytes of the sharded parameters.
  table = TransformerLM(TINY).tabulate(
      jax.random.key(0), jnp.zeros((2, TINY.max_len), jnp.int32),
      console_kwargs={'width': 200})
  n_params = sum(v.size for _, v in flat)
  total = (f'Total Parameters: {n_params:,} ({report["total_bytes"] / 1e3:.1f}'
           f' KB, {report["device_bytes"] / 1e3:.1f} KB per device)')
  assert total in report['tabulate'], report['tabulate'][-400:]
  for line in table.splitlines()[3:-4]:
    first = line.split('│')[1:3]  # path and module columns of each row
    assert not first or any(
        [c.strip() for c in other.split('│')[1:3]] == [c.strip() for c in first]
        for other in report['tabulate'].splitlines()), line


@pytest.fixture(scope='module')
def one_by_eight(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('one_by_eight')
  lm(workdir, 1)
  return outcome(workdir)


def assert_same_run(got, want, upto=None):
  (history, params), (want_history, want_params) = got, want
  # held-out losses at every eval step; the first step's training loss (the
  # later training points average windows that a stop shortens)
  steps, losses = zip(*history['eval'])
  want_steps, want_losses = zip(*[p for p in want_history['eval']
                                  if upto is None or p[0] <= upto])
  assert steps == want_steps
  np.testing.assert_allclose(losses, want_losses, rtol=2e-4)
  assert history['train'][0][0] == want_history['train'][0][0] == 1
  np.testing.assert_allclose(history['train'][0][1],
                             want_history['train'][0][1], rtol=2e-4)
  if params is not None:
    assert sorted(params) == sorted(want_params)
    # gloo sums in another order than the in-process all-reduce: measured
    # 1.2e-7 at most (a unit in the last place of values near 1) after the 8
    # steps, the attention's key bias (never trained) equal
    for k, v in params.items():
      np.testing.assert_allclose(v, want_params[k], rtol=0, atol=1e-6,
                                 err_msg=k)


def _gloo_fragment(line):
  """A line of gloo's connection report, or a piece of one."""
  return ('Gloo' in line or 'peer ranks' in line
          or re.fullmatch(r'[\d\s:.]*', line) is not None)


@pytest.fixture(scope='module')
def two_by_four(tmp_path_factory):
  """An uninterrupted 2 x 4 run, checkpointed at steps 4 and 8: its
  ``(workdir, runs)``."""
  workdir = tmp_path_factory.mktemp('two_by_four')
  return workdir, lm(workdir, 2)


@pytest.mark.integration
def test_two_by_four_trains_like_one_by_eight_and_restores_elsewhere(
    one_by_eight, two_by_four, tmp_path):
  first, runs = two_by_four
  assert "over 8 cpu devices in 2 process(es)" in runs[0].stdout
  # only process 0 reports; gloo prints its connections from several threads,
  # so its lines can arrive cut and interleaved (a run left a lone '1', the
  # tail of "peer ranks is : 1")
  assert [l for l in runs[1].stdout.splitlines()
          if not _gloo_fragment(l)] == []
  assert_same_run(outcome(first), one_by_eight)
  for processes in (1, 4):  # the 2 x 4 step-4 checkpoint on 1 x 8, then 4 x 2
    workdir = tmp_path / f'resumed_{processes}'
    shutil.copytree(first, workdir)
    shutil.rmtree(workdir / 'checkpoints' / '8')
    out = lm(workdir, processes, '--resume')
    assert 'resumed from step 4' in out[0].stdout
    assert_same_run(outcome(workdir), one_by_eight)


def kill_when(ready, victim: int):
  """An ``on_start`` hook: SIGKILLs process ``victim`` as soon as
  ``ready()`` holds (polled every 5 ms)."""
  def hook(procs):
    def watch():
      while procs[victim].poll() is None:
        if ready():
          procs[victim].send_signal(signal.SIGKILL)
          return
        time.sleep(0.005)
    threading.Thread(target=watch, daemon=True).start()
  return hook


def writing_checkpoint(workdir: pathlib.Path):
  """True while orbax writes a step (its temporary directory exists)."""
  directory = workdir / 'checkpoints'
  return directory.exists() and any('tmp' in p.name
                                    for p in directory.iterdir())


def finished_step(step_file: pathlib.Path) -> int:
  """The last step the demo reported through ``--step_file`` (0 before)."""
  try:
    return int(step_file.read_text() or 0)
  except FileNotFoundError:
    return 0


@pytest.mark.integration
def test_killed_processes_resume_to_the_same_parameters(two_by_four,
                                                        tmp_path):
  """SIGKILL process 1 while its first checkpoint is being written (orbax
  saves at step 1 when there is none yet, then every 4 steps); restart both with --resume and SIGKILL process 0 at a random training
  step between the checkpoints (5, 6 or 7, read from --step_file); restart
  both again. The final parameters equal the uninterrupted 2 x 4 run's bit
  for bit, and the last restart resumed from the step-4 checkpoint."""
  workdir = tmp_path / 'faulty'
  step_file = workdir / 'step'
  argv = [sys.executable, '-m', 'examples.lm', *FLAGS,
          f'--workdir={workdir}', f'--step_file={step_file}']
  seed = random.randrange(2**32)
  step = random.Random(seed).choice([5, 6, 7])
  why = f'kill at step {step} (seed {seed})'
  kills = [  # (who, when, extra flags)
      (1, lambda: writing_checkpoint(workdir), []),
      (0, lambda: finished_step(step_file) >= step, ['--resume']),
  ]
  for victim, ready, extra in kills:
    step_file.unlink(missing_ok=True)  # no stale step from the run before
    runs = multiprocess.launch(argv + extra, 2, 4, cwd=ROOT, env=ENV,
                               timeout=300, check=False,
                               on_start=kill_when(ready, victim))
    assert runs[victim].returncode == -signal.SIGKILL, (why, runs[victim])
    assert not (workdir / 'params.npz').exists(), why  # it did not finish
  # the second run wrote step 4 and was killed before step 8
  steps = [p.name for p in (workdir / 'checkpoints').iterdir()]
  assert '4' in steps and '8' not in steps, (why, steps)
  runs = multiprocess.launch(argv + ['--resume'], 2, 4, cwd=ROOT, env=ENV,
                             timeout=300)
  assert 'resumed from step 4' in runs[0].stdout, why
  got, want = outcome(workdir)[1], outcome(two_by_four[0])[1]
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=f'{k}: {why}')
