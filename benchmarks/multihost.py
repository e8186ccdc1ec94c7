r"""The LM demo on several local processes vs one: step time, checkpoint
bytes per process and the cost of a restart.

Runs ``python -m examples.lm`` (a small model) as 1 process x 8 CPU devices
and as 2 processes x 4 devices joined by gloo over localhost, each for
``--steps`` steps with a checkpoint every ``--checkpoint_every``:

- step ms: from the demo's own tokens/s (compile and checkpoints excluded);
  the 2 x 4 / 1 x 8 ratio is mostly gloo's all-reduce over localhost
  sockets, far slower than the in-process all-reduce, so it says nothing
  about a TPU interconnect;
- checkpoint bytes: the final step's directory, divided by the processes
  that wrote it;
- restart s: wall time of ``--resume`` with no steps left: starting the
  processes, the distributed runtime, init, compiling and restoring.

  python -m benchmarks.multihost --steps=20
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from liftmods.testing import multiprocess

STEPS = flags.DEFINE_integer('steps', 20, 'training steps per run')
EVERY = flags.DEFINE_integer('checkpoint_every', 10, 'checkpoint interval')
ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(workdir, processes: int, *extra) -> float:
  """Wall seconds of one demo run on ``processes`` local processes."""
  argv = [sys.executable, '-m', 'examples.lm', '--devices=8',
          '--seq_len=64', '--layers=2', '--heads=2', '--d_model=64',
          '--batch_size=16', f'--steps={STEPS.value}', '--eval_every=1000',
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


def main(_):
  rows = {}
  with tempfile.TemporaryDirectory() as tmp:
    for processes in (1, 2):
      workdir = pathlib.Path(tmp) / str(processes)
      run(workdir, processes)
      summary = json.loads((workdir / 'summary.json').read_text())
      step_ms = 16 * 64 / summary['tokens_per_s'] * 1e3
      last = workdir / 'checkpoints' / str(STEPS.value)
      restart = run(workdir, processes, '--resume')
      rows[processes] = (step_ms, dir_bytes(last) / processes, restart)
      print(f'{processes} x {8 // processes}: step {step_ms:.1f} ms, '
            f'checkpoint {dir_bytes(last):,} bytes '
            f'({rows[processes][1]:,.0f} per process), restart {restart:.1f}s')
  print(f'step time 2 x 4 / 1 x 8: {rows[2][0] / rows[1][0]:.2f} '
        '(gloo over localhost)')


if __name__ == '__main__':
  app.run(main)
