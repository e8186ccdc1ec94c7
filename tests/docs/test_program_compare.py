"""tests/program_compare.py: two programs are the same only when their
optimized HLO is, up to names, metadata and sharding annotations; results of
the same program compare bit for bit, of different ones to a tolerance."""
import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import program_compare
from program_compare import (assert_match, canonical_hlo, optimized_hlo,
                             run_compiled)

X = jnp.linspace(-1.0, 1.0, 8)


def test_the_docstring_example():
  assert doctest.testmod(program_compare).failed == 0


def test_names_and_source_lines_do_not_count():
  def first(x):
    return jnp.tanh(x) * 2.0

  def second(y):  # another name, other source lines, the same program
    z = jnp.tanh(y)
    return z * 2.0

  a, b = optimized_hlo(jax.jit(first), X), optimized_hlo(jax.jit(second), X)
  assert a == b
  assert 'first' not in a and 'metadata' not in a and 'op_name' not in a


def test_other_arithmetic_is_another_program():
  one = optimized_hlo(jax.jit(lambda x: x * 2.0 + 1.0), X)
  other = optimized_hlo(jax.jit(lambda x: (x + 0.5) * 2.0), X)
  assert one != other
  # Another shape compiles another program too.
  assert one != optimized_hlo(jax.jit(lambda x: x * 2.0 + 1.0), X[:4])


def test_sharding_annotations_do_not_count():
  mesh = jax.make_mesh((1,), ('d',))
  spec = jax.sharding.NamedSharding(mesh, jax.P('d'))
  plain = jax.jit(lambda x: jnp.sin(x) + 1.0)
  sharded = jax.jit(lambda x: jnp.sin(x) + 1.0, out_shardings=spec)
  assert optimized_hlo(plain, X) == optimized_hlo(sharded, X)


def test_canonical_names_are_a_bijection():
  text = ('ENTRY %main (a.1: f32[], b.2: f32[]) -> f32[] {\n'
          '  %a.1 = f32[] parameter(0)\n  %b.2 = f32[] parameter(1)\n'
          '  ROOT %s.3 = f32[] subtract(%a.1, %b.2)\n}')
  swapped = text.replace('subtract(%a.1, %b.2)', 'subtract(%b.2, %a.1)')
  assert canonical_hlo(text) != canonical_hlo(swapped)


def test_run_compiled_returns_the_result_and_the_program():
  fn = jax.jit(lambda x: x * 3.0)
  y, hlo = run_compiled(fn, X)
  np.testing.assert_array_equal(y, X * 3.0)
  assert hlo == optimized_hlo(fn, X)


def test_assert_match_is_bitwise_only_for_the_same_program():
  a = np.float32([1.0, 2.0])
  b = np.nextafter(a, np.float32(3.0))  # one ulp apart
  assert assert_match(a, a, [('p', 'p')], rtol=1e-6, atol=0) is True
  with pytest.raises(AssertionError):
    assert_match(a, b, [('p', 'p'), ('q', 'q')], rtol=1e-6, atol=0)
  assert assert_match(a, b, [('p', 'p'), ('q', 'r')], rtol=1e-6,
                      atol=0) is False
  with pytest.raises(AssertionError):
    assert_match(a, 1.01 * a, [('p', 'q')], rtol=1e-6, atol=0)
