"""Tracing a module binds no primitive the hand-written JAX function does
not: the model of ``benchmarks.trace_overhead`` (LayerNorm -> Dense -> gelu
-> Dense blocks) binds as many primitives per trace as its hand-written
twin, and the same model under a precision policy binds as many as with
``dtype``/``param_dtype`` threaded by hand. Counts are taken on a warm
trace (jax caches the inner traces of its jitted numpy functions)."""
import jax
import jax.numpy as jnp

import liftmods as nn
from benchmarks import trace_overhead as bench

DEPTH, HIDDEN = 2, 16
X = jnp.ones((8, HIDDEN))


def warm_count(fn, *args):
  """(primitives bound, equations) for tracing ``fn(*args)``, the second
  time (a fresh wrapper each time, so jax's trace cache does not hit)."""
  trace = lambda: jax.make_jaxpr(lambda *a: fn(*a))(*args)
  trace()
  count = bench.bound_primitives(trace)
  return count, len(trace().jaxpr.eqns)


def test_module_binds_what_the_hand_written_function_binds():
  model = bench.build(nn)(DEPTH, HIDDEN)
  variables = jax.eval_shape(model.init, jax.random.key(0), X)
  hand = warm_count(bench.hand_apply, bench.as_hand_params(variables, DEPTH),
                    X)
  assert warm_count(model.apply, variables, X) == hand
  assert hand[0] == 31 * DEPTH  # the per-block figure quoted in the docs


def test_policy_binds_what_threaded_dtypes_bind():
  model = bench.build(nn)(DEPTH, HIDDEN)
  threaded = bench.build(nn, dtype=jnp.bfloat16,
                         param_dtype=jnp.float32)(DEPTH, HIDDEN)
  variables = jax.eval_shape(model.init, jax.random.key(0), X)
  policy = nn.Precision(compute_dtype=jnp.bfloat16, param_dtype=jnp.float32)

  def under_policy(v, x):
    with nn.precision_policy(policy):
      return model.apply(v, x)

  assert (warm_count(under_policy, variables, X)
          == warm_count(threaded.apply, variables, X))
