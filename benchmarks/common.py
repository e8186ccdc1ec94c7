"""Timing helpers shared by the benchmark binaries."""
import statistics
import time

import jax


def time_calls(fn, repeats: int, warmup: int = 1) -> dict:
  """Runs ``fn`` ``warmup + repeats`` times; returns best and median seconds."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return {'best': min(times), 'median': statistics.median(times)}


def _fmt(seconds: float) -> str:
  if seconds < 1e-3:
    return f'{seconds * 1e6:>10.1f}us'
  return f'{seconds * 1e3:>10.2f}ms'


def print_table(title: str, rows: list, baseline: str):
  """Prints ``rows`` of (label, {'best','median'}) with ratios to ``baseline``."""
  base = dict(rows)[baseline]
  width = max(24, max(len(label) for label, _ in rows) + 2)
  print(f'\n{title}')
  print(f'  {"":<{width}}{"median":>12}{"best":>12}{"ratio(median)":>16}')
  for label, t in rows:
    ratio = t['median'] / base['median']
    print(f'  {label:<{width}}{_fmt(t["median"])}{_fmt(t["best"])}'
          f'{ratio:>15.2f}x')


def ratio(rows: list, a: str, b: str) -> float:
  d = dict(rows)
  return d[a]['median'] / d[b]['median']
