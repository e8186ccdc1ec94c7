"""nn.checkpoint / nn.remat: static arguments, policies, remat_scan.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import jax
import pytest

from lifted_check import BACKENDS, X4, mlp, check, shapes
import liftmods as lnn

pytestmark = pytest.mark.usefixtures('fast_compiles')


def test_checkpoint_static_argnums():
  def build(nn):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, scale: float, relu: bool):
        h = nn.Dense(3)(x) * scale
        return nn.relu(h) if relu else nn.tanh(h)

    class Model(nn.Module):
      relu: bool = True

      @nn.compact
      def __call__(self, x):
        B = nn.remat(Block, static_argnums=(2, 3))
        return B()(x, 2.0, self.relu) + B()(x, 0.5, not self.relu)
    return Model()

  check(build, (X4,))
  check(lambda nn: build(nn).clone(relu=False), (X4,))


def test_checkpoint_policy_nothing_saveable():
  def build(nn):
    return nn.checkpoint(mlp(nn),
                         policy=jax.checkpoint_policies.nothing_saveable)(2)

  check(build, (X4,))


def test_checkpoint_rematerializes():
  """The jaxpr of the gradient contains a remat (checkpoint) primitive."""
  for nn in BACKENDS:
    m = nn.remat(mlp(nn))(2)
    v = m.init(jax.random.key(0), X4)
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda p: m.apply({'params': p}, X4).sum()))(v['params'])
    assert 'remat' in str(jaxpr) or 'checkpoint' in str(jaxpr)


def test_remat_scan_lengths():
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + nn.tanh(nn.Dense(3)(x))

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.remat_scan(Layer, lengths=(2, 3))(name='stack')(x)
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  assert shapes(r['vars'][lnn])['params']['stack']['Dense_0'][
      'kernel'] == (2, 3, 3, 3)
