"""What the differential tests of third-party Linen code share.

A side script (``hf_side``, ``quant_side``) runs in its own process with
either the real ``flax.linen`` or :mod:`liftmods.compat` installed, and saves
every array it compares into one ``.npz``; :func:`run_side` is its ``main``.
The test runs both sides with :func:`run_sides` (flax first, sharing one
persistent XLA compilation cache), checks that each case saved the same
:func:`parts_of` it on both, and compares each part with
:func:`assert_identical`.
"""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
LINEN_MODULES = {'flax': 'flax.linen.linear',
                 'liftmods': 'liftmods.layers.linear'}


def flat(prefix, tree, out):
  """Puts every leaf of ``tree`` into ``out`` under ``prefix + keystr``
  (typed PRNG keys as their key data)."""
  import jax  # pylint: disable=import-outside-toplevel
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(
        leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    out[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)


def run_side(argv, cases, before_import=lambda: None):
  """``main`` of a side script: ``{flax,liftmods} OUT.npz [CASE ...]``.

  With ``liftmods`` the switch is installed first; ``before_import`` runs
  on both sides after that and before ``flax.linen`` is imported (shims).
  Each ``cases[name](out)`` fills ``out``.
  """
  side, path, names = argv[0], argv[1], argv[2:] or list(cases)
  if side == 'liftmods':
    from liftmods import compat  # pylint: disable=import-outside-toplevel
    compat.install()
  elif side != 'flax':
    raise SystemExit(f'side must be flax or liftmods, got {side!r}')
  before_import()
  import flax.linen  # pylint: disable=import-outside-toplevel
  out = {'meta/linen': np.asarray(flax.linen.Dense.__module__)}
  for name in names:
    start = time.process_time()
    cases[name](out)
    print(f'{side} {name}: {time.process_time() - start:.1f} s CPU',
          file=sys.stderr)
  np.savez(path, **out)


def run_sides(tmp, module, names, timeout=900, fast_compiles=False):
  """Runs ``python -m module SIDE OUT.npz *names`` for flax, then
  liftmods, and returns ``{side: {key: array}}``.

  Both share one persistent XLA compilation cache: where the two libraries
  lower to the same program (the cache key leaves out source locations) the
  liftmods side loads the executable the flax side compiled, the one it
  would have built itself. ``LIFTMODS_TEST_XLA_CACHE=0`` turns it off.
  ``fast_compiles`` has XLA skip most optimizations on both sides (see
  ``treecheck.fast_compiles``).
  """
  env = {**os.environ, 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'}
  if fast_compiles:
    env['JAX_DISABLE_MOST_OPTIMIZATIONS'] = '1'
  if os.environ.get('LIFTMODS_TEST_XLA_CACHE') != '0':
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp / 'xla_cache'),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  out = {}
  for side in LINEN_MODULES:
    proc = subprocess.run(
        [sys.executable, '-m', module, side, str(tmp / f'{side}.npz'),
         *names],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        check=False)
    assert proc.returncode == 0, f'{side} side failed:\n{proc.stderr[-4000:]}'
    out[side] = dict(np.load(tmp / f'{side}.npz'))
  for side, linen in LINEN_MODULES.items():
    assert str(out[side]['meta/linen']) == linen, (side, linen)
  return out


def keys_of(side, prefix):
  """The keys of ``side`` that are ``prefix`` or a path under it."""
  return sorted(k for k in side
                if k.startswith(prefix) and k[len(prefix):][:1] in '[./')


def parts_of(sides, name):
  """The parts saved under ``name/`` (the same on both sides)."""
  ref, ours = (sorted(k for k in sides[s] if k.startswith(name + '/'))
               for s in LINEN_MODULES)
  assert ref == ours, sorted(set(ref) ^ set(ours))
  return {k[len(name) + 1:].split('/')[0].split('[')[0].split('.')[0]
          for k in ref}


def assert_identical(sides, prefix):
  """Every array under ``prefix`` is equal bit for bit on both sides (keys,
  dtypes and shapes included). Returns how many were compared."""
  ref, ours = sides['flax'], sides['liftmods']
  keys = keys_of(ref, prefix)
  assert keys and keys == keys_of(ours, prefix)
  for key in keys:
    assert ref[key].dtype == ours[key].dtype, key
    if ref[key].tobytes() != ours[key].tobytes():
      np.testing.assert_array_equal(ours[key], ref[key], err_msg=key,
                                    strict=True)
      raise AssertionError(f'{key}: equal values, different bits')
  return len(keys)


def part_tests(parts):
  """The tests every differential suite runs over ``parts`` (``{case:
  [part, ...]}``), reading its module's ``sides`` fixture: each case saved
  exactly its parts, and each part is bit-identical. Bind both in the test
  module (``test_case_saved_its_parts, test_bit_identical = ...``)."""

  @pytest.mark.parametrize('case', parts)
  def test_case_saved_its_parts(sides, case):
    assert parts_of(sides, case) == set(parts[case])

  @pytest.mark.parametrize('case,part', [(case, part) for case, names in
                                         parts.items() for part in names])
  def test_bit_identical(sides, case, part):
    n = assert_identical(sides, f'{case}/{part}')
    print(f'{case}/{part}: {n} of {n} leaves bit-identical')

  return test_case_saved_its_parts, test_bit_identical
