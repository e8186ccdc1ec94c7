r"""The LM demo on several local processes vs one: step time, checkpoint
save and restore times, bytes per process and the cost of a restart.

Runs ``python -m examples.lm`` (a small model) as 1 process x 8 CPU devices
and as 2 processes x 4 devices joined by gloo over localhost, each for
``--steps`` steps with a checkpoint every ``--checkpoint_every``:

- step ms: from the demo's own tokens/s (compile and checkpoints excluded);
  the 2 x 4 / 1 x 8 ratio is mostly gloo's all-reduce over localhost
  sockets, far slower than the in-process all-reduce, so it says nothing
  about a TPU interconnect;
- checkpoint save / restore ms: the median of ``--repeats`` saves and
  restores of the trained state (parameters and AdamW moments) through the
  demo's own ``train.save`` / ``train.restore``, each timed from a barrier
  until every process is done (a program of its own, the ``--child`` mode
  of this module, started as 1 x 8 and as 2 x 4); a save includes orbax
  deleting the step that ``max_to_keep=2`` drops;
- checkpoint bytes: a step's directory, divided by the processes that
  wrote it;
- restart s: wall time of ``--resume`` with no steps left: starting the
  processes, the distributed runtime, init, compiling and restoring.

  python -m benchmarks.multihost --steps=20 --repeats=5
"""
import json
import os
import statistics
import pathlib
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from liftmods.testing import multiprocess

STEPS = flags.DEFINE_integer('steps', 20, 'training steps per run')
EVERY = flags.DEFINE_integer('checkpoint_every', 10, 'checkpoint interval')
REPEATS = flags.DEFINE_integer('repeats', 5, 'checkpoint saves and restores '
                               'timed (the median is reported)')
CHILD = flags.DEFINE_string('child', None, 'internal: time checkpoints of the '
                            'run in this directory (one process of the job)')
MODEL = ['--seq_len=64', '--layers=2', '--heads=2', '--d_model=64',
         '--batch_size=16']
ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(workdir, processes: int, *extra) -> float:
  """Wall seconds of one demo run on ``processes`` local processes."""
  argv = [sys.executable, '-m', 'examples.lm', '--devices=8', *MODEL,
          f'--steps={STEPS.value}', '--eval_every=1000',
          f'--checkpoint_every={EVERY.value}', '--max_bytes=200000',
          '--sample_length=0', '--no_progress', f'--workdir={workdir}',
          *extra]
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  began = time.perf_counter()
  if processes == 1:
    subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
  else:
    multiprocess.launch(argv, processes, 8 // processes, cwd=ROOT, env=env,
                        timeout=1200)
  return time.perf_counter() - began


def dir_bytes(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob('*') if f.is_file())


def time_checkpoints(workdir: str) -> None:
  """One process of the checkpoint timing job: restores the trained state
  of the demo run in ``workdir``, then saves and restores it ``--repeats``
  times in ``workdir/timing``; process 0 writes the seconds and the bytes
  of one step to ``workdir/timing/times.json``."""
  multiprocess.initialize_from_env()  # before any other JAX call
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from examples.lm import __main__ as cli, train  # pylint: disable=import-outside-toplevel
  from examples.lm.model import TransformerLM  # pylint: disable=import-outside-toplevel
  cfg = cli.parse(['--devices=8', *MODEL, f'--workdir={workdir}', '--resume',
                   '--checkpoint_every=1'])
  optimizer = train.make_optimizer(cfg)
  fresh, _ = train.init_state(TransformerLM(cfg.model), optimizer, cfg.seed,
                              train.make_mesh(cfg))
  history = {'train': [], 'eval': []}
  state, history = train.restore(train.checkpoint_manager(cfg), fresh,
                                 history)
  assert int(state['step']) == STEPS.value, int(state['step'])
  timing = pathlib.Path(workdir) / 'timing'
  manager = train.checkpoint_manager(dataclasses.replace(
      cfg, workdir=str(timing), resume=False))
  saves, restores = [], []

  def timed(fn):
    multihost_utils.sync_global_devices('start')
    began = time.perf_counter()
    out = fn()
    multihost_utils.sync_global_devices('end')  # the slowest process counts
    return time.perf_counter() - began, out

  def save(step):
    train.save(manager, step, state, history, force=True)
    manager.wait_until_finished()

  for step in range(1, REPEATS.value + 1):
    seconds, _ = timed(lambda s=step: save(s))
    saves.append(seconds)
    seconds, (restored, _) = timed(lambda: jax.block_until_ready(
        train.restore(manager, fresh, history)))
    restores.append(seconds)
    assert int(restored['step']) == STEPS.value
  if jax.process_index() == 0:
    last = timing / 'checkpoints' / str(REPEATS.value)
    (timing / 'times.json').write_text(json.dumps(
        {'save': saves, 'restore': restores, 'bytes': dir_bytes(last)}))


def checkpoint_times(workdir: pathlib.Path, processes: int) -> dict:
  """Save and restore seconds and one step's bytes on ``processes``, for
  the trained state in ``workdir``."""
  argv = [sys.executable, '-m', 'benchmarks.multihost', f'--child={workdir}',
          f'--repeats={REPEATS.value}', f'--steps={STEPS.value}']
  multiprocess.launch(argv, processes, 8 // processes, cwd=ROOT, timeout=1200,
                      env=dict(os.environ, PYTHONPATH=str(ROOT)))
  return json.loads((workdir / 'timing' / 'times.json').read_text())


def main(_):
  if CHILD.value:
    time_checkpoints(CHILD.value)
    return
  rows = {}
  with tempfile.TemporaryDirectory() as tmp:
    for processes in (1, 2):
      workdir = pathlib.Path(tmp) / str(processes)
      run(workdir, processes)
      summary = json.loads((workdir / 'summary.json').read_text())
      step_ms = 16 * 64 / summary['tokens_per_s'] * 1e3
      restart = run(workdir, processes, '--resume')
      times = checkpoint_times(workdir, processes)
      save, restore = (statistics.median(times[k]) * 1e3
                       for k in ('save', 'restore'))
      rows[processes] = (step_ms, save, restore, restart)
      print(f'{processes} x {8 // processes}: step {step_ms:.1f} ms, '
            f'checkpoint save {save:.0f} ms, restore {restore:.0f} ms '
            f'(medians of {REPEATS.value}), {times["bytes"]:,} bytes '
            f'({times["bytes"] / processes:,.0f} per process), '
            f'restart {restart:.1f}s', flush=True)
  print('2 x 4 / 1 x 8 (gloo over localhost): ' + ', '.join(
      f'{name} {rows[2][i] / rows[1][i]:.2f}' for i, name in enumerate(
          ('step', 'save', 'restore', 'restart'))))


if __name__ == '__main__':
  app.run(main)
