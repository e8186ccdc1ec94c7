"""Patterns from real code that mix the transforms with sow, BatchNorm, rngs
and Module fields.

Part of the differential tests of the lifted transforms (see
``lifted_check.py`` for what every ``check`` asserts).
"""
import functools

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lifted_check import ATOL, RTOL
from lifted_check import (BACKENDS, C0, X4, XS, autoencoder, block,
                          dropout_block, mlp, rng_dict, check, shapes)
import liftmods as lnn
from treecheck import assert_close, assert_identical

pytestmark = pytest.mark.usefixtures('fast_compiles')


def test_auto_names_of_transformed_classes():
  """Unnamed instances of transformed classes get Linen's auto names
  (``VmapDense_0``, ``CheckpointDense_0``, ``Map_variablesDense_0``...)."""
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + nn.tanh(nn.Dense(3)(x))

    class ScanLayer(nn.Module):
      @nn.compact
      def __call__(self, c, x):
        return Layer()(c), None

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.vmap(nn.Dense, variable_axes={'params': 0},
                    split_rngs={'params': True})(3)(x)
        x = nn.jit(nn.Dense)(3)(x)
        x = nn.remat(nn.Dense)(3)(x)
        x = nn.checkpoint(Layer)()(x)
        x = nn.map_variables(nn.Dense, 'params', init=True)(3)(x)
        x = nn.remat_scan(Layer, lengths=(2,))()(x)
        x, _ = nn.scan(ScanLayer, variable_axes={'params': 0},
                       split_rngs={'params': True}, length=2)()(x, None)
        return x
    return Model()

  r = check(build, (X4,))
  assert set(r['vars'][fnn]['params']) == set(r['vars'][lnn]['params'])
  assert {'VmapDense_0', 'JitDense_0', 'CheckpointDense_0',
          'CheckpointLayer_0', 'ScanScanLayer_0'} <= set(
              r['vars'][lnn]['params'])


def test_scan_sow_intermediates():
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        y = nn.tanh(nn.Dense(3)(x))
        self.sow('intermediates', 'act', y)
        return x + y, None

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = nn.scan(Layer, variable_axes={'params': 0,
                                             'intermediates': 0},
                       split_rngs={'params': True}, length=3)(
                           name='layers')(x, None)
        return x
    return Model()

  x = jax.random.normal(jax.random.key(2), (2, 3))
  r = check(build, (x,), mutable=['intermediates'])
  y, inter = r['out'][lnn]
  act = inter['intermediates']['layers']['act']
  assert isinstance(act, tuple) and act[0].shape == (3, 2, 3)


def test_vmap_capture_intermediates():
  def build(nn):
    return nn.vmap(mlp(nn), variable_axes={'params': 0,
                                            'intermediates': 0},
                   split_rngs={'params': True})(2)

  check(build, (X4,), mutable=['intermediates'],
        apply_kwargs={'capture_intermediates': True})


def test_jit_batchnorm_mutable_stats():
  def build(nn):
    class Net(nn.Module):
      train: bool = True

      @nn.jit
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(3)(x)
        return nn.BatchNorm(use_running_average=not self.train,
                            momentum=0.5)(x)
    return Net()

  r = check(build, (X4,), mutable=['batch_stats'])
  _, upd = r['out'][lnn]
  assert not np.allclose(upd['batch_stats']['BatchNorm_0']['mean'], 0.0)
  # eval mode reads the stats
  for nn in BACKENDS:
    y = build(nn).clone(train=False).apply(
        {**r['vars'][nn], **r['out'][nn][1]}, X4)
    y_ref = build(fnn).clone(train=False).apply(
        {**r['vars'][fnn], **r['out'][fnn][1]}, X4)
    np.testing.assert_allclose(y, y_ref, rtol=RTOL, atol=ATOL)


def test_jit_cache_distinguishes_module_fields():
  """Two instances of one jitted class that differ only in a non-shape
  field must not share a compiled function."""
  def build(nn):
    class Scale(nn.Module):
      factor: float

      @nn.compact
      def __call__(self, x):
        return nn.Dense(3)(x) * self.factor

    JScale = nn.jit(Scale)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return JScale(2.0)(x), JScale(-3.0)(x)
    return Model()

  r = check(build, (X4,))
  a, b = r['out'][lnn]
  assert not np.allclose(a, b)


def test_jit_method_other_than_call():
  def build(nn):
    JAE = nn.jit(autoencoder(nn), methods=['encode', 'decode'])

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        ae = JAE()
        return ae.decode(ae.encode(x))
    return Model()

  check(build, (X4,))


def test_scan_rng_not_in_split_rngs():
  """Dropout inside a scan whose split_rngs only lists 'params': Flax and
  liftmods agree (same values, or both raise the same kind of error)."""
  def build(nn):
    return nn.scan(dropout_block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True})()

  outcome = {}
  for nn in BACKENDS:
    try:
      v = build(nn).init(rng_dict(0, ('dropout',)), C0, XS)
      outcome[nn] = ('ok', build(nn).apply(
          v, C0, XS, rngs={'dropout': jax.random.key(3)}))
    except Exception as e:  # pylint: disable=broad-except
      outcome[nn] = ('error', e)
  assert outcome[lnn][0] == outcome[fnn][0], outcome
  if outcome[fnn][0] == 'ok':
    assert_close(outcome[lnn][1], outcome[fnn][1], rtol=RTOL, atol=ATOL,
                 what='apply')


def test_transformed_instance_called_twice_shares_params():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        vd = nn.vmap(nn.Dense, variable_axes={'params': 0},
                     split_rngs={'params': True})(3)
        jd = nn.jit(nn.Dense)(3)
        y = vd(x)
        y = vd(y)
        return jd(jd(y))
    return Model()

  check(build, (X4,))


def test_jit_inside_scan_body():
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c, x):
        h = nn.jit(nn.Dense)(3)(x) + c
        return nn.tanh(h), h
    return nn.scan(Step, variable_axes={'params': 0},
                   split_rngs={'params': True})()

  check(build, (C0, XS))


def test_cond_inside_scan():
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c, x):
        d = nn.Dense(3, name='d')
        if self.is_initializing():
          d(c)  # create the params outside the branches

        def pos(mdl, c):
          return nn.tanh(d(c))

        def neg(mdl, c):
          return -nn.tanh(d(c))
        c = nn.cond(x.sum() > 0, pos, neg, self, c)
        return c, c.sum()
    return nn.scan(Step, variable_broadcast='params',
                   split_rngs={'params': False})()

  xs = jax.random.normal(jax.random.key(9), (5, 1))
  check(build, (C0, xs))


def test_while_loop_split_rngs_dropout():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        self.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))

        def cond_fn(mdl, c):
          return mdl.variables['counter']['n'] < 3

        def body_fn(mdl, c):
          mdl.variable('counter', 'n').value += 1
          return nn.Dropout(0.5, deterministic=False)(c) + 1.0
        return nn.while_loop(cond_fn, body_fn, self, x,
                             carry_variables='counter',
                             split_rngs={'dropout': True})
    return Model()

  x = jnp.ones((3, 4))
  r = check(build, (x,), mutable=['counter'], rng_names=('dropout',),
            grads=False)
  for a, b in zip(jax.tree_util.tree_leaves(r['out'][lnn]),
                  jax.tree_util.tree_leaves(r['out'][fnn])):
    np.testing.assert_array_equal(a, b)


def test_jit_static_argnames():
  def build(nn):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, *, act: str = 'relu'):
        h = nn.Dense(3)(x)
        return nn.relu(h) if act == 'relu' else jnp.cos(h)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        b = nn.jit(Block, static_argnames=('act',))()
        return b(x, act='relu') + b(x, act='cos')
    return Model()

  check(build, (X4,))


def test_map_variables_batch_stats_mutable():
  def build(nn):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.BatchNorm(use_running_average=False, momentum=0.5)(x)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        M = nn.map_variables(
            Net, 'batch_stats',
            trans_in_fn=lambda v: jax.tree_util.tree_map(lambda a: a * 2.0,
                                                         v),
            trans_out_fn=lambda v: jax.tree_util.tree_map(lambda a: a / 2.0,
                                                          v),
            init=True, mutable=True)
        return M(name='bn')(nn.Dense(3)(x))
    return Model()

  check(build, (X4,), mutable=['batch_stats'])


def test_vmap_setup_submodule_called_from_other_method():
  def build(nn):
    class Model(nn.Module):
      def setup(self):
        self.body = nn.vmap(mlp(nn), variable_axes={'params': 0},
                            split_rngs={'params': True})(2)
        self.head = nn.Dense(1)

      def features(self, x):
        return self.body(x)

      def __call__(self, x):
        return self.head(self.features(x))
    return Model()

  r = check(build, (X4,))
  feats = {nn: build(nn).apply(r['vars'][nn], X4, method='features')
           for nn in BACKENDS}
  assert_close(feats[lnn], feats[fnn], rtol=RTOL, atol=ATOL, what='features')


def test_scan_broadcast_inside_in_axes_tuple_and_out_broadcast():
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c, xc):
        x, ctx = xc
        h = nn.Dense(3)(x) + nn.Dense(3, use_bias=False)(ctx) + c
        return nn.tanh(h), (h, ctx * 2.0)

    return nn.scan(Step, variable_broadcast='params',
                   split_rngs={'params': False},
                   in_axes=((0, nn.broadcast),),
                   out_axes=(0, nn.broadcast))()

  ctx = jax.random.normal(jax.random.key(4), (2, 2))
  r = check(build, (C0, (XS, ctx)))
  _, (hs, ctx2) = r['out'][lnn]
  assert hs.shape == (4, 2, 3) and ctx2.shape == (2, 2)


def test_vmap_negative_variable_axis_and_scan_axis1():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        y = nn.vmap(nn.Dense, variable_axes={'params': -1},
                    split_rngs={'params': True})(3, name='v')(c)
        return nn.scan(block(nn), variable_axes={'params': 1},
                       split_rngs={'params': True})(name='s')(y, xs)
    return Model()

  r = check(build, (C0, XS))
  p = shapes(r['vars'][lnn]['params'])
  assert p['v']['kernel'] == (3, 3, 2)
  assert p['s']['Dense_0']['kernel'] == (5, 4, 3)


def test_remat_decorator_static_argnums():
  def build(nn):
    class Block(nn.Module):
      @functools.partial(nn.remat, static_argnums=(2,))
      @nn.compact
      def __call__(self, x, relu: bool):
        h = nn.Dense(3)(x)
        return nn.relu(h) if relu else h

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        b = Block()
        return b(x, True) + b(x, False)
    return Model()

  check(build, (X4,))


def test_map_variables_weight_norm():
  def build(nn):
    def normalize(vs):
      def f(path, w):
        if path[-1].key == 'kernel':
          return w / jnp.linalg.norm(w, axis=0, keepdims=True)
        return w
      return jax.tree_util.tree_map_with_path(f, vs)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.map_variables(mlp(nn), 'params', trans_in_fn=normalize,
                                init=True)(2, name='wn')(x)
    return Model()

  check(build, (X4,))


def test_jit_variable_argument():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        v = self.variable('state', 'count', lambda: jnp.zeros(()))

        def fn(mdl, v, x):
          v.value = v.value + 1
          return nn.Dense(2)(x) * v.value
        return nn.jit(fn)(self, v, x)
    return Model()

  r = check(build, (X4,), mutable=['state'])
  assert float(r['out'][lnn][1]['state']['count']) == 2.0


def test_remat_scan_broadcast_params():
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + nn.tanh(nn.Dense(3, name='shared')(x))

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.remat_scan(Layer, lengths=(2, 2),
                             variable_broadcast='params', variable_axes={},
                             split_rngs={'params': False})(name='rs')(x)
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  assert shapes(r['vars'][lnn])['params']['rs']['shared']['kernel'] == (3, 3)


@pytest.mark.parametrize('kind', ['scan', 'vmap', 'vmap_nosplit', 'remat',
                                  'jit', 'cond', 'map_variables'])
def test_rng_streams_bit_identical(kind):
  """Dropout masks inside a transform, and the parent's rng sequences after
  it (dropout and params), are bit-identical to Flax at init and apply."""
  def build(nn):
    Block = dropout_block(nn)

    class Parent(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        k0 = jax.random.key_data(self.make_rng('dropout'))
        if kind == 'scan':
          y = nn.scan(Block, variable_axes={'params': 0},
                      split_rngs={'params': True, 'dropout': True})()(c, xs)
        elif kind == 'vmap':
          y = nn.vmap(Block, in_axes=(None, 0), variable_axes={'params': 0},
                      split_rngs={'params': True, 'dropout': True})()(c, xs)
        elif kind == 'vmap_nosplit':
          y = nn.vmap(Block, in_axes=(None, 0),
                      variable_axes={'params': None},
                      split_rngs={'params': False, 'dropout': False})()(c, xs)
        elif kind == 'remat':
          y = nn.remat(Block)()(c, xs[0])
        elif kind == 'jit':
          y = nn.jit(Block)()(c, xs[0])
        elif kind == 'cond':
          drop = lambda m, c: nn.Dropout(0.5, deterministic=False)(c)
          y = nn.cond(True, drop, drop, self, c)
        else:
          y = nn.map_variables(Block, 'params', init=True)()(c, xs[0])
        k1 = jax.random.key_data(self.make_rng('dropout'))
        k2 = (jax.random.key_data(self.make_rng('params'))
              if self.is_initializing() else k1)
        return y, k0, k1, k2
    return Parent()

  res = {}
  for nn in BACKENDS:
    m = build(nn)
    out, v = m.init_with_output(rng_dict(0, ('dropout',)), C0, XS)
    out2 = m.apply(v, C0, XS, rngs={'dropout': jax.random.key(5)})
    res[nn] = (v, out, out2)
  assert_identical(res[lnn], res[fnn], kind)
