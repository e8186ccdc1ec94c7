"""``aot.largest_fitting`` (``benchmarks.scaling --sweep``) against fake
compilers: no libtpu needed."""
import math

import pytest

from benchmarks import aot

HAVE = 15.75


def compiler(needs):
  """A probe that refuses sizes whose ``needs(n)`` GiB exceed ``HAVE``,
  reporting the figure as the TPU compiler does, and records what it
  compiled."""
  compiled = []

  def probe(n):
    compiled.append(n)
    if needs(n) > HAVE:
      return aot.Report(f'n={n}', 1.0, fits=False, needs_gib=needs(n),
                        available_gib=HAVE)
    return aot.Report(f'n={n}', 100.0, temp=n)

  return probe, compiled


def answer(needs, step, top=1000):
  return max((n for n in range(step, top, step) if needs(n) <= HAVE),
             default=0)


@pytest.mark.parametrize('needs', [
    lambda n: 4.0 + 0.1 * n,                     # linear: limit 117.5
    lambda n: 2.0 + 0.05 * n + 0.3 * math.sqrt(n),  # concave (nested)
    lambda n: 1.0 + 0.002 * n * n,               # convex
])
def test_finds_the_largest_fitting_multiple_of_step(needs):
  probe, compiled = compiler(needs)
  reports = aot.largest_fitting(probe, 8, 456)
  fits, refused = aot.fit_bounds(reports)
  assert fits == answer(needs, 8)
  assert refused == fits + 8
  assert sorted(reports) == sorted(compiled)  # each size compiled once
  # At most one fitting compile besides the answer.
  assert sum(r.fits for r in reports.values()) <= 2


def test_linear_figures_take_one_fitting_compile():
  probe, _ = compiler(lambda n: 4.0 + 0.1 * n)
  reports = aot.largest_fitting(probe, 8, 456)
  assert [n for n, r in reports.items() if r.fits] == [112]


def test_nothing_fitting_takes_only_refusals():
  probe, compiled = compiler(lambda n: 15.0 + 0.1 * n)
  reports = aot.largest_fitting(probe, 8, 456)
  assert aot.fit_bounds(reports) == (0, 8)
  assert len(compiled) <= 3  # 456, one estimate above 8, then 8


def test_refusals_without_figures_and_a_start_that_fits():
  """Refusals the compiler gives no figure for are still upper bounds, and
  a start that fits is doubled until one is refused."""
  def probe(n):
    if n > 100:
      return aot.Report(f'n={n}', 1.0, fits=False)
    return aot.Report(f'n={n}', 100.0)

  reports = aot.largest_fitting(probe, 8, 40)
  assert aot.fit_bounds(reports) == (96, 104)
  assert aot.fit_bounds({}) == (0, None)


def test_host_memory_refusals_locate_the_host_limit():
  """An offload policy on v5p: HBM refuses far above the host memory's
  limit (carries of 1/8 GiB in 128 GiB: 1,024 layers), and the compiler
  checks HBM first. With the host refusals' figures (``parse_oom`` reads
  them), the search lands on the limit instead of stepping down from the
  first host refusal one step per compile."""
  compiled = []

  def probe(n):
    compiled.append(n)
    if 1.0 + 0.005 * n > HAVE:
      return aot.Report(f'n={n}', 1.0, fits=False, needs_gib=1.0 + 0.005 * n,
                        available_gib=HAVE)
    if n / 8 > 128.0:
      return aot.Report(f'n={n}', 90.0, fits=False, needs_gib=n / 8,
                        available_gib=128.0)
    return aot.Report(f'n={n}', 100.0)

  reports = aot.largest_fitting(probe, 16, 5408)
  assert aot.fit_bounds(reports) == (1024, 1040)
  assert len(compiled) <= 6, compiled
