"""Differential tests: RNN, Bidirectional and flip_sequences against
flax.linen, with every recurrent cell inside them."""

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
from liftmods.layers import recurrent
from treecheck import assert_identical

pytestmark = pytest.mark.usefixtures('fast_compiles')

BOTH = pytest.mark.parametrize('nn', [fnn, lnn], ids=['flax', 'liftmods'])


def rand(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape)


def both(build, *args, rngs=None, **kwargs):
  """init + apply of ``build(nn)`` under both libraries; returns the pairs."""
  results = []
  for nn in (fnn, lnn):
    model = build(nn)
    variables = model.init(rngs or jax.random.key(0), *args, **kwargs)
    apply_rngs = ({k: v for k, v in rngs.items() if k != 'params'}
                  if isinstance(rngs, dict) else None)
    out = model.apply(variables, *args, rngs=apply_rngs, **kwargs)
    results.append((jax.tree_util.tree_map(np.asarray, dict(variables)), out))
  (v_f, o_f), (v_l, o_l) = results
  assert_identical(v_f, v_l)
  assert_identical(o_f, o_l)
  return o_l


CELLS = {
    'LSTMCell': lambda nn: nn.LSTMCell(3),
    'OptimizedLSTMCell': lambda nn: nn.OptimizedLSTMCell(3),
    'GRUCell': lambda nn: nn.GRUCell(3),
    'MGUCell': lambda nn: nn.MGUCell(3),
    'SimpleCell': lambda nn: nn.SimpleCell(3),
}


@pytest.mark.parametrize('cell', sorted(CELLS))
def test_rnn_every_cell(cell):
  x = rand(1, (2, 5, 4))
  both(lambda nn: nn.RNN(CELLS[cell](nn)), x)


def test_rnn_conv_lstm_cell():
  x = rand(1, (2, 4, 6, 2))  # batch, time, width, channels
  both(lambda nn: nn.RNN(nn.ConvLSTMCell(3, kernel_size=(3,))), x)


@pytest.mark.parametrize('reverse,keep_order', [(True, False), (True, True)])
@pytest.mark.parametrize('with_lengths', [False, True])
def test_rnn_reverse_lengths_return_carry(reverse, keep_order, with_lengths):
  x = rand(2, (3, 6, 4))
  lengths = jnp.array([6, 2, 4]) if with_lengths else None
  carry, out = both(lambda nn: nn.RNN(nn.LSTMCell(3), return_carry=True,
                                      reverse=reverse, keep_order=keep_order),
                    x, seq_lengths=lengths)
  assert out.shape == (3, 6, 3)


def test_rnn_time_major_call_overrides_and_initial_carry():
  x = rand(3, (5, 2, 4))  # time, batch, features
  carry = (rand(4, (2, 3)), rand(5, (2, 3)))
  both(lambda nn: nn.RNN(nn.LSTMCell(3), time_major=True, unroll=2), x,
       initial_carry=carry, return_carry=True)
  both(lambda nn: nn.RNN(nn.GRUCell(3)), x, time_major=True, reverse=True,
       keep_order=True, init_key=jax.random.key(9))


def test_rnn_seq_lengths_carry_is_last_valid_step():
  x = rand(6, (2, 5, 4))
  lengths = jnp.array([2, 5])
  rnn = lnn.RNN(lnn.GRUCell(3), return_carry=True)
  variables = rnn.init(jax.random.key(0), x)
  carry, _ = rnn.apply(variables, x, seq_lengths=lengths)
  short_carry, _ = rnn.apply(variables, x[:1, :2])
  np.testing.assert_allclose(carry[0], short_carry[0], rtol=1e-6)


def test_rnn_split_rngs_and_variable_axes_pass_through():
  x = rand(7, (2, 4, 3))
  rngs = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}

  def build(nn):
    class Cell(nn.Module):
      @nn.compact
      def __call__(self, carry, x):
        return nn.GRUCell(3)(carry, nn.Dropout(0.5, deterministic=False)(x))

      @nn.nowrap
      def initialize_carry(self, rng, shape):
        return nn.GRUCell(3, parent=None).initialize_carry(rng, shape)

      @property
      def num_feature_axes(self):
        return 1

    return nn.RNN(Cell(), split_rngs={'params': False, 'dropout': True})

  both(build, x, rngs=rngs)  # dropout inside the cell, split per step

  def stacked(nn):  # one set of parameters per step
    return nn.RNN(nn.SimpleCell(3), variable_axes={'params': 0},
                  variable_broadcast=False, split_rngs={'params': True})

  both(stacked, x)


def test_rnn_gradients_match():
  x = rand(8, (2, 4, 3))
  grads = []
  for nn in (fnn, lnn):
    model = nn.RNN(nn.OptimizedLSTMCell(4), reverse=True, keep_order=True)
    variables = model.init(jax.random.key(0), x)
    grads.append(jax.grad(lambda v: model.apply(v, x).sum())(variables))
  for a, b in zip(jax.tree_util.tree_leaves(grads[0]),
                  jax.tree_util.tree_leaves(grads[1])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('merge', ['concat', 'add'])
def test_bidirectional(merge):
  x = rand(9, (2, 5, 4))
  lengths = jnp.array([3, 5])

  def build(nn):
    extra = {} if merge == 'concat' else {'merge_fn': lambda a, b: a + b}
    return nn.Bidirectional(nn.RNN(nn.GRUCell(3)), nn.RNN(nn.LSTMCell(3)),
                            return_carry=True, **extra)

  carry, out = both(build, x, seq_lengths=lengths,
                    init_key=jax.random.key(3))
  assert out.shape == (2, 5, 6 if merge == 'concat' else 3)


def test_bidirectional_time_major_in_compact_parent():
  x = rand(10, (5, 2, 4))

  def build(nn):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        bi = nn.Bidirectional(nn.RNN(nn.SimpleCell(2)),
                              nn.RNN(nn.SimpleCell(2)), time_major=True)
        return nn.Dense(1)(bi(x))

    return Net()

  both(build, x)


@pytest.mark.parametrize('time_major', [False, True])
@pytest.mark.parametrize('with_lengths', [False, True])
def test_flip_sequences(time_major, with_lengths):
  x = rand(11, (6, 3, 2) if time_major else (3, 6, 2))
  lengths = jnp.array([1, 6, 4]) if with_lengths else None
  np.testing.assert_array_equal(
      fnn.recurrent.flip_sequences(x, lengths, 1, time_major),
      lnn.flip_sequences(x, lengths, 1, time_major))


def test_rnn_variable_carry_pass_through():
  def build(nn):
    class CountingCell(nn.Module):
      @nn.compact
      def __call__(self, carry, x):
        if self.has_variable('counter', 'steps'):  # made before the loop
          steps = self.variable('counter', 'steps')
          steps.value += 1
        return nn.SimpleCell(2)(carry, x)

      @nn.nowrap
      def initialize_carry(self, rng, shape):
        return nn.SimpleCell(2, parent=None).initialize_carry(rng, shape)

      @property
      def num_feature_axes(self):
        return 1

    return nn.RNN(CountingCell(), variable_carry='counter')

  x = rand(12, (2, 4, 3))
  outs = []
  for nn in (fnn, lnn):
    model = build(nn)
    variables = {**model.init(jax.random.key(0), x),
                 'counter': {'cell': {'steps': jnp.array(3, jnp.int32)}}}
    y, updated = model.apply(variables, x, mutable=['counter'])
    outs.append((dict(variables), y, dict(updated)))
  assert_identical(jax.tree_util.tree_map(np.asarray, outs[0]),
                   jax.tree_util.tree_map(np.asarray, outs[1]))
  assert int(outs[1][2]['counter']['cell']['steps']) == 3 + 4
