r"""Differential fuzzing soak: random Linen programs run under flax.linen and
liftmods, compared stage by stage (see ``tests/differential/fuzz/compare.py``).

Program ``i`` is drawn from ``random.Random(seed + i)``, so any reported
program is reproduced with ``--seed=<its seed> --programs=1``.

  python -m benchmarks.fuzz --programs=1000
  python -m benchmarks.fuzz --programs=1 --seed=1234 --show

Prints one line per program that is not 'ok', then the counts: ok, both
raised (by stage and Linen's error class) and mismatches (with seeds).
"""
import collections
import time

from absl import app, flags
import flax.linen as fnn

import liftmods as lnn
from tests.differential.fuzz import compare, programs

flags.DEFINE_integer('programs', 100, 'how many programs to run')
flags.DEFINE_integer('seed', 0, 'seed of the first program')
flags.DEFINE_integer('max_depth', 4, 'deepest module nesting')
flags.DEFINE_list('disable', [], 'generator features to turn off '
                  f'(of {sorted(programs.FEATURES)})')
flags.DEFINE_list('enable', [], 'generator features to turn on')
flags.DEFINE_bool('optimize', False, "compile with XLA's optimizations "
                  '(off by default: twice as fast, same comparison)')
flags.DEFINE_bool('show', False, 'print every program and its verdict')
flags.DEFINE_integer('progress', 25, 'print running counts every N programs')
F = flags.FLAGS


def main(argv):
  del argv
  features = {f: False for f in F.disable}
  features.update({f: True for f in F.enable})
  counts, raised, mismatches = collections.Counter(), collections.Counter(), []
  start = time.perf_counter()
  for seed in range(F.seed, F.seed + F.programs):
    case = compare.draw_case(programs.RandomChooser(seed), features,
                             F.max_depth)
    verdict, detail = compare.compare(case, fnn, lnn, optimize=F.optimize)
    counts[verdict] += 1
    if verdict == 'both_raise':
      raised[detail] += 1
    if verdict == 'mismatch':
      mismatches.append((seed, detail.splitlines()[0]))
    done = seed - F.seed + 1
    if F.progress and done % F.progress == 0:
      print(f'[{done}/{F.programs}] {dict(counts)} '
            f'{time.perf_counter() - start:.0f}s', flush=True)
    if F.show or verdict == 'mismatch':
      print(f'--- seed {seed}: {verdict} {detail}\n{case}\n{case.src}',
            flush=True)
  elapsed = time.perf_counter() - start
  print(f'\n{F.programs} programs in {elapsed:.0f}s '
        f'(seeds {F.seed}..{F.seed + F.programs - 1}, max_depth '
        f'{F.max_depth}, disabled {sorted(F.disable) or "none"})')
  for verdict in ('ok', 'both_raise', 'mismatch'):
    print(f'  {verdict:<12}{counts[verdict]:>6}')
  for detail, n in sorted(raised.items(), key=lambda kv: -kv[1]):
    print(f'    both raised {detail}: {n}')
  for seed, line in mismatches:
    print(f'    MISMATCH seed {seed}: {line}')


if __name__ == '__main__':
  app.run(main)
