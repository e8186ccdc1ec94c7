"""nn.scan: variable axes, broadcast and carry, rng splitting, reverse/unroll,
lengths.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lifted_check import ATOL, RTOL
from lifted_check import BACKENDS, C0, XS, block, dropout_block, check, shapes
import liftmods as lnn
from treecheck import assert_close

pytestmark = pytest.mark.usefixtures('fast_compiles')


def test_scan_variable_axes_split():
  def build(nn):
    return nn.scan(block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True})()

  r = check(build, (C0, XS), jit_later_seeds=True, eager_apply=True)
  k = np.asarray(r['vars'][lnn]['params']['Dense_0']['kernel'])
  assert k.shape == (4, 5, 3)
  assert not np.array_equal(k[0], k[1])


def test_scan_variable_broadcast():
  def build(nn):
    return nn.scan(block(nn), variable_broadcast='params',
                   split_rngs={'params': False})()

  r = check(build, (C0, XS))
  assert shapes(r['vars'][lnn]['params'])['Dense_0']['kernel'] == (5, 3)


def test_scan_variable_carry_counter():
  """A counter collection carried through the iterations (it must exist
  before the loop, so the parent creates it and scans a function of
  itself)."""
  def build(nn):
    class Counted(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        self.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))
        self.variable('counter', 'acc', lambda: jnp.zeros((2, 3)))

        def body(mdl, c, x):
          n = mdl.variable('counter', 'n')
          acc = mdl.variable('counter', 'acc')
          n.value += 1
          h = nn.Dense(3, name='dense')(x) + c
          acc.value = acc.value + h
          return h, acc.value

        return nn.scan(body, variable_axes={'params': 0},
                       variable_carry='counter',
                       split_rngs={'params': True})(self, c, xs)
    return Counted()

  r = check(build, (C0, XS), mutable=['counter'])
  v = r['vars'][lnn]
  assert int(v['counter']['n']) == 4
  assert shapes(v['params'])['dense']['kernel'] == (4, 2, 3)
  (_, ys), upd = r['out'][lnn]
  assert int(upd['counter']['n']) == 8
  assert_close(upd, r['out'][fnn][1], rtol=RTOL, atol=ATOL,
               what='counter after apply')
  np.testing.assert_allclose(upd['counter']['acc'], ys[-1], rtol=RTOL,
                             atol=ATOL)
  # apply again, continuing from the carried counter
  for nn in BACKENDS:
    again = build(nn).apply({**r['vars'][nn], **r['out'][nn][1]}, C0, XS,
                            mutable=['counter'])[1]
    assert int(again['counter']['n']) == 12


def test_scan_variable_carry_class_form():
  """Class form: the carried collection is created by the scanned module's
  own init-time logic outside the loop via a non-scanned warm-up call."""
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c, x):
        n = self.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))
        n.value += 1
        return c * 0.5 + x.sum(), n.value

    class Model(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        S = nn.scan(Step, variable_carry='counter', split_rngs={})
        step = S(name='step')
        return step(c, xs)
    return Model()

  c = jnp.zeros((2,))
  xs = jnp.ones((3, 2))
  init_counter = {'n': jnp.zeros((), jnp.int32)}
  for nn in BACKENDS:
    m = build(nn)
    (c1, ns), upd = m.apply({'counter': {'step': init_counter}}, c, xs,
                            mutable=['counter'])
    np.testing.assert_array_equal(ns, [1, 2, 3])
    assert int(upd['counter']['step']['n']) == 3


@pytest.mark.parametrize('split_dropout', [True, False])
def test_scan_split_rngs_dropout(split_dropout):
  def build(nn):
    return nn.scan(dropout_block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True, 'dropout': split_dropout})()

  r = check(build, (C0, XS), rng_names=('dropout',))
  _, ys = r['out'][lnn]
  masks = np.asarray(ys) == 0
  assert masks.any()
  # with split dropout rngs the masks differ between iterations
  same = all(np.array_equal(masks[0], masks[i]) for i in range(1, 4))
  assert same != split_dropout


@pytest.mark.parametrize('reverse,unroll', [(True, 1), (False, 2),
                                            (True, 2)])
def test_scan_reverse_unroll(reverse, unroll):
  def build(nn):
    return nn.scan(block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True}, reverse=reverse,
                   unroll=unroll)()

  check(build, (C0, XS))


def test_scan_reverse_reverses_order():
  for nn in BACKENDS:
    fwd = nn.scan(block(nn), variable_broadcast='params',
                  split_rngs={'params': False})()
    bwd = nn.scan(block(nn), variable_broadcast='params',
                  split_rngs={'params': False}, reverse=True)()
    v = fwd.init(jax.random.key(0), C0, XS)
    c_f, ys_f = fwd.apply(v, C0, XS[::-1])
    c_b, ys_b = bwd.apply(v, C0, XS)
    np.testing.assert_allclose(c_f, c_b, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ys_f[::-1], ys_b, rtol=RTOL, atol=ATOL)


def test_scan_length_without_xs():
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c):
        c = nn.tanh(nn.Dense(3)(c))
        return c, c.sum(-1)

    return nn.scan(Step, variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3)()

  r = check(build, (C0,))
  c, ys = r['out'][lnn]
  assert ys.shape == (3, 2)
  assert shapes(r['vars'][lnn]['params'])['Dense_0']['kernel'] == (3, 3, 3)


def test_scan_broadcast_in_axes_and_out_axes():
  def build(nn):
    class Ctx(nn.Module):
      @nn.compact
      def __call__(self, c, x, ctx):
        h = nn.Dense(3)(x) + nn.Dense(3, use_bias=False)(ctx) + c
        return nn.tanh(h), h

    return nn.scan(Ctx, variable_broadcast='params',
                   split_rngs={'params': False},
                   in_axes=(1, nn.broadcast), out_axes=2)()

  xs = jax.random.normal(jax.random.key(3), (2, 5, 2))  # time on axis 1
  ctx = jax.random.normal(jax.random.key(4), (2, 4))
  r = check(build, (C0, xs, ctx))
  c, ys = r['out'][lnn]
  assert ys.shape == (2, 3, 5)


def test_scan_lstm_over_time():
  """The classic Linen RNN: a scanned LSTMCell with broadcast params."""
  def build(nn):
    class RNN(nn.Module):
      hidden: int = 4

      @nn.compact
      def __call__(self, xs):
        cell = nn.scan(nn.LSTMCell, variable_broadcast='params',
                       split_rngs={'params': False}, in_axes=1,
                       out_axes=1)(self.hidden, name='lstm')
        carry = cell.initialize_carry(jax.random.key(0), xs[:, 0].shape)
        carry, ys = cell(carry, xs)
        return nn.Dense(2)(ys), carry

    return RNN()

  xs = jax.random.normal(jax.random.key(5), (2, 6, 3))
  r = check(build, (xs,))
  p = shapes(r['vars'][lnn]['params'])
  assert set(p['lstm']) == {'ii', 'if', 'ig', 'io', 'hi', 'hf', 'hg', 'ho'}
  assert r['out'][lnn][0].shape == (2, 6, 2)


def test_scan_stack_of_layers_with_layernorm():
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        y = nn.LayerNorm()(x)
        y = nn.Dense(4)(y)
        return x + nn.gelu(y), None

    class Stack(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = nn.scan(Layer, variable_axes={'params': 0},
                       split_rngs={'params': True}, length=3)(
                           name='layers')(x, None)
        return x
    return Stack()

  x = jax.random.normal(jax.random.key(6), (2, 4))
  r = check(build, (x,))
  assert shapes(r['vars'][lnn])['params']['layers']['LayerNorm_0'][
      'scale'] == (3, 4)


def test_scan_without_constancy_check():
  """``check_constancy_invariants=False`` reaches the loop: a scan with no
  broadcast output runs as with the check (same values as Linen)."""
  def build(nn):
    return nn.scan(block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True},
                   check_constancy_invariants=False)()

  check(build, (C0, XS))


def _broadcast_scan(nn, check):
  return nn.scan(block(nn), variable_broadcast='params',
                 split_rngs={'params': False},
                 check_constancy_invariants=check)()


def test_scan_without_constancy_check_refuses_to_drop_broadcast_variables():
  """Without the check, a broadcast variable created in the loop has no
  loop-invariant value to return: Linen's init silently returns no params
  (and apply then fails); liftmods refuses at init, naming the variable.
  Variables created with the check on serve a scan without it, as in
  Linen."""
  key = jax.random.key(0)
  assert fnn.unbox(_broadcast_scan(fnn, False).init(key, C0, XS)) == {}
  with pytest.raises(lnn.errors.BroadcastVariableError,
                     match=r'broadcast variable "Dense_0/(bias|kernel)" of '
                           r'collection "params" is created inside the loop'):
    _broadcast_scan(lnn, False).init(key, C0, XS)
  variables = _broadcast_scan(lnn, True).init(key, C0, XS)
  for nn in (fnn, lnn):
    assert_close(_broadcast_scan(nn, False).apply(variables, C0, XS),
                 _broadcast_scan(nn, True).apply(variables, C0, XS),
                 rtol=0, atol=0)
