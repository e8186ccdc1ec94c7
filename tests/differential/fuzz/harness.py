"""What every fuzz family shares: replayable choices, a time limit, shrinking.

A program of any family is fully determined by the integers its generator
drew. ``RecordingChooser`` draws them from ``random.Random(seed)`` and keeps
them; ``ReplayChooser`` feeds a (possibly edited) list back, clamping each
value into the range asked for and answering ``lo`` once the list runs out.
Generators list their options simplest first, so lowering a recorded value
makes the program simpler, and ``shrink`` does only that: it lowers one
draw at a time and keeps the change while the program still fails the same
way. The result is printed with the seed and the draws, and
``python -m benchmarks.fuzz --family=F --replay=1,0,3`` runs it again.

``limited`` runs one check under a wall-clock limit in a daemon thread: a
program that takes longer is a ``'hang'`` (the thread is abandoned; the
soak then restarts its worker process, see ``benchmarks/fuzz.py``).
"""
import dataclasses
import random
import threading
import time
import traceback
from typing import Any, Callable

from . import programs

FAILURES = ('mismatch', 'hang')


class RecordingChooser(programs.Chooser):
  """Draws from ``random.Random(seed)`` and records every value."""

  def __init__(self, seed: int):
    self._rng = random.Random(seed)
    self.draws = []

  def integer(self, lo, hi):
    value = self._rng.randint(lo, hi)
    self.draws.append(value)
    return value


class ReplayChooser(programs.Chooser):
  """Answers with ``draws`` in order (clamped to each range), then ``lo``."""

  def __init__(self, draws):
    self._draws = list(draws)
    self._at = 0
    self.draws = []

  def integer(self, lo, hi):
    value = self._draws[self._at] if self._at < len(self._draws) else lo
    self._at += 1
    value = min(max(value, lo), hi)
    self.draws.append(value)
    return value


@dataclasses.dataclass
class Family:
  """One kind of program and the reference it is compared with.

  Attributes:
    name: what ``--family=`` selects.
    draw: ``draw(chooser) -> program`` (any value with a readable repr).
    check: ``check(program) -> (verdict, detail)``; verdict ``'ok'``,
      ``'both_raise'`` (an invalid configuration refused with the
      documented error), or ``'mismatch'``.
    devices: the simulated CPU devices the family needs.
    limit_s: the time one program may take before it counts as a hang.
  """
  name: str
  draw: Callable[[programs.Chooser], Any]
  check: Callable[[Any], tuple]
  devices: int = 1
  limit_s: float = 120.0


def limited(fn: Callable[[], tuple], limit_s: float) -> tuple:
  """``fn()``'s ``(verdict, detail)``, or ``('hang', ...)`` when it runs
  past ``limit_s`` seconds; an exception it raises is a ``'mismatch'``."""
  result = []

  def target():
    try:
      result.append(fn())
    except BaseException:  # pylint: disable=broad-except
      result.append(('mismatch', 'the check itself raised:\n' +
                     traceback.format_exc()))

  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(limit_s)
  if not result:
    return 'hang', f'no result after {limit_s:.0f}s'
  return result[0]


def run_draws(family: Family, draws) -> tuple:
  """``(program, draws used, verdict, detail)`` of the program ``draws``
  replay to."""
  chooser = ReplayChooser(draws)
  program = family.draw(chooser)
  verdict, detail = limited(lambda: family.check(program), family.limit_s)
  return program, chooser.draws, verdict, detail


def run_seed(family: Family, seed: int) -> tuple:
  """``(program, draws, verdict, detail)`` of program ``seed``."""
  chooser = RecordingChooser(seed)
  program = family.draw(chooser)
  verdict, detail = limited(lambda: family.check(program), family.limit_s)
  return program, chooser.draws, verdict, detail


def _smaller(value: int):
  """Values to try in place of ``value``: the smallest first, then halfway,
  then one or two less."""
  seen = set()
  for v in (0, 1, 2, value // 4, value // 2, value - 2, value - 1):
    if 0 <= v < value and v not in seen:
      seen.add(v)
      yield v


def signature(verdict: str, detail: str) -> tuple:
  """What a shrunk program must keep of a failure: its verdict and, when
  something raised, the last line's exception class."""
  last = detail.strip().splitlines()[-1] if detail.strip() else ''
  if 'raise' in detail and ':' in last:
    return verdict, last.split(':')[0].split('.')[-1]
  return verdict, ''


def shrink(family: Family, draws, verdict: str, budget_s: float = 300.0,
           max_runs: int = 200, progress: Callable[[int], None] = None
           ) -> tuple:
  """Lowers ``draws`` one value at a time while the program still fails
  the same way (``signature``: the verdict, ``'mismatch'`` or ``'hang'``,
  and the class of what raised, if anything did).

  Args:
    family: the program's family.
    draws: the failing program's recorded draws.
    verdict: the failure to keep.
    budget_s: stop after this many seconds.
    max_runs: stop after this many candidate programs.
    progress: called with the number of runs after each one (the soak's
      worker prints it, so that its parent sees it is not hung).

  Returns:
    ``(program, draws, detail, runs)`` of the smallest failing program found.
  """
  start, runs = time.monotonic(), 0
  best = list(draws)
  program, _, _, detail = run_draws(family, best)
  keep = signature(verdict, detail)
  improved = True
  while improved:
    improved, i = False, 0
    while i < len(best):
      for value in _smaller(best[i]):
        if runs >= max_runs or time.monotonic() - start > budget_s:
          return program, best, detail, runs
        candidate = best[:i] + [value] + best[i + 1:]
        runs += 1
        cand_program, used, cand_verdict, cand_detail = run_draws(
            family, candidate)
        if progress:
          progress(runs)
        if signature(cand_verdict, cand_detail) == keep:
          program, best, detail = cand_program, used, cand_detail
          improved = True
          break
      i += 1
  return program, best, detail, runs


def report(family: Family, seed: int, program, draws, verdict: str,
           detail: str) -> str:
  """The text printed for a failing program: seed, how to rerun it, the
  program and what differed."""
  replay = ','.join(map(str, draws))
  shown = program if isinstance(program, str) else repr(program)
  src = getattr(program, 'src', None)
  return (f'--- {family.name} seed {seed}: {verdict}\n'
          f'rerun: python -m benchmarks.fuzz --family={family.name} '
          f'--replay={replay}\n{shown}\n{src or ""}\n{detail}')


def assert_seeds_pass(family: Family, first: int, count: int) -> None:
  """Runs seeds ``first .. first + count - 1`` of ``family`` (a CI slice)
  and fails with the report of the first that mismatches or hangs."""
  for seed in range(first, first + count):
    program, draws, verdict, detail = run_seed(family, seed)
    assert verdict not in FAILURES, report(family, seed, program, draws,
                                           verdict, detail)
