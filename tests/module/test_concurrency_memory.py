"""Threads and long runs.

- One module object used for init/apply from 8 threads at once gives the
  single-threaded results, bit for bit; module classes defined and
  instantiated inside threads work (auto-naming, setup, compact).
- Repeated apply calls, eager and jitted, leave no growth in Python objects
  or live JAX buffers. CI runs a few hundred calls; the 10,000-call version
  runs with LIFTMODS_SLOW=1 (``pytest -m slow``).
"""
import concurrent.futures
import functools
import gc
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as nn
import treecheck

N_THREADS = 8
X = jnp.linspace(-1., 1., 12).reshape(3, 4)


class Net(nn.Module):
  """Params, batch stats, dropout and lifted transforms in one model."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(4)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Dropout(0.5, deterministic=not train)(x)
    x = nn.vmap(nn.Dense, variable_axes={'params': 0},
                split_rngs={'params': True})(4)(x)
    return nn.remat(nn.Dense)(2)(x)


def _init_apply(model, seed):
  rngs = {'params': jax.random.key(seed), 'dropout': jax.random.key(seed + 1)}
  variables = model.init(rngs, X)
  y, updates = model.apply(variables, X, rngs={'dropout': jax.random.key(9)},
                           mutable=['batch_stats'])
  return variables, y, updates


# Container types must match too.
assert_identical = functools.partial(treecheck.assert_identical,
                                     same_containers=True)


def _run_in_threads(fn, n=N_THREADS):
  barrier = threading.Barrier(n)

  def start(i):
    barrier.wait()  # all threads enter the library together
    return fn(i)

  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    return list(pool.map(start, range(n)))


def test_one_module_object_from_eight_threads():
  model = Net()
  expected = {seed: _init_apply(model, seed) for seed in (0, 1)}
  results = _run_in_threads(lambda i: _init_apply(model, i % 2))
  for i, got in enumerate(results):
    assert_identical(got, expected[i % 2])


def _define_and_init(i):
  class Block(nn.Module):
    features: int

    def setup(self):
      self.proj = nn.Dense(self.features)
      self.norm = nn.LayerNorm()

    def __call__(self, x):
      return self.norm(self.proj(x))

  class Tower(nn.Module):

    @nn.compact
    def __call__(self, x):
      for width in (4, 3):
        x = Block(width)(x)
      return nn.Dense(2)(x)

  variables = Tower().init(jax.random.key(i % 2), X)
  return variables, Tower().apply(variables, X)


def test_classes_defined_and_instantiated_in_threads():
  expected = {seed: _define_and_init(seed) for seed in (0, 1)}
  names = sorted(expected[0][0]['params'])
  assert names == ['Block_0', 'Block_1', 'Dense_0']
  for i, got in enumerate(_run_in_threads(_define_and_init)):
    assert_identical(got, expected[i % 2])


# -- memory ----------------------------------------------------------------


class Small(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4)(x)
    x = nn.BatchNorm(use_running_average=False)(x)
    self.sow('intermediates', 'h', x)
    # (nn.jit is left out: its eager-call caching is being reworked on
    # another branch; add it back once an eager call no longer recompiles.)
    return nn.remat(nn.Dense)(2)(x)


def _growth(call, warmup, calls):
  """(Python objects, live JAX arrays) added by ``calls`` more calls."""
  for _ in range(warmup):
    jax.block_until_ready(call())
  gc.collect()
  objects, arrays = len(gc.get_objects()), len(jax.live_arrays())
  for _ in range(calls):
    jax.block_until_ready(call())
  gc.collect()
  return len(gc.get_objects()) - objects, len(jax.live_arrays()) - arrays


def test_growth_detects_a_leak():
  """The measure is not vacuous: a call that keeps its outputs shows."""
  kept = []
  objects, arrays = _growth(lambda: kept.append(jnp.ones(2) + 1) or kept[-1],
                            warmup=5, calls=300)
  # Every kept output is a live array; the object count is noisier (other
  # caches fill and drain), so it must only clear the non-leak tolerance
  # below (fewer than max(100, calls // 20) new objects) by a wide margin.
  assert arrays >= 300 and objects >= 150, (objects, arrays)


def _calls(jitted):
  model = Small()
  variables = model.init(jax.random.key(0), X)
  apply = lambda v, x: model.apply(v, x, mutable=['batch_stats'])
  apply = jax.jit(apply) if jitted else apply
  state = {'v': variables}

  def call():
    y, updates = apply(state['v'], X)
    state['v'] = {**state['v'], **updates}  # feed the stats back
    return y

  return call


def _check_no_growth(jitted, calls):
  objects, arrays = _growth(_calls(jitted), warmup=50, calls=calls)
  # A leak of one object per call would show as >= calls; allow noise from
  # interpreter and library caches warming up.
  assert objects < max(100, calls // 20), objects
  assert arrays <= 0, arrays


@pytest.mark.parametrize('jitted', [False, True], ids=['eager', 'jit'])
def test_repeated_apply_does_not_grow(jitted):
  _check_no_growth(jitted, calls=200)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get('LIFTMODS_SLOW'),
                    reason='10,000 calls: set LIFTMODS_SLOW=1')
@pytest.mark.parametrize('jitted', [False, True], ids=['eager', 'jit'])
def test_ten_thousand_applies_do_not_grow(jitted):
  _check_no_growth(jitted, calls=10_000)
