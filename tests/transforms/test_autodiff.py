"""nn.vjp, nn.jvp, nn.grad, nn.value_and_grad and nn.custom_vjp at module level.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lifted_check import ATOL, RTOL
from lifted_check import BACKENDS, X4, mlp, check
import liftmods as lnn
from treecheck import assert_identical

pytestmark = pytest.mark.usefixtures('fast_compiles')


def test_vjp_module_level():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return mdl(x)
        y, bwd = nn.vjp(f, mlp(nn)(2), x)
        params_t, x_t = bwd(jnp.ones_like(y))
        return y, params_t, x_t
    return Model()

  r = check(build, (X4,))
  y, params_t, x_t = r['out'][lnn]
  assert x_t.shape == X4.shape
  assert set(params_t['params']) == {'Dense_0', 'out'}


def test_vjp_has_aux_and_vjp_variables():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          y = mdl(x)
          return y, jnp.sum(y ** 2)
        y, bwd, aux = nn.vjp(f, mlp(nn)(2), x, has_aux=True)
        params_t, x_t = bwd(y)
        return y, aux, params_t, x_t
    return Model()

  check(build, (X4,))


def test_value_and_grad_and_grad_module_level():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return jnp.sum(mdl(x) ** 2)
        net = mlp(nn)(2)
        value, (x_grad,) = nn.value_and_grad(f, net, x)
        (x_grad2,) = nn.grad(f, net, x)
        return value, x_grad, x_grad2
    return Model()

  r = check(build, (X4,))
  value, xg, xg2 = r['out'][lnn]
  assert value.shape == ()
  assert_identical(xg, xg2)
  assert xg.shape == X4.shape


def test_value_and_grad_has_aux():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          y = mdl(x)
          return jnp.sum(y), y.mean(0)
        (value, aux), (x_grad,) = nn.value_and_grad(
            f, mlp(nn)(2), x, has_aux=True)
        (x_grad2,), aux2 = nn.grad(f, mlp(nn)(2, name='b'), x, has_aux=True)
        return value, aux, x_grad, x_grad2, aux2
    return Model()

  check(build, (X4,))


def test_jvp_module_level():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        net = mlp(nn)(2)
        y0 = net(x)  # create the params before taking tangents
        p = net.variables['params']
        t = jax.tree_util.tree_map(lambda a: jnp.full_like(a, 0.5), p)
        y, y_t = nn.jvp(lambda mdl, x: mdl(x), net, (x,),
                        (jnp.ones_like(x),), {'params': t})
        return y0, y, y_t
    return Model()

  r = check(build, (X4,))
  y0, y, y_t = r['out'][lnn]
  np.testing.assert_allclose(y0, y, rtol=RTOL, atol=ATOL)


def test_custom_vjp_sign_grad():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return mdl(x)

        def fwd(mdl, x):
          return nn.vjp(f, mdl, x)

        def bwd(vjp_fn, y_t):
          params_t, *inputs_t = vjp_fn(y_t)
          params_t = jax.tree_util.tree_map(jnp.sign, params_t)
          return (params_t, *inputs_t)

        sign_grad = nn.custom_vjp(f, forward_fn=fwd, backward_fn=bwd)
        return sign_grad(nn.Dense(1), x).sum()
    return Model()

  r = check(build, (X4,))
  for nn in BACKENDS:
    g = jax.grad(lambda p: build(nn).apply({'params': p}, X4))(
        r['vars'][nn]['params'])
    for leaf in jax.tree_util.tree_leaves(g):
      assert set(np.unique(np.asarray(leaf))) <= {-1.0, 0.0, 1.0}
