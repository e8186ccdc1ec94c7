"""nn.map_variables.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lifted_check import ATOL, RTOL
from lifted_check import X4, check
import liftmods as lnn

pytestmark = pytest.mark.usefixtures('fast_compiles')


def test_map_variables_weight_transform_init():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        # kernel used as its sign-preserving square; also transformed on init
        SqDense = nn.map_variables(
            nn.Dense, 'params',
            trans_in_fn=lambda vs: jax.tree_util.tree_map(
                lambda w: w * jnp.abs(w), vs),
            init=True)
        return SqDense(3, name='sq')(x)
    return Model()

  r = check(build, (X4,))
  v = r['vars'][lnn]['params']['sq']
  y = X4 @ (v['kernel'] * np.abs(v['kernel'])) + v['bias'] * np.abs(
      v['bias'])
  np.testing.assert_allclose(r['out'][lnn], y, rtol=RTOL, atol=ATOL)


def test_map_variables_trans_out_and_mutable():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        Scaled = nn.map_variables(
            nn.Dense, 'params',
            trans_in_fn=lambda vs: jax.tree_util.tree_map(
                lambda w: w / 2.0, vs),
            trans_out_fn=lambda vs: jax.tree_util.tree_map(
                lambda w: w * 2.0, vs),
            init=True, mutable=True)
        return Scaled(3)(x)
    return Model()

  check(build, (X4,))
