"""liftmods' uses of JAX outside its public API stay in ``liftmods/jax_private.py``,
and each of them still does what liftmods needs of it.

Checked on jax/jaxlib ``CHECKED_ON`` (the lowest and newest of the support
window in pyproject.toml, and the 0.11 line that GPU images ship). On
another JAX these tests are the first to say which internal moved.
"""
import ast
import pathlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as nn
from liftmods import jax_private
from tools import check_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKED_ON = ('0.10.2', '0.11.2', '0.12.0.1')
PRIVATE = ('jax._src', 'jax.interpreters', 'jax.extend')


def _private_uses(path: pathlib.Path):
  """``(line, what)`` for each import of, or attribute path into, a
  non-public JAX module in one file."""
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f'{node.module}.{a.name}' for a in node.names]
    elif isinstance(node, ast.Attribute):
      names = [ast.unparse(node)]
    for name in names:
      if name.startswith(PRIVATE):
        yield node.lineno, name


def test_only_jax_private_reaches_past_the_public_api():
  found = {}
  for path in sorted((ROOT / 'liftmods').rglob('*.py')):
    if path.name == 'jax_private.py':
      continue
    uses = sorted(set(_private_uses(path)))
    if uses:
      found[str(path.relative_to(ROOT))] = uses
  assert not found, found


def test_the_checked_versions_include_the_window_ends():
  window = check_env.declared()['jax']
  assert ('>=', CHECKED_ON[0]) in window
  assert all(check_env.inside(v, window) for v in CHECKED_ON)


def test_known_outputs_splits_known_from_unknown():
  def f(a, b):
    return {'known': jnp.sin(a) * 2, 'mixed': a + b, 'unknown': b.sum()}

  values, tree = jax_private.known_outputs(
      f, [jnp.arange(3.0), jax.ShapeDtypeStruct((3,), jnp.float32)])
  out = jax.tree_util.tree_unflatten(tree, values)
  np.testing.assert_array_equal(out['known'], jnp.sin(jnp.arange(3.0)) * 2)
  assert isinstance(out['mixed'], jax_private.Unknown)
  assert out['mixed'].aval.shape == (3,)
  assert out['unknown'].aval.shape == ()


def test_known_outputs_never_computes_the_unknown_part():
  calls = []

  def f(key, x):
    calls.append(type(x).__name__)
    return jax.random.normal(key, (x.shape[-1],)), x @ x.T

  huge = jax.ShapeDtypeStruct((1 << 28, 1024), jnp.float32)  # 1 TB
  (w, prod), _ = jax_private.known_outputs(f, [jax.random.key(0), huge])
  assert w.shape == (1024,) and isinstance(prod, jax_private.Unknown)
  assert len(calls) == 1


def test_jaxpr_as_fun_replays_a_traced_program():
  traced = jax.make_jaxpr(lambda x, y: (x * y, x - y))(2.0, 3.0)
  assert [float(v) for v in jax_private.jaxpr_as_fun(traced)(5.0, 1.0)] == [
      5.0, 4.0]


def test_trace_state_token_tells_levels_apart():
  outside = jax_private.opaque_trace_state()
  assert outside == jax_private.opaque_trace_state()
  inside = []
  jax.jit(lambda x: inside.append(jax_private.opaque_trace_state()) or x)(1.0)
  assert inside[0] != outside


def test_api_boundary_hides_liftmods_frames():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(x, 'extra')

  with pytest.raises(TypeError) as info:
    Net().init(jax.random.key(0), jnp.ones((1, 3)))
  files = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
  assert not [f for f in files if f.startswith(str(ROOT / 'liftmods'))]


def test_extended_dtype_round_trips_through_a_jit():
  from liftmods import fp8_ops
  dtype = fp8_ops.fp8_meta_dtype_wrapper(jnp.float32)
  assert isinstance(dtype, jax_private.ExtendedDType)
  assert jax_private.CAN_USE_EARRAY
  # Made inside a jit and returned: the result handler builds the EArray.
  meta = jax.jit(lambda: jax.lax.convert_element_type(
      jnp.float32(3.0), dtype))()
  assert meta.dtype == dtype
  # Adding two fp8_meta values takes their maximum.
  grown = jax.jit(lambda a, b: jax.lax.convert_element_type(
      fp8_ops.Fp8MetaTyRules.add(dtype, a, b), jnp.float32))(meta, meta)
  assert float(grown) == 3.0


def test_known_outputs_keeps_an_abstract_value_as_given():
  aval = jax.core.ShapedArray((3,), jnp.float32, weak_type=True)
  (out,), _ = jax_private.known_outputs(lambda a: (a * 2,), [aval])
  assert isinstance(out, jax_private.Unknown) and out.aval.weak_type
