"""``make bench-accel`` (benchmarks/accelerator.py) as a smoke test on the CPU:
the tiny preset, every phase, every figure in the JSON and every row in the
table, so that the binary meant for a short GPU window cannot rot.

The binary runs as a command, as a user runs it: its phases are child
processes anyway, and its absl flags must stay out of the test process. Its
children compile with XLA's optimizations off and share a persistent
compilation cache (the liftmods and Linen programs are largely the same):
the plumbing is checked here, not the figures' values.
"""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from benchmarks import accelerator

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARIES = ('liftmods', 'flax.linen')
# Generous: the budgets only cut timing rounds short, and a loaded 2-core
# machine must not see a phase killed.
BUDGETS = ('--lm_budget_s=400', '--stack_budget_s=400', '--jit_budget_s=400')


def run(out, *args):
  cache = out.parent / 'xla_cache'
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS='1',
             JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.accelerator', '--preset=tiny',
       f'--out_dir={out}', *BUDGETS, *args], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return (json.loads((out / 'accelerator.json').read_text()),
          (out / 'accelerator.md').read_text())


def positive(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def assert_ratio(r):
  assert positive(r['median']) and positive(r['best']), r


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  return run(tmp_path_factory.mktemp('accel') / 'out', '--stack_search')


def test_every_phase_ran_on_the_cpu(tiny):
  results, _ = tiny
  assert list(results['phases']) == list(accelerator.PHASES)
  for phase, done in results['phases'].items():
    assert done['status'] == 'ok', (phase, results[phase])
    assert positive(done['wall_s'])
  assert results['device']['backend'] == 'cpu'
  assert results['device']['kind']
  assert results['versions']['jax'] and results['versions']['jaxlib']
  assert positive(results['total_wall_s'])


def test_lm_figures(tiny):
  lm = tiny[0]['lm']
  assert lm['size'] == 'tiny' and lm['preset'] == 'tiny'
  for key in ('params', 'batch', 'seq', 'tokens_per_step',
              'model_flops_per_step'):
    assert positive(lm[key]), key
  for name in LIBRARIES:
    r = lm[name]
    for key in ('lower_s', 'compile_s', 'step_median_s', 'step_best_s',
                'tokens_per_s'):
      assert positive(r[key]), (name, key)
    assert r['step_best_s'] <= r['step_median_s']
    assert len(r['step_rounds_s']) >= 2
    assert r['mfu'] is None  # no peak FLOP/s for a CPU
    assert math.isfinite(r['first_loss'])
  assert lm['peak_tflops'] is None and '--peak_tflops' in lm['peak_source']
  # The same program: the same first loss.
  assert math.isclose(lm['liftmods']['first_loss'],
                      lm['flax.linen']['first_loss'], rel_tol=1e-3)
  assert_ratio(lm['step_ratio'])
  assert positive(lm['compile_ratio'])
  assert_ratio(lm['trace']['ratio'])
  for name in LIBRARIES:
    assert positive(lm['trace'][name]['median_s'])
  assert_ratio(lm['forward_call']['ratio'])
  for name in ('nn.jit', 'jax.jit'):
    assert positive(lm['forward_call'][name]['median_s'])
  assert lm['out_of_memory_sizes'] == []


def test_stack_figures(tiny):
  stack = tiny[0]['stack']
  assert (stack['depth'], stack['hidden'], stack['batch']) == (8, 16, 32)
  assert set(stack['rows']) == set(accelerator.STACK_ROWS)
  for label, row in stack['rows'].items():
    assert row['fits'] and row['status'] == 'ok', (label, row)
    for key in ('compile_s', 'compiler_peak_bytes', 'step_median_s',
                'step_best_s'):
      assert positive(row[key]), (label, key)
    assert 'device_peak_bytes' not in row  # the CPU keeps no such counter
  # XLA:CPU has no host memory of its own: offload says so, and runs.
  assert stack['offload_supported'] is False
  for label in ('offload_carries', 'offload_nested'):
    assert stack['rows'][label]['offload'].startswith('unsupported: '), label
  for a, b in accelerator.STACK_TABLE:
    assert_ratio(stack['step_ratios'][f'{a}/{b}'])
  assert 'no memory_stats' in stack['device_peak']
  assert stack['search']['status'].startswith('skipped')


def test_jit_figures(tiny):
  models = tiny[0]['jit']['models']
  assert len(models) == 2  # the MLP and the scanned stack
  for label, r in models.items():
    for key in ('vs_jax_jit', 'vs_jax_jit_best', 'vs_linen_nn_jit',
                'median_us', 'jax_jit_us', 'linen_us'):
      assert positive(r[key]), (label, key)


def test_table_has_every_row(tiny):
  results, table = tiny
  lines = table.splitlines()
  assert lines[0].startswith('`python -m benchmarks.accelerator --preset=tiny')
  assert '**CPU**' in lines[0] and 'not an accelerator' in lines[0]
  rows = [line for line in lines if line.startswith('| ') and
          not line.startswith('| figure')]
  firsts = [row.split(' | ')[0][2:] for row in rows]
  for figure in ('train step', 'tokens/s', 'MFU', 'trace+lower', 'first-step '
                 'loss', 'apply trace', 'nn.jit / jax.jit'):
    assert sum(figure in f for f in firsts) == 1, figure
  for a, b in accelerator.STACK_TABLE:
    assert sum(f.endswith(f': {a} vs {b}') for f in firsts) == 1, (a, b)
  for label in results['jit']['models']:
    assert sum(f'eager call, {label}' in f for f in firsts) == 1, label
  assert len(rows) == 7 + len(accelerator.STACK_TABLE) + 2
  assert all(row.count(' | ') == 3 for row in rows)


def test_rows_in_fresh_processes(tmp_path):
  """--stack_isolate=always: each row again in a process of its own (on a
  device, for its peak memory); on the CPU it runs and says there is no
  peak to read."""
  results, _ = run(tmp_path / 'out', '--phases=stack',
                   '--stack_isolate=always',
                   '--stack_rows=offload_carries,linen_scan_remat')
  stack = results['stack']
  assert stack['device_peak'] == 'each row in a fresh process'
  assert set(stack['rows']) == {'offload_carries', 'linen_scan_remat'}
  for row in stack['rows'].values():
    assert row['device_peak'] == 'ok' and 'device_peak_bytes' not in row
  assert list(results['phases']) == ['stack']


@pytest.mark.parametrize('kind,tflops', [
    ('NVIDIA H100 80GB HBM3', 989), ('NVIDIA H100 PCIe', 756),
    ('NVIDIA H100 NVL', 835), ('NVIDIA H200', 989), ('NVIDIA GH200 480GB', 989),
    ('NVIDIA A100-SXM4-40GB', 312), ('NVIDIA L40S', 362), ('NVIDIA L4', 121),
    ('TPU v4', 275), ('TPU v5 lite', 197), ('TPU v5p', 459),
    ('TPU v6 lite', 918), ('cpu', None)])
def test_peak_flops_by_device_kind(kind, tflops):
  assert accelerator.peak_tflops(kind)[0] == tflops
  assert accelerator.peak_tflops(kind, 100.0) == (100.0, '--peak_tflops')


def test_depth_search_doubles_then_bisects():
  """--stack_search's search, with a probe that fits up to 700 layers."""
  seen = []

  def probe(label, depth, seconds):
    seen.append((label, depth))
    assert seconds > 0
    if depth <= 700:
      return {'fits': True, 'status': 'ok'}
    return {'fits': False, 'status': 'does not fit: RESOURCE_EXHAUSTED'}

  rec = {'device': {'memory_stats': True}, 'depth': 64}
  out = accelerator.search_depths(rec, 64, 600, probe)
  for label in accelerator.SEARCH_ROWS:
    assert out[label]['largest_fitting'] == 640
    assert out[label]['smallest_refused'] == 704 and out[label]['exact']
    assert [d for l, d in seen if l == label] == [
        64, 128, 256, 512, 1024, 768, 640, 704]
  cpu = accelerator.search_depths({'device': {'memory_stats': False},
                                   'depth': 64}, 64, 600, probe)
  assert cpu['status'].startswith('skipped') and len(seen) == 16


def test_depth_search_stops_at_an_error():
  def probe(label, depth, seconds):
    del label, seconds
    return {'status': 'ok', 'fits': True} if depth < 128 else {
        'status': 'exited with -6'}

  out = accelerator.search_depths({'device': {'memory_stats': True},
                                   'depth': 64}, 64, 600, probe)
  for label in accelerator.SEARCH_ROWS:
    assert out[label]['largest_fitting'] == 64
    assert out[label]['smallest_refused'] is None
    assert out[label]['probes'] == {64: 'ok', 128: 'exited with -6'}


@pytest.mark.parametrize('required', ['gpu', 'accelerator'])
def test_refuses_cpu_figures_when_an_accelerator_was_asked_for(
    tmp_path, required):
  out = tmp_path / 'out'
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.accelerator', '--preset=tiny',
       f'--out_dir={out}', f'--require_backend={required}'], cwd=ROOT,
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode != 0
  assert (f"refusing to run: --require_backend={required}, but JAX's default"
          " backend in this environment is 'cpu'") in result.stderr
  assert 'make bench-accel VENV= PY=python3' in result.stderr
  assert not (out / 'accelerator.json').exists()


def test_backend_refusal_rules():
  gpu, cpu, tpu = ({'backend': b, 'kind': k} for b, k in (
      ('gpu', 'NVIDIA H100'), ('cpu', 'cpu'), ('tpu', 'TPU v5 lite')))
  refuse = accelerator.backend_refusal
  assert refuse('', cpu) is None
  assert refuse('gpu', gpu) is None and refuse('tpu', tpu) is None
  assert refuse('accelerator', gpu) is None
  assert refuse('accelerator', tpu) is None
  assert "backend in this environment is 'cpu'" in refuse('accelerator', cpu)
  assert "backend in this environment is 'tpu'" in refuse('gpu', tpu)
