"""Regressions for what the fuzz families found in liftmods' features, each
named after what it was (the programs the shrinker printed, written out)."""
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as nn

X = jax.random.normal(jax.random.key(1), (3, 4))


def _block(lib):
  class Block(lib.Module):
    def setup(self):
      self.w1 = self.param('w1', lib.initializers.normal(0.1), (4,))

    def __call__(self, x):
      return jnp.tanh(x * self.w1)
  return Block


@pytest.mark.parametrize('mode', ['scan', 'unrolled'])
def test_stack_of_a_block_declaring_a_param_in_setup(mode):
  """pipeline family, soak seeds 1016/1032 (shrunk): nn.Stack ran the
  block's setup on its own scope too, so a parameter declared in setup
  was created once without its layer axis and init raised
  VariableAxisError ('the checkpoint has 4 layers, the stack 2')."""
  block = _block(nn)
  stack = nn.Stack(block, 2, mode=mode)()
  # Jitted: unrolled layers compiled alone round the last bit differently
  # without XLA's optimizations (docs/contributing.md, fast_compiles).
  variables = jax.jit(stack.init)(jax.random.key(0), X)

  class AsScanBody(_block(fnn)):
    def __call__(self, x):
      return super().__call__(x), None

  ref = fnn.scan(AsScanBody, variable_axes={True: 0},
                 split_rngs={True: True}, length=2)()
  want = jax.jit(ref.init)(jax.random.key(0), X)
  assert jax.tree_util.tree_map(jnp.shape, variables) == {
      'params': {'w1': (2, 4)}}
  np.testing.assert_array_equal(variables['params']['w1'],
                                want['params']['w1'])
  np.testing.assert_allclose(stack.apply(variables, X),
                             ref.apply(want, X)[0], rtol=1e-6)
