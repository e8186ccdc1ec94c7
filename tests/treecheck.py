"""The comparison helpers every test folder shares.

- ``assert_identical``: bit-exact tree equality (same paths, dtypes, shapes
  and bytes at every leaf);
- ``assert_close``: the same structure checks with ``np.testing.assert_allclose``
  on the values, with the tolerances stated at the call site;
- ``run_both`` / ``assert_matches_linen``: the flax-oracle runner, which
  runs one program written against a Linen-style namespace under
  ``flax.linen`` and under ``liftmods``.

Trees are compared through ``plain``, so a flax ``FrozenDict`` and a liftmods
``FrozenDict`` (or a dict) with the same contents are the same tree.

>>> import numpy as np
>>> assert_identical({'a': np.zeros(2)}, {'a': np.zeros(2)})
>>> assert_close({'a': np.ones(2)}, {'a': np.ones(2) + 1e-7},
...              rtol=1e-6, atol=0)
"""
import contextlib

import flax
import flax.linen
import jax
import numpy as np

import liftmods
from tools.check_env import version_tuple

LINEN_AND_LIFTMODS = (flax.linen, liftmods)


# flax's (major, minor, micro), for tests whose oracle changed between
# releases.
FLAX_VERSION = version_tuple(flax.__version__)


def plain(tree):
  """``tree`` as nested dicts, lists and tuples of numpy arrays: FrozenDicts
  thawed, ``Partitioned`` boxes of either library as their names and value,
  ``flax.core.nn`` embeddings (which carry a ``table``) as that table, typed
  PRNG keys as their key data."""
  if hasattr(tree, 'names') and hasattr(tree, 'value'):  # Partitioned
    return {'names': np.asarray(repr(tuple(tree.names))),
            'value': plain(tree.value)}
  if hasattr(tree, 'items'):
    return {k: plain(v) for k, v in tree.items()}
  if hasattr(tree, 'table'):
    return {'table': np.asarray(tree.table)}
  if type(tree) in (list, tuple):
    return type(tree)(plain(v) for v in tree)
  return jax.tree_util.tree_map(_as_array, tree)


def _as_array(x):
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


def _paired_leaves(actual, expected, what):
  a = jax.tree_util.tree_flatten_with_path(plain(actual))[0]
  e = jax.tree_util.tree_flatten_with_path(plain(expected))[0]
  a_paths = [jax.tree_util.keystr(p) for p, _ in a]
  e_paths = [jax.tree_util.keystr(p) for p, _ in e]
  assert a_paths == e_paths, (
      f'{what}: different leaves:\n  got      {a_paths}\n'
      f'  expected {e_paths}')
  for (path, x), (_, y) in zip(a, e):
    where = f'{what}{jax.tree_util.keystr(path)}'
    assert x.dtype == y.dtype, f'{where}: dtype {x.dtype} != {y.dtype}'
    assert x.shape == y.shape, f'{where}: shape {x.shape} != {y.shape}'
    yield where, x, y


def assert_identical(actual, expected, what='', *, same_containers=False):
  """Same paths, dtypes, shapes and bytes at every leaf (so ``-0.0`` differs
  from ``0.0``, and NaNs must carry the same payload). With
  ``same_containers`` the container types must match too (a FrozenDict is
  then not a dict). Symmetric: the order only changes the message."""
  if same_containers:
    ta, te = (jax.tree_util.tree_structure(t) for t in (actual, expected))
    assert ta == te, f'{what}: containers differ:\n  {ta}\n  {te}'
  for where, x, y in _paired_leaves(actual, expected, what):
    if x.tobytes() != y.tobytes():
      np.testing.assert_array_equal(x, y, err_msg=where)
      raise AssertionError(f'{where}: equal values, different bits')


def assert_close(actual, expected, *, rtol, atol, what='',
                 same_containers=False):
  """Same paths, dtypes and shapes; values within ``rtol``/``atol``."""
  if same_containers:
    ta, te = (jax.tree_util.tree_structure(t) for t in (actual, expected))
    assert ta == te, f'{what}: containers differ:\n  {ta}\n  {te}'
  for where, x, y in _paired_leaves(actual, expected, what):
    if x.dtype.kind in 'USO':  # strings (e.g. axis names), objects
      np.testing.assert_array_equal(x, y, err_msg=where)
      continue
    if jax.dtypes.issubdtype(x.dtype, np.floating):  # bfloat16 included
      x, y = x.astype(np.float64), y.astype(np.float64)
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=where)


def run_both(program, *args, **kwargs):
  """``(program(flax.linen, ...), program(liftmods, ...))``."""
  return tuple(program(nn, *args, **kwargs) for nn in LINEN_AND_LIFTMODS)


def assert_matches_linen(program, *args, rtol=None, atol=None, **kwargs):
  """Runs ``program(nn, ...)`` under both namespaces and compares the
  results: bit for bit, or within ``rtol``/``atol`` when they are given.
  Returns liftmods' result."""
  theirs, ours = run_both(program, *args, **kwargs)
  if rtol is None and atol is None:
    assert_identical(ours, theirs, 'liftmods vs flax.linen')
  else:
    assert_close(ours, theirs, rtol=rtol or 0, atol=atol or 0,
                 what='liftmods vs flax.linen')
  return ours


def normal(seed, shape, dtype=np.float32, *, scale=1.0, shift=0.0):
  """A normal test input (``scale * N(0, 1) + shift``) drawn on the host
  (numpy), as a jax array.

  Module-level inputs use this rather than ``jax.random.normal``: each new
  shape there is an XLA compile, paid by every xdist worker while it
  collects the suite.

  >>> normal(0, (2, 3)).shape
  (2, 3)
  """
  x = np.random.default_rng(seed).standard_normal(shape, np.float32)
  return jax.numpy.asarray((x * scale + shift).astype(dtype))


@contextlib.contextmanager
def fast_compiles(enabled=True):
  """XLA skips most optimizations inside (``enabled=False``: XLA optimizes
  inside); the setting is restored after. For tests whose time goes to
  compiling many small programs rather than running them. Programs compared
  with each other are compiled alike, so what a test compares does not
  change; the modules measured spent 11-26% less time. Not for tests that
  compare liftmods' optimized programs bit for bit with hand-written ones
  (the stack tests: an unrolled stack differs from a scan in the last bit
  without the optimizations), nor for memory figures.

  JAX's in-memory caches do not key on the setting, so they are emptied
  whenever it changes, on the way in and out: otherwise an executable built
  under one setting (say the eager ``jax.random.normal`` of one shape, whose
  last bits differ between the two) would serve a program compared with one
  built under the other. Executables come back from the persistent cache."""
  old = jax.config.read('jax_disable_most_optimizations')
  if old == enabled:
    yield
    return
  jax.clear_caches()
  jax.config.update('jax_disable_most_optimizations', enabled)
  try:
    yield
  finally:
    jax.clear_caches()
    jax.config.update('jax_disable_most_optimizations', old)
