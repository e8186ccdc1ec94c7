"""Differential tests: liftmods.fp8_ops against flax.linen.fp8_ops — the
same variables, forward values, gradients and scale/amax-history updates
(delivered as gradients of the ``_overwrite_with_gradient`` collection)."""
import warnings

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from treecheck import assert_identical, plain
from flax.linen import fp8_ops as ffp8

import liftmods as lnn
from liftmods import fp8_ops as lfp8

pytestmark = pytest.mark.usefixtures('fast_compiles')

OWG = '_overwrite_with_gradient'
DIMS = (((1,), (0,)), ((), ()))


def rand(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape)


def train_steps(model, variables, args, steps=3):
  """Forward values and the overwrite-with-gradient updates of a few
  steps; returns [(y, grads)] per step."""
  def loss(v):
    y = model.apply(v, *args)
    return (y ** 2).sum(), y

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  out = []
  for _ in range(steps):
    (_, y), grads = step(variables)
    out.append((y, grads))
    variables = {**variables, OWG: grads[OWG]}
    if 'params' in variables:
      variables['params'] = jax.tree_util.tree_map(
          lambda p, g: p - 0.1 * g, variables['params'], grads['params'])
  return out


OPS = ['Fp8DotGeneral', 'Fp8DirectDotGeneralOp', 'Fp8DotGeneralOp',
       'NANOOFp8DotGeneralOp']


@pytest.mark.parametrize('op', OPS)
def test_dot_general_ops(op):
  x, k = rand(0, (4, 8), 3.0), rand(1, (8, 5))
  results = []
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    for nn in (fnn, lnn):
      model = getattr(nn, op)(amax_history_length=3)
      variables = model.init(jax.random.key(0), x, k, DIMS)
      results.append((variables, train_steps(model, variables, (x, k, DIMS))))
  assert_identical(results[0][0], results[1][0])
  assert set(results[1][0]) == {OWG}
  assert_identical(results[0][1], results[1][1])
  # The updates really moved: the history now holds the amaxes.
  history = results[1][1][-1][1][OWG]['input_amax_history']
  assert float(history[0]) == pytest.approx(float(jnp.abs(x).max()))


@pytest.mark.parametrize('op', ['Fp8DotGeneral', 'Fp8DotGeneralOp'])
def test_dense_with_fp8_dot_general_cls(op):
  x = rand(2, (3, 6), 2.0)
  results = []
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)
    for nn in (fnn, lnn):
      model = nn.Dense(4, dot_general_cls=getattr(nn, op))
      variables = model.init(jax.random.key(0), x)
      results.append((variables, train_steps(model, variables, (x,))))
  assert_identical(results[0][0], results[1][0])
  assert_identical(results[0][1], results[1][1])


def test_einsum():
  x, k = rand(3, (2, 3, 4), 5.0), rand(4, (4, 5))
  args = ('abc,cd->abd', x, k)
  results = []
  for nn in (fnn, lnn):
    model = nn.Fp8Einsum(amax_history_length=2)
    variables = model.init(jax.random.key(0), *args)
    results.append((variables, train_steps(model, variables, args)))
  assert_identical(results[0][0], results[1][0])
  assert_identical(results[0][1], results[1][1])


def test_functions_match():
  x = rand(5, (6,), 50.0)
  scale = jnp.array([2.0])
  history = jnp.array([0.0, 300.0, 10.0])
  for name in ('qdq', 'quantize'):
    assert_identical(getattr(ffp8, name)(x, jnp.float8_e4m3fn, scale,
                                         jnp.float32),
                     getattr(lfp8, name)(x, jnp.float8_e4m3fn, scale,
                                         jnp.float32))
  assert_identical(ffp8.update_fp8_meta(x, jnp.float8_e5m2, scale, history),
                   lfp8.update_fp8_meta(x, jnp.float8_e5m2, scale, history))
  assert_identical(
      ffp8.compute_scale(jnp.array(0.0), scale, 448.0, margin=1),
      lfp8.compute_scale(jnp.array(0.0), scale, 448.0, margin=1))
  for fn in ('in_qdq', 'out_qdq'):
    def f(mod, x=x):
      return jax.value_and_grad(
          lambda *a: getattr(mod, fn)(jnp.float32, jnp.float8_e4m3fn,
                                      *a).sum(),
          argnums=(0, 1, 2))(x, scale, history)
    assert_identical(f(ffp8), f(lfp8))
  y = rand(6, (6, 3))
  g = rand(7, (3,), 100.0)
  dims = (((0,), (0,)), ((), ()))
  kw = dict(dimension_numbers=dims, precision=None,
            preferred_element_type=jnp.float32)
  assert_identical(ffp8.dot_general_transpose_rhs(g, x, y, **kw),
                   lfp8.dot_general_transpose_rhs(g, x, y, **kw))


def test_fp8_meta_dtype_accumulates_by_max():
  assert repr(lfp8.fm32) == repr(ffp8.fm32) == 'fp8_meta32'
  a = jax.lax.convert_element_type(jnp.array([1.0, 5.0]), lfp8.fm32)
  b = jax.lax.convert_element_type(jnp.array([3.0, 2.0]), lfp8.fm32)
  total = jax.lax.convert_element_type(
      jax.jit(lambda a, b: lfp8.Fp8MetaTyRules.add(lfp8.fm32, a, b))(a, b),
      jnp.float32)
  np.testing.assert_array_equal(total, [3.0, 5.0])


def test_deprecation_warning():
  for nn in (fnn, lnn):
    with pytest.warns(DeprecationWarning, match='Fp8DotGeneralOp is deprec'):
      nn.Fp8DotGeneralOp()


