"""Train a byte-level Transformer LM on the Python standard library's source.

  python -m examples.lm            # default run: 600 steps, about 8 CPU-minutes
  python -m examples.lm --resume   # continue from the latest checkpoint
  python -m examples.lm --steps=2000 --layers=6 --d_model=256
  python -m examples.lm --devices=8   # sharded over 8 simulated CPU devices
  python -m examples.lm --devices=8 --processes=2   # 2 local processes x 4
  python -m examples.lm --distributed  # one process per host (TPU VM, SLURM)
"""
import argparse
import dataclasses
import os
import sys
import time


def runtime_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  add = p.add_argument
  add('--devices', type=int, default=1,
      help="train on a ('data', 'model') mesh of this many devices, with "
      'sharded init and a sharded step (on CPU, simulated devices)')
  add('--mesh_axes', choices=('explicit', 'auto'), default='explicit',
      help="the mesh's axis types: 'explicit' (jax.make_mesh's default) or "
      "'auto' (XLA propagates shardings)")
  add('--processes', type=int, default=1,
      help='launch this many local processes, --devices split among them')
  add('--distributed', action='store_true',
      help='join a multi-process job: jax.distributed.initialize with the '
      'flags below, or detected from the cluster (Cloud TPU, SLURM)')
  add('--coordinator_address', default=None, help='host:port of process 0')
  add('--num_processes', type=int, default=None)
  add('--process_id', type=int, default=None)
  return p


def start_runtime(argv) -> None:
  """Everything that must happen before JAX is used: launching local
  processes (``--processes``), joining the distributed runtime, or asking
  XLA for ``--devices`` simulated CPU devices in one process."""
  from liftmods.testing import multiprocess  # standard library only
  a = runtime_flags(argparse.ArgumentParser(add_help=False)).parse_known_args(
      argv)[0]
  if multiprocess.initialize_from_env():
    return  # a child of --processes
  if a.processes > 1:
    if a.devices % a.processes:
      sys.exit(f'--devices={a.devices} does not split over '
               f'--processes={a.processes}')
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    try:
      runs = multiprocess.launch(
          [sys.executable, '-m', 'examples.lm', *argv], a.processes,
          a.devices // a.processes, cwd=root, env=env, timeout=24 * 3600)
    except multiprocess.ProcessFailed as e:
      sys.exit(str(e))
    sys.stderr.write(runs[0].stderr)
    sys.stdout.write(runs[0].stdout)  # the others print nothing
    sys.exit(0)
  if a.distributed or a.coordinator_address:
    import jax  # pylint: disable=import-outside-toplevel
    jax.distributed.initialize(a.coordinator_address, a.num_processes,
                               a.process_id)
  elif a.devices > 1:  # read when the backend starts, not at import
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_'
                               f'force_host_platform_device_count='
                               f'{a.devices}').strip()


if __name__ == '__main__':
  start_runtime(sys.argv[1:])

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp

from examples.lm.model import Config, TransformerLM
from examples.lm.train import TrainConfig, train


def parse(argv=None) -> TrainConfig:
  defaults, model = TrainConfig(), Config()
  p = runtime_flags(argparse.ArgumentParser(
      description=__doc__.splitlines()[0]))
  add = p.add_argument
  add('--steps', type=int, default=defaults.steps)
  add('--batch_size', type=int, default=defaults.batch_size)
  add('--seq_len', type=int, default=model.max_len)
  add('--layers', type=int, default=model.num_layers)
  add('--heads', type=int, default=model.num_heads)
  add('--d_model', type=int, default=model.d_model)
  add('--dropout', type=float, default=model.dropout_rate)
  add('--learning_rate', type=float, default=defaults.learning_rate)
  add('--warmup_steps', type=int, default=defaults.warmup_steps)
  add('--weight_decay', type=float, default=defaults.weight_decay)
  add('--clip_norm', type=float, default=defaults.clip_norm)
  add('--seed', type=int, default=defaults.seed)
  add('--eval_every', type=int, default=defaults.eval_every)
  add('--eval_batches', type=int, default=defaults.eval_batches)
  add('--max_bytes', type=int, default=defaults.max_bytes,
      help='use only this many bytes of text (for a quick run)')
  add('--checkpoint_every', type=int, default=defaults.checkpoint_every)
  add('--workdir', default=defaults.workdir,
      help='checkpoints, loss plot and summary go here')
  add('--resume', action='store_true',
      help='continue from the latest checkpoint in --workdir')
  add('--stop_at', type=int, default=None,
      help='stop (and checkpoint) at this step; --resume continues')
  add('--prompt', default=defaults.prompt)
  add('--sample_length', type=int, default=defaults.sample_length)
  add('--temperature', type=float, default=defaults.temperature)
  add('--no_progress', action='store_true', help='no progress bar')
  add('--save_params', action='store_true',
      help='write the final parameters to params.npz in --workdir')
  add('--step_file', default=None,
      help='process 0 writes the number of each finished step to this file '
      '(waiting for the step: slower), for a program that watches progress')
  a = p.parse_args(argv)
  model = Config(max_len=a.seq_len, num_layers=a.layers, num_heads=a.heads,
                 d_model=a.d_model, dropout_rate=a.dropout)
  return dataclasses.replace(
      defaults, model=model, steps=a.steps, batch_size=a.batch_size,
      learning_rate=a.learning_rate, warmup_steps=a.warmup_steps,
      weight_decay=a.weight_decay, clip_norm=a.clip_norm, seed=a.seed,
      eval_every=a.eval_every, eval_batches=a.eval_batches,
      max_bytes=a.max_bytes, checkpoint_every=a.checkpoint_every,
      workdir=a.workdir, resume=a.resume, stop_at=a.stop_at,
      prompt=a.prompt, sample_length=a.sample_length, temperature=a.temperature,
      progress=not a.no_progress, devices=a.devices, mesh_axes=a.mesh_axes,
      save_params=a.save_params, step_file=a.step_file)


def main(argv=None):
  began = time.perf_counter()
  cfg = parse(argv)
  model = TransformerLM(cfg.model)
  tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
  if jax.process_index() == 0:
    print(model.tabulate(jax.random.key(0), tokens, depth=1,
                         console_kwargs={'width': 110}))
  result = train(cfg)
  if jax.process_index():
    return  # process 0 reports
  history = result['history']
  step = int(result['state']['step'])
  print(f"\nstep {step}: {result['train_time_s']:.1f}s in the training loop, "
        f"{result['tokens_per_s']:,.0f} tokens/s")
  if history['train'] and history['eval']:
    print(f"final train loss {history['train'][-1][1]:.4f}, held-out loss "
          f"{history['eval'][-1][1]:.4f} (nats/byte)")
  if 'plot' in result:
    print(f"loss curve: {result['plot']}")
  print(f'\nsample (prompt {cfg.prompt!r}, temperature {cfg.temperature}):\n')
  print(result['sample'])
  print(f'\ntotal wall time {time.perf_counter() - began:.0f}s')


if __name__ == '__main__':
  main()
