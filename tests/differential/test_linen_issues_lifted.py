"""Programs with lifted transforms that flax.linen rejects or gets wrong
(flax issues), run.

Each test states the flax issue, shows what flax.linen does with the program
(raises, or computes the wrong thing), and checks liftmods' result against a
reference that Linen does compute: the program written the way Linen's
documentation recommends, the same model untransformed, or the arithmetic
written out in JAX. The table of these issues is in
docs/coming-from-linen.md ("Linen issues that work in liftmods").
"""
import flax.linen as fnn
import jax
import jax.numpy as jnp
import pytest

import liftmods as lnn
from treecheck import assert_identical, normal, plain

pytestmark = pytest.mark.usefixtures('fast_compiles')

KEY = jax.random.key(0)
X = normal(0, (2, 3))


# -- flax 2200: cond / switch whose branches create different variables ------


def _heads(nn, kind, recipe=False):
  """A multi-head model: the branch picks one head; a counter counts the
  calls of the first branch. With ``recipe``, every branch first runs once
  during init, as Linen's documentation of ``switch`` says to write it."""
  class Heads(nn.Module):
    def setup(self):
      self.heads = [nn.Dense(2 + k, name=f'head{k}') for k in range(3)]
      self.calls = self.variable('counter', 'calls',
                                 lambda: jnp.zeros((), jnp.int32))

    def __call__(self, x, index):
      def first(m, x):
        m.calls.value += 1
        return m.heads[0](x).sum(-1)
      branches = [first] + [
          lambda m, x, k=k: m.heads[k](x).sum(-1) * k for k in (1, 2)]
      if kind == 'cond':
        branches = branches[:2]
      if recipe and self.is_initializing():
        for branch in branches:
          branch(self, x)
      if kind == 'cond':
        return nn.cond(index == 0, branches[0], branches[1], self, x)
      return nn.switch(index, branches, self, x)
  return Heads()


@pytest.mark.parametrize('kind', ['cond', 'switch'])
def test_2200_linen_rejects_branches_creating_different_heads(kind):
  with pytest.raises(TypeError, match='same'):
    _heads(fnn, kind).init(KEY, X, 0)


@pytest.mark.parametrize('kind', ['cond', 'switch'])
def test_2200_branches_creating_different_heads_run(kind):
  """Variables, outputs, counter updates and gradients equal Linen's for
  the program that runs every branch once during init."""
  ours, theirs = _heads(lnn, kind), _heads(fnn, kind, recipe=True)
  variables = ours.init(KEY, X, 0)
  assert_identical(variables, plain(theirs.init(KEY, X, 0)))
  assert sorted(variables['params']) == (
      ['head0', 'head1'] if kind == 'cond' else ['head0', 'head1', 'head2'])

  def loss(model, params, index):
    y, state = model.apply({**variables, 'params': params}, X, index,
                           mutable=['counter'])
    return jnp.sum(y ** 2), state

  for index in range(2 if kind == 'cond' else 3):
    assert_identical(
        jax.grad(lambda p: loss(ours, p, index), has_aux=True)(
            variables['params']),
        jax.grad(lambda p: loss(theirs, p, index), has_aux=True)(
            variables['params']))


def test_2200_branches_still_must_agree_on_shapes():
  """A variable two branches create with different shapes cannot be made
  to work: the error names it (Linen: JAX's TypeError)."""
  class Model(lnn.Module):
    @lnn.compact
    def __call__(self, x, p):
      return lnn.cond(p, lambda m, x: lnn.Dense(3, name='a')(x),
                      lambda m, x: lnn.Dense(4, name='a')(x)[:, :3], self, x)
  with pytest.raises(lnn.errors.CondBranchVariablesError, match='"a/'):
    Model().init(KEY, X, True)
