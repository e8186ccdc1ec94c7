r"""Differential fuzzing soak: random programs of every family compared with
their references (``tests/differential/fuzz``; ``families.py`` lists them).

The ``linen`` family runs random Linen programs under flax.linen and
liftmods; the others draw random models *and* random configurations of a
feature past Linen (``nn.Stack``, pipelines, ``nn.shard_map``, meshes,
``init_sharded``, fused attention, lifted ``custom_vjp``/``jit``, the state
tools) and compare each with the reference it must equal.

Program ``i`` of a family is drawn from ``random.Random(seed + i)``. Each
family runs in a worker process of its own (with 8 simulated CPU devices
where it needs them), and each program has a time limit: a program that
runs past it is a hang, the worker is killed and a new one goes on with
the next seed. A failing program is shrunk (fewer layers, smaller meshes
and shapes: ``harness.shrink``) and printed with its seed and a
``--replay`` line that reruns the shrunk program.

  python -m benchmarks.fuzz --programs=1000                 # every family
  python -m benchmarks.fuzz --family=stack,pipeline --programs=200
  python -m benchmarks.fuzz --family=stack --replay=1,0,3 --show

Prints one block per failing program, running counts, then per family:
ok, both raised (an invalid configuration refused on both sides), hangs
and mismatches (with seeds), and the rate.
"""
import collections
import json
import os
import select
import subprocess
import sys
import time

from absl import app, flags

flags.DEFINE_list('family', ['all'], 'families to run (all: every one)')
flags.DEFINE_integer('programs', 100, 'programs per family')
flags.DEFINE_integer('seed', 0, 'seed of the first program')
flags.DEFINE_list('replay', [], 'run the one program these draws give '
                  '(as a failure report prints them)')
flags.DEFINE_bool('shrink', True, 'shrink failing programs')
flags.DEFINE_float('shrink_s', 300, 'seconds to spend shrinking a program')
flags.DEFINE_float('limit_s', 0, "a program's time limit (0: the family's)")
flags.DEFINE_integer('max_depth', 4, 'linen family: deepest module nesting')
flags.DEFINE_list('disable', [], 'linen family: generator features to turn '
                  'off')
flags.DEFINE_list('enable', [], 'linen family: generator features to turn on')
flags.DEFINE_bool('optimize', False, "linen family: compile with XLA's "
                  'optimizations (off by default: twice as fast)')
flags.DEFINE_bool('show', False, 'print every program and its verdict')
flags.DEFINE_integer('progress', 25, 'print running counts every N programs')
flags.DEFINE_bool('worker', False, 'internal: run one family in-process')
F = flags.FLAGS

_RESULT = '@@ '  # a worker's result lines start with this


# -- the worker: one family, in this process ----------------------------------


def _configure(family):
  from tests.differential.fuzz import linen_family  # pylint: disable=g-import-not-at-top
  linen_family.MAX_DEPTH = F.max_depth
  linen_family.FEATURES = {**{f: False for f in F.disable},
                           **{f: True for f in F.enable}}
  linen_family.OPTIMIZE = F.optimize
  if F.limit_s:
    family.limit_s = F.limit_s


def _emit(**fields):
  print(_RESULT + json.dumps(fields), flush=True)


def _work():
  from tests.differential.fuzz import families, harness  # pylint: disable=g-import-not-at-top
  family = families.get(F.family[0])
  _configure(family)
  if F.replay:
    start = time.perf_counter()
    program, draws, verdict, detail = harness.run_draws(
        family, [int(v) for v in F.replay])
    print(harness.report(family, F.seed, program, draws, verdict, detail))
    _emit(seed=F.seed, verdict=verdict, seconds=time.perf_counter() - start,
          detail=detail.splitlines()[0] if detail else '')
    return
  for seed in range(F.seed, F.seed + F.programs):
    start = time.perf_counter()
    program, draws, verdict, detail = harness.run_seed(family, seed)
    _emit(seed=seed, verdict=verdict, detail=detail.splitlines()[0]
          if detail else '', seconds=time.perf_counter() - start)
    if F.show or verdict in harness.FAILURES:
      print(harness.report(family, seed, program, draws, verdict, detail),
            flush=True)
    if verdict in harness.FAILURES and F.shrink:
      program, draws, detail, runs = harness.shrink(
          family, draws, verdict, budget_s=F.shrink_s,
          progress=lambda n: print(f'shrinking seed {seed}: {n} runs',
                                   flush=True))
      print(f'shrunk in {runs} runs:\n' +
            harness.report(family, seed, program, draws, verdict, detail),
            flush=True)
    if verdict == 'hang':
      os._exit(3)  # pylint: disable=protected-access  # a thread is stuck


# -- the parent: workers per family, with the time limit ------------------------


def _worker_env(devices):
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env['PYTHONPATH'] = os.pathsep.join(
      [root] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
  env.setdefault('JAX_PLATFORMS', 'cpu')
  if devices > 1:
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_force_host_'
                        f'platform_device_count={devices}')
  return env


def _argv(name, seed, programs):
  keep = ('max_depth', 'disable', 'enable', 'optimize', 'show', 'shrink',
          'shrink_s', 'limit_s', 'replay')
  args = [f'--{k}={",".join(map(str, v)) if isinstance(v, list) else v}'
          for k in keep for v in [F[k].value]]
  return [sys.executable, '-m', 'benchmarks.fuzz', '--worker',
          f'--family={name}', f'--seed={seed}', f'--programs={programs}',
          *args]


def _read_lines(proc, timeout):
  """Yields the worker's lines; ``None`` once ``timeout`` s pass silently."""
  buffer = b''
  fd = proc.stdout.fileno()
  while True:
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
      yield None
      return
    chunk = os.read(fd, 65536)
    if not chunk:
      if buffer:
        yield buffer.decode()
      return
    buffer += chunk
    *lines, buffer = buffer.split(b'\n')
    for line in lines:
      yield line.decode()


_VERDICTS = ('ok', 'both_raise', 'hang', 'mismatch')


class _Tally:
  """Counts, failures and time of one family."""

  def __init__(self, name):
    self.name, self.counts, self.raised = name, collections.Counter(), \
        collections.Counter()
    self.failures, self.seconds, self.done = [], 0.0, 0

  def add(self, result):
    self.done += 1
    self.counts[result['verdict']] += 1
    self.seconds += result.get('seconds', 0)
    if result['verdict'] == 'both_raise':
      self.raised[result.get('detail', '')] += 1
    if result['verdict'] in ('mismatch', 'hang'):
      self.failures.append((result['seed'], result['verdict'],
                            result.get('detail', '')))

  def summary(self):
    lines = [f'{self.name}: {self.done} programs, '
             f'{self.done / max(self.seconds, 1e-9):.2f}/s of checking']
    others = sorted(set(self.counts) - set(_VERDICTS))  # linen_fails
    for verdict in _VERDICTS + tuple(others):
      lines.append(f'  {verdict:<12}{self.counts[verdict]:>6}')
    for detail, n in sorted(self.raised.items(), key=lambda kv: -kv[1]):
      lines.append(f'    both raised {detail}: {n}')
    for seed, verdict, detail in self.failures:
      lines.append(f'    {verdict.upper()} seed {seed}: {detail}')
    return '\n'.join(lines)


def _run_family(name, devices, limit_s):
  tally = _Tally(name)
  seed, end = F.seed, F.seed + (1 if F.replay else F.programs)
  # The silence allowed covers one program, or one shrinking run of it.
  timeout = limit_s + 60
  while seed < end:
    proc = subprocess.Popen(_argv(name, seed, end - seed),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=_worker_env(devices))
    for line in _read_lines(proc, timeout):
      if line is None:  # silent too long: the program is a hang
        proc.kill()
        tally.add({'seed': seed, 'verdict': 'hang',
                   'detail': f'worker silent for {timeout:.0f}s'})
        print(f'--- {name} seed {seed}: hang (worker killed after '
              f'{timeout:.0f}s)', flush=True)
        seed += 1
        break
      if not line.startswith(_RESULT):
        print(line, flush=True)
        continue
      result = json.loads(line[len(_RESULT):])
      tally.add(result)
      seed = result['seed'] + 1
      if F.progress and tally.done % F.progress == 0:
        print(f'[{name} {tally.done}/{F.programs}] {dict(tally.counts)} '
              f'{tally.seconds:.0f}s', flush=True)
    proc.wait()
    if proc.returncode not in (0, 3, -9) and seed < end:
      print(f'worker for {name} exited with {proc.returncode}; '
            f'skipping seed {seed}', flush=True)
      tally.add({'seed': seed, 'verdict': 'mismatch',
                 'detail': f'worker died ({proc.returncode})'})
      seed += 1
  return tally


def main(argv):
  del argv
  if F.worker:
    _work()
    return
  from tests.differential.fuzz import families  # pylint: disable=g-import-not-at-top
  names = families.names() if F.family == ['all'] else F.family
  for name in names:
    families.devices(name)  # an unknown name fails here, naming the known
  tallies = []
  start = time.perf_counter()
  for name in names:
    limit = F.limit_s or families.limit_s(name)
    tallies.append(_run_family(name, families.devices(name), limit))
  seeds = ('a replay' if F.replay else
           f'seeds {F.seed}..{F.seed + F.programs - 1} per family')
  print(f'\n{sum(t.done for t in tallies)} programs in '
        f'{time.perf_counter() - start:.0f}s ({seeds})')
  for tally in tallies:
    print(tally.summary())


if __name__ == '__main__':
  app.run(main)
