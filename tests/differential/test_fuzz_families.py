"""The fuzz families past Linen (``fuzz/families.py``), a CI slice of the
soak (``python -m benchmarks.fuzz``), and the harness they share: the time
limit that turns a hang into a failure, replayable draws and shrinking.

The 1-device families run a few fixed seeds here; the 8-device ones
(``sharded_init``, ``shard_map``, ``pipeline``, ``explicit``) run in a process of their
own with 8 simulated devices (``fuzz_spmd_cases.py``; its cases marked
``integration`` with ``make test-integration``). Failures the soak
found and that are not fixed yet are strict xfails there, named after what
they are.
"""
import pathlib
import time

import pytest

import multidevice
from fuzz import families, harness, programs

CI_SEEDS = {'stack': (100, 3), 'attention': (100, 3), 'lifted': (100, 3),
            'state': (100, 3)}


@pytest.mark.parametrize('name', sorted(CI_SEEDS))
def test_family_slice(name):
  harness.assert_seeds_pass(families.get(name), *CI_SEEDS[name])


@pytest.mark.long
def test_eight_device_families():
  multidevice.assert_cases_pass(
      pathlib.Path(__file__).with_name('fuzz_spmd_cases.py'),
      marks='not integration')


@pytest.mark.integration
def test_eight_device_long_cases():
  multidevice.assert_cases_pass(
      pathlib.Path(__file__).with_name('fuzz_spmd_cases.py'),
      marks='integration')


def test_every_family_is_registered_with_its_devices():
  assert families.names()[:2] == ['linen', 'stack']
  assert {n: families.devices(n) for n in families.names()} == {
      'linen': 1, 'stack': 1, 'attention': 1, 'lifted': 1, 'state': 1,
      'sharded_init': 8, 'shard_map': 8, 'pipeline': 8, 'explicit': 8}
  with pytest.raises(KeyError, match="unknown fuzz family 'stak'.*'stack'"):
    families.get('stak')


def test_a_program_past_its_time_limit_is_a_hang():
  start = time.monotonic()
  verdict, detail = harness.limited(lambda: time.sleep(30) or ('ok', ''),
                                    0.2)
  assert (verdict, detail) == ('hang', 'no result after 0s')
  assert time.monotonic() - start < 5
  assert harness.limited(lambda: ('ok', ''), 5) == ('ok', '')
  verdict, detail = harness.limited(lambda: 1 / 0, 5)
  assert verdict == 'mismatch' and 'ZeroDivisionError' in detail


def test_replay_gives_the_recorded_program():
  recorder = harness.RecordingChooser(7)
  src = programs.generate(recorder)
  replay = harness.ReplayChooser(recorder.draws)
  assert programs.generate(replay) == src
  assert replay.draws == recorder.draws
  # Past its end a replay answers the lowest option.
  short = harness.ReplayChooser([])
  assert [short.integer(3, 9), short.choice('xyz')] == [3, 'x']


def _toy_family(fails):
  """Draws (layers, width); ``fails(program)`` says whether it mismatches."""
  def draw(c):
    return c.integer(0, 9), c.integer(0, 99)
  return harness.Family('toy', draw, lambda p: (
      ('mismatch', 'differs') if fails(p) else ('ok', '')))


def test_shrink_lowers_every_draw_while_the_failure_stays():
  family = _toy_family(lambda p: p[0] >= 3 and p[1] % 2 == 1)
  program, draws, detail, runs = harness.shrink(family, [8, 77],
                                                'mismatch')
  assert program == (3, 1) and draws == [3, 1] and detail == 'differs'
  assert runs < 40


def test_shrink_keeps_the_kind_of_failure():
  """A smaller program failing differently (another exception) is not
  taken."""
  def check(p):
    if p[0] == 0:
      raise KeyError('other')
    return ('mismatch', 'the check itself raised:\nValueError: x')
  family = harness.Family('toy', _toy_family(None).draw, check)
  program, _, detail, _ = harness.shrink(family, [5, 5], 'mismatch')
  assert program == (1, 0) and detail.endswith('ValueError: x')


def test_the_soak_reads_a_silent_worker_as_a_hang():
  """The soak's parent reads each worker's result lines with a time limit:
  a worker that goes silent (a hung program) ends the read with None."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from benchmarks import fuzz  # pylint: disable=g-import-not-at-top
  proc = subprocess.Popen(
      [sys.executable, '-c', "print('@@ {}', flush=True); print('x', "
       "flush=True); import time; time.sleep(60)"], stdout=subprocess.PIPE)
  try:
    start = time.monotonic()
    assert list(fuzz._read_lines(proc, 3)) == ['@@ {}', 'x', None]  # pylint: disable=protected-access
    assert time.monotonic() - start < 30
  finally:
    proc.kill()
    proc.wait()


def test_shrink_reports_each_run():
  """The soak's worker prints each shrinking run: its parent counts a
  silent worker as hung, and shrinking is not silence."""
  seen = []
  family = _toy_family(lambda p: p[0] >= 3)
  harness.shrink(family, [8, 7], 'mismatch', progress=seen.append)
  assert seen and seen == list(range(1, len(seen) + 1))


def test_the_soak_summary_counts_every_verdict():
  """The per-family summary lists Linen's own failures (programs liftmods
  runs on purpose) beside the four verdicts every family has."""
  from benchmarks import fuzz  # pylint: disable=g-import-not-at-top
  tally = fuzz._Tally('linen')  # pylint: disable=protected-access
  for verdict in ('ok', 'ok', 'linen_fails', 'both_raise'):
    tally.add({'seed': 0, 'verdict': verdict, 'detail': 'x', 'seconds': 1})
  lines = tally.summary().splitlines()
  assert lines[1:6] == ['  ok               2', '  both_raise       1',
                        '  hang             0', '  mismatch         0',
                        '  linen_fails      1']
