"""Differential tests of liftmods' normalization, dropout and Sequential
layers against flax.linen (the oracle).

Each model is written once as ``build(nn)`` and built twice: with
``nn = flax.linen`` and with a liftmods namespace (``LM`` below, assembled
from liftmods.module and the layer modules, so that these tests do not
depend on what the top-level package exports yet). Variables must agree in
structure, shapes and dtypes and bit for bit; outputs and gradients too.
"""
import functools
import inspect
from types import SimpleNamespace
from typing import Callable

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treecheck
from liftmods import errors, module as lmodule
from liftmods.layers import combinators, normalization, stochastic

pytestmark = pytest.mark.usefixtures('fast_compiles')

LM = SimpleNamespace(
    Module=lmodule.Module, compact=lmodule.compact,
    BatchNorm=normalization.BatchNorm, LayerNorm=normalization.LayerNorm,
    RMSNorm=normalization.RMSNorm, GroupNorm=normalization.GroupNorm,
    InstanceNorm=normalization.InstanceNorm, Dropout=stochastic.Dropout,
    Sequential=combinators.Sequential, relu=jax.nn.relu)
BACKENDS = (fnn, LM)
LAYER_NAMES = ('BatchNorm', 'LayerNorm', 'RMSNorm', 'GroupNorm',
               'InstanceNorm', 'Dropout', 'Sequential')


def rand(seed, shape, dtype=jnp.float32):
  return treecheck.normal(seed, shape, dtype, scale=2, shift=0.5)


X4 = rand(0, (2, 3, 4, 6))
X2 = rand(1, (5, 6))
X9 = rand(2, (2, 3, 2, 1, 1, 1, 1, 1, 4))  # axes 1 and 8: set order is (8, 1)
RANDOM = jax.nn.initializers.normal(0.7)  # non-trivial scale/bias values


# -- comparison helpers --------------------------------------------------------


# Container types must match too. Outputs are compared bitwise as well: the
# layers run the same operations in the same order as Linen's.
assert_identical = functools.partial(treecheck.assert_identical,
                                     same_containers=True)


def both(build, fn):
  """``fn(build(nn))`` for flax then liftmods."""
  return [fn(build(nn)) for nn in BACKENDS]


def check_init_apply(build, *args, init_kwargs=None, apply_kwargs=None,
                     seed=0):
  """Init with the same key on both sides, compare, apply, compare."""
  init_kwargs = init_kwargs or {}
  apply_kwargs = apply_kwargs if apply_kwargs is not None else init_kwargs
  theirs, ours = both(build, lambda m: m.init(jax.random.key(seed), *args,
                                              **init_kwargs))
  assert_identical(ours, theirs)
  outs = both(build, lambda m: m.apply(theirs, *args, **apply_kwargs))
  assert_identical(outs[1], outs[0])
  return theirs, outs


# -- API: names, argument order and defaults -----------------------------------


def _signature(fn):
  return [(p.name, p.kind, p.default) for p in
          inspect.signature(fn).parameters.values()
          if p.name not in ('parent', 'name', 'self')]


@pytest.mark.parametrize('name', LAYER_NAMES)
def test_same_fields_and_call_signature(name):
  ours, theirs = getattr(LM, name), getattr(fnn, name)
  ours_sig, theirs_sig = _signature(ours), _signature(theirs)
  assert [s[:2] for s in ours_sig] == [s[:2] for s in theirs_sig]
  for o, t in zip(ours_sig, theirs_sig):
    assert o[2] is t[2] or o[2] == t[2], o[0]
  ours_call = [s[:2] for s in _signature(ours.__call__)]
  assert ours_call == [s[:2] for s in _signature(theirs.__call__)]


# -- normalization layers ------------------------------------------------------


NORM_CASES = [
    ('LayerNorm', {}, X4),
    ('LayerNorm', dict(reduction_axes=(1, 2, 3)), X4),
    ('LayerNorm', dict(reduction_axes=(1, 2), feature_axes=(-2, -1)), X4),
    ('LayerNorm', dict(use_bias=False, epsilon=1e-3), X2),
    ('LayerNorm', dict(use_scale=False, use_fast_variance=False), X4),
    ('LayerNorm', dict(dtype=jnp.bfloat16), X2),
    ('LayerNorm', dict(param_dtype=jnp.bfloat16), X2.astype(jnp.bfloat16)),
    ('LayerNorm', dict(force_float32_reductions=False,
                       param_dtype=jnp.bfloat16), X2.astype(jnp.bfloat16)),
    ('LayerNorm', {}, (X2 + 1j * X2[::-1]).astype(jnp.complex64)),
    ('LayerNorm', dict(reduction_axes=(2, 3), feature_axes=(1, 8)), X9),
    ('RMSNorm', {}, X4),
    ('RMSNorm', dict(reduction_axes=(-2, -1), use_scale=False), X4),
    ('RMSNorm', dict(feature_axes=(1, 3), reduction_axes=(2, 3)), X4),
    ('RMSNorm', dict(dtype=jnp.float16), X2.astype(jnp.bfloat16)),
    ('GroupNorm', dict(num_groups=3), X4),
    ('GroupNorm', dict(num_groups=None, group_size=2), X4),
    ('GroupNorm', dict(num_groups=1, use_fast_variance=False), X2),
    ('GroupNorm', dict(num_groups=2, reduction_axes=(2, 3)), X4),
    ('GroupNorm', dict(num_groups=6, dtype=jnp.bfloat16), X4),
    ('InstanceNorm', {}, X4),
    ('InstanceNorm', dict(feature_axes=(1, -1), use_bias=False), X4),
    ('InstanceNorm', dict(param_dtype=jnp.float16), X4.astype(jnp.float16)),
]


@pytest.mark.parametrize('name,kwargs,x', NORM_CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(NORM_CASES)])
def test_norm_matches_flax(name, kwargs, x):
  inits = {'scale_init': RANDOM} if kwargs.get('use_scale', True) else {}
  if name != 'RMSNorm' and kwargs.get('use_bias', True):
    inits['bias_init'] = RANDOM
  build = lambda nn: getattr(nn, name)(**kwargs, **inits)
  check_init_apply(build, x, seed=3)


@pytest.mark.parametrize('name,kwargs', [
    ('LayerNorm', {}), ('RMSNorm', dict(use_fast_variance=False)),
    ('GroupNorm', dict(num_groups=3)), ('InstanceNorm', {}),
    ('BatchNorm', dict(use_running_average=False)),
])
def test_mask(name, kwargs):
  mask = jax.random.bernoulli(jax.random.key(5), 0.7, X4.shape)
  build = lambda nn: getattr(nn, name)(**kwargs)
  mutable = ['batch_stats'] if name == 'BatchNorm' else False
  check_init_apply(build, X4, init_kwargs=dict(mask=mask),
                   apply_kwargs=dict(mask=mask, mutable=mutable))


def test_default_variables_match_flax_doc_values():
  variables, _ = check_init_apply(lambda nn: nn.LayerNorm(), X4)
  np.testing.assert_array_equal(variables['params']['scale'], np.ones(6))
  np.testing.assert_array_equal(variables['params']['bias'], np.zeros(6))


def test_group_norm_special_cases_agree():
  """num_groups=1 is a LayerNorm over all but the batch axis; group_size=1
  is an InstanceNorm (as in Linen)."""
  variables = LM.GroupNorm(num_groups=3).init(jax.random.key(0), X4)
  y = LM.GroupNorm(num_groups=1).apply(variables, X4)
  y2 = LM.LayerNorm(reduction_axes=(1, 2, 3)).apply(variables, X4)
  np.testing.assert_allclose(y, y2, rtol=1e-5, atol=1e-6)
  y = LM.GroupNorm(num_groups=None, group_size=1).apply(variables, X4)
  y2 = LM.InstanceNorm().apply(variables, X4)
  np.testing.assert_allclose(y, y2, rtol=1e-5, atol=1e-6)


# -- BatchNorm -----------------------------------------------------------------


BN_CASES = [
    {},
    dict(axis=1, momentum=0.9, epsilon=1e-3),
    dict(axis=(1, 3)),
    dict(use_fast_variance=False, use_bias=False),
    dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
    dict(force_float32_reductions=False, param_dtype=jnp.bfloat16),
]


@pytest.mark.parametrize('kwargs', BN_CASES)
def test_batch_norm_train_and_eval_match_flax(kwargs):
  build = lambda nn: nn.BatchNorm(scale_init=RANDOM, bias_init=RANDOM,
                                  **kwargs)
  train = dict(use_running_average=False)
  variables, _ = check_init_apply(build, X4, init_kwargs=train, apply_kwargs={
      **train, 'mutable': ['batch_stats']})
  assert set(variables['batch_stats']) == {'mean', 'var'}
  (y_t, new_t), (y_o, new_o) = both(build, lambda m: m.apply(
      variables, X4 * 3 - 1, mutable=['batch_stats'], **train))
  assert_identical(y_o, y_t)
  assert_identical(new_o, new_t)
  assert not np.array_equal(new_t['batch_stats']['mean'],
                            variables['batch_stats']['mean'])
  updated = {**variables, **new_t}
  outs = both(build, lambda m: m.apply(updated, X4, use_running_average=True))
  assert_identical(outs[1], outs[0])


def test_batch_norm_constructor_flag_and_init_leaves_stats():
  build = lambda nn: nn.BatchNorm(use_running_average=True)
  variables, _ = check_init_apply(build, X2)
  np.testing.assert_array_equal(variables['batch_stats']['var'], np.ones(6))
  build = lambda nn: nn.BatchNorm(use_running_average=False)
  variables, _ = check_init_apply(build, X2, apply_kwargs=dict(
      mutable=['batch_stats']))
  np.testing.assert_array_equal(variables['batch_stats']['mean'], np.zeros(6))


def _bn_mapped(nn, x, groups, transform):
  bn = nn.BatchNorm(use_running_average=False, axis_name='batch',
                    axis_index_groups=groups, momentum=0.8)
  variables = bn.init(jax.random.key(0), x[0])  # no named axis during init
  fn = lambda xi: bn.apply(variables, xi, mutable=['batch_stats'])
  return transform(fn, axis_name='batch')(x)


def test_batch_norm_vmap_axis_name_matches_flax():
  x = rand(7, (4, 3, 6))  # 4 members of the named axis, 3 examples each
  theirs, ours = both(lambda nn: _bn_mapped(nn, x, None, jax.vmap),
                      lambda out: out)
  assert_identical(ours, theirs)
  means = ours[1]['batch_stats']['mean']
  # every member saw the statistics of all 12 examples
  np.testing.assert_allclose(means[0], means[3], rtol=1e-6)
  expected = 0.2 * x.reshape(12, 6).mean(0)
  np.testing.assert_allclose(means[0], expected, rtol=1e-5, atol=1e-6)


def test_batch_norm_axis_index_groups_matches_flax():
  # vmap rejects groups (in flax too); a one-device pmap accepts [[0]].
  x = rand(8, (4, 3, 6))
  for nn in BACKENDS:
    with pytest.raises(NotImplementedError):
      _bn_mapped(nn, x, [[0, 1], [2, 3]], jax.vmap)
  theirs, ours = both(lambda nn: _bn_mapped(nn, x[:1], [[0]], jax.pmap),
                      lambda out: out)
  assert_identical(ours, theirs)


def test_batch_norm_jit_and_grad_match_flax():
  def loss_and_grads(nn):
    bn = nn.BatchNorm(use_running_average=False, scale_init=RANDOM)
    variables = bn.init(jax.random.key(0), X2)

    def loss(params):
      y, _ = bn.apply({**variables, 'params': params}, X2,
                      mutable=['batch_stats'])
      return jnp.sum(y ** 3)
    return jax.jit(jax.value_and_grad(loss))(variables['params'])

  theirs, ours = loss_and_grads(fnn), loss_and_grads(LM)
  assert_identical(ours, theirs)


# -- Dropout -------------------------------------------------------------------


DROPOUT_CASES = [
    dict(rate=0.5),
    dict(rate=0.3, broadcast_dims=(0,)),
    dict(rate=0.25, broadcast_dims=(-1, 1)),
    dict(rate=0.0),
    dict(rate=1.0),
    dict(rate=0.5, rng_collection='noise'),
]


@pytest.mark.parametrize('kwargs', DROPOUT_CASES)
def test_dropout_bit_identical_to_flax(kwargs):
  col = kwargs.get('rng_collection', 'dropout')
  rngs = {col: jax.random.key(11)}
  outs = both(lambda nn: nn.Dropout(**kwargs), lambda m: m.apply(
      {}, X4, deterministic=False, rngs=rngs))
  assert_identical(outs[1], outs[0])


def test_dropout_explicit_rng_and_constructor_flag():
  key = jax.random.key(4)
  outs = both(lambda nn: nn.Dropout(0.4, deterministic=False),
              lambda m: m.apply({}, X2, rng=key))
  assert_identical(outs[1], outs[0])
  assert_identical(outs[0], fnn.Dropout(0.4).apply(
      {}, X2, deterministic=False, rng=key))


def test_dropout_deterministic_is_identity():
  assert LM.Dropout(0.5).apply({}, X2, deterministic=True) is X2
  assert LM.Dropout(0.5, deterministic=True).apply({}, X2) is X2
  assert LM.Dropout(0.0).apply({}, X2, deterministic=False) is X2


def test_dropout_falls_back_to_params_rng_like_flax():
  outs = both(lambda nn: nn.Dropout(0.5), lambda m: m.apply(
      {}, X2, deterministic=False, rngs={'params': jax.random.key(2)}))
  assert_identical(outs[1], outs[0])


# -- Sequential ----------------------------------------------------------------


def dense(nn):
  class Dense(nn.Module):
    features: int
    kernel_init: Callable = jax.nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):
      kernel = self.param('kernel', self.kernel_init,
                          (x.shape[-1], self.features))
      return x @ kernel + self.param('bias', RANDOM, (self.features,))

  return Dense


def test_sequential_top_level_matches_flax():
  def build(nn):
    d = dense(nn)
    return nn.Sequential([d(8), nn.relu, nn.LayerNorm(), d(3)])

  variables, _ = check_init_apply(build, X2)
  assert set(variables['params']) == {'layers_0', 'layers_2', 'layers_3'}


def test_sequential_inside_compact_matches_flax():
  def build(nn):
    d = dense(nn)

    class Model(nn.Module):

      @nn.compact
      def __call__(self, x, train):
        x = nn.Sequential([d(8), nn.BatchNorm(use_running_average=not train),
                           nn.relu, nn.Dropout(0.5, deterministic=not train),
                           d(2)])(x)
        return nn.Sequential([lambda y: d(4)(y)])(x)

    return Model()

  variables, _ = check_init_apply(build, X2, init_kwargs=dict(train=False))
  assert sorted(variables['params']) == ['BatchNorm_0', 'Dense_0', 'Dense_1',
                                         'Sequential_1']
  outs = both(build, lambda m: m.apply(
      variables, X2, train=True, mutable=['batch_stats'],
      rngs={'dropout': jax.random.key(9)}))
  assert_identical(outs[1], outs[0])


def test_sequential_spreads_tuples_and_dicts():
  def build(nn):
    class Pair(nn.Module):

      @nn.compact
      def __call__(self, a, b):
        return {'q': dense(nn)(3)(a), 'kv': b}

    class Join(nn.Module):

      @nn.compact
      def __call__(self, q, kv):
        return (q, nn.LayerNorm()(kv)), 7  # a tuple: spread positionally

    return nn.Sequential([Pair(), Join(), lambda t, n: t[0].sum() * n + t[1]])

  check_init_apply(build, X2, X2[::-1])


# -- gradients through a model using every layer -------------------------------


def test_gradients_match_flax():
  def grads(nn):
    d = dense(nn)

    class Net(nn.Module):

      @nn.compact
      def __call__(self, x):
        x = d(6)(x)
        x = nn.LayerNorm(scale_init=RANDOM)(x)
        x = nn.GroupNorm(num_groups=2)(x)
        x = nn.RMSNorm()(x)
        x = nn.Dropout(0.3)(x, deterministic=False)
        x = nn.BatchNorm()(x, use_running_average=False)
        return nn.InstanceNorm(use_fast_variance=False)(x.reshape(5, 3, 2))

    net = Net()
    rngs = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}
    variables = jax.jit(net.init)(rngs, X2)

    def loss(params):
      y, _ = net.apply({**variables, 'params': params}, X2,
                       rngs={'dropout': jax.random.key(2)},
                       mutable=['batch_stats'])
      return jnp.sum(jnp.sin(y))

    # jitted: eagerly, every primitive of the backward pass compiles alone
    return variables, jax.jit(jax.value_and_grad(loss))(variables['params'])

  (v_t, g_t), (v_o, g_o) = grads(fnn), grads(LM)
  assert_identical(v_o, v_t)
  assert_identical(g_o, g_t)


# -- errors --------------------------------------------------------------------


def _wrapped(layer_fn):
  """A model that runs ``layer_fn(x)`` inside submodule ``Outer/Block``."""

  class Block(LM.Module):

    @LM.compact
    def __call__(self, x):
      return layer_fn(x)

  class Outer(LM.Module):

    @LM.compact
    def __call__(self, x):
      return Block(name='Block')(x)

  return Outer()


def test_batch_norm_without_use_running_average():
  model = _wrapped(lambda x: LM.BatchNorm()(x))
  with pytest.raises(ValueError, match='use_running_average') as e:
    model.init(jax.random.key(0), X2)
  assert 'BatchNorm at /Block/BatchNorm_0' in str(e.value)
  with pytest.raises(ValueError, match='passed to the constructor and at'):
    LM.BatchNorm(use_running_average=True).init(
        jax.random.key(0), X2, use_running_average=False)


def test_batch_norm_eval_without_stats():
  bn = LM.BatchNorm(use_running_average=True)
  variables = bn.init(jax.random.key(0), X2)
  with pytest.raises(errors.ScopeCollectionNotFound, match='batch_stats'):
    bn.apply({'params': variables['params']}, X2)


@pytest.mark.parametrize('kwargs,exc,words', [
    (dict(num_groups=4), ValueError, ['(4)', '(6)', 'divide']),
    (dict(num_groups=0), ValueError, ['positive']),
    (dict(num_groups=None, group_size=4), ValueError, ['group size (4)']),
    (dict(num_groups=None), ValueError, ['Either `num_groups` or']),
    (dict(num_groups=2, group_size=3), ValueError, ['Either `num_groups` or']),
    (dict(num_groups=2.0), TypeError, ['must be an int']),
    (dict(num_groups=2, reduction_axes=(1, 2)), ValueError,
     ['must include the final dimension']),
])
def test_group_norm_errors(kwargs, exc, words):
  model = _wrapped(lambda x: LM.GroupNorm(**kwargs)(x))
  with pytest.raises(exc) as e:
    model.init(jax.random.key(0), X4)
  assert 'GroupNorm at /Block/GroupNorm_0' in str(e.value)
  for w in words:
    assert w in str(e.value)


def test_instance_norm_batch_axis_error():
  model = _wrapped(lambda x: LM.InstanceNorm(feature_axes=(0, -1))(x))
  with pytest.raises(ValueError, match='batch') as e:
    model.init(jax.random.key(0), X4)
  assert 'InstanceNorm at /Block/InstanceNorm_0' in str(e.value)


def test_dropout_errors():
  model = _wrapped(lambda x: LM.Dropout(0.5)(x, deterministic=False))
  with pytest.raises(errors.InvalidRngError) as e:
    model.apply({}, X2)
  msg = str(e.value)
  assert '/Block/Dropout_0' in msg and '"dropout"' in msg
  assert 'deterministic=True' in msg
  model = _wrapped(lambda x: LM.Dropout(0.5)(x))
  with pytest.raises(ValueError, match='deterministic') as e:
    model.apply({}, X2)
  assert 'Dropout at /Block/Dropout_0' in str(e.value)


def test_sequential_errors():
  with pytest.raises(ValueError, match="'layers' must be a sequence"):
    LM.Sequential(jnp.tanh)
  with pytest.raises(ValueError, match='no layers') as e:
    _wrapped(lambda x: LM.Sequential([])(x)).init(jax.random.key(0), X2)
  assert '/Block/Sequential_0' in str(e.value)


# -- docstrings ----------------------------------------------------------------


