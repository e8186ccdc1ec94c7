"""nn.cond, nn.switch and nn.while_loop.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest

from lifted_check import X4, check
import liftmods as lnn

pytestmark = pytest.mark.usefixtures('fast_compiles')


def test_cond_both_branches_init():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x, pred):
        a = nn.Dense(3, name='a')
        b = nn.Dense(3, name='b')
        if self.is_initializing():
          a(x), b(x)

        def t(mdl, x):
          return a(x)

        def f(mdl, x):
          return -b(x) * 2
        return nn.cond(pred, t, f, self, x)
    return Model()

  cases = [(X4, True), (X4, False), (X4, jnp.array(True)),
           (X4, jnp.array(False))]
  r = check(build, (X4, True), cases)
  assert set(r['vars'][lnn]['params']) == {'a', 'b'}


def test_cond_under_jit_traced_pred():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def t(mdl, x):
          return nn.Dense(3, name='d')(x)

        def f(mdl, x):
          return nn.Dense(3, name='d')(x) * -1
        return nn.cond(x.sum() > 0, t, f, self, x)
    return Model()

  check(build, (X4,), [(X4,), (-X4,)])


def test_switch_both_branches_init():
  def build(nn):
    class Model(nn.Module):
      def setup(self):
        self.heads = [nn.Dense(2), nn.Dense(2), nn.Dense(2)]

      def __call__(self, x, i):
        if self.is_mutable_collection('params'):
          for h in self.heads:
            h(x)
        branches = [lambda m, x, k=k: m.heads[k](x) * (k + 1)
                    for k in range(3)]
        return nn.switch(i, branches, self, x)
    return Model()

  cases = [(X4, i) for i in range(3)] + [(X4, jnp.array(2))]
  r = check(build, (X4, 0), cases)
  assert set(r['vars'][lnn]['params']) == {'heads_0', 'heads_1', 'heads_2'}


def test_while_loop_carry_counter():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        self.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))
        dense = nn.Dense(3)
        if self.is_initializing():
          dense(x)

        def cond_fn(mdl, c):
          return mdl.variables['counter']['n'] < 5

        def body_fn(mdl, c):
          mdl.variable('counter', 'n').value += 1
          return nn.tanh(dense(c))
        return nn.while_loop(cond_fn, body_fn, self, x,
                             carry_variables='counter')
    return Model()

  x = jax.random.normal(jax.random.key(3), (2, 3))
  r = check(build, (x,), mutable=['counter'], grads=False)
  _, upd = r['out'][lnn]
  assert int(upd['counter']['n']) == 5
  assert int(r['out'][fnn][1]['counter']['n']) == 5
