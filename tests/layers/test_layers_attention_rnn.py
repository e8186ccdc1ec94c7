"""Differential tests: attention, recurrent cells and PReLU against flax.linen.

Every model is written once as a function of a namespace ``nn`` and built
twice: with ``flax.linen`` (the oracle) and with a liftmods namespace put
together from ``liftmods.module`` and the layer modules. Variable trees must
match in structure, shape and dtype, initial values bit for bit, outputs and
gradients to float tolerance (bitwise where the computation is identical).
"""
import dataclasses
import functools
import inspect
import types
import warnings

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treecheck
from liftmods import activation, attention_fns, errors, initializers, module
from liftmods.layers import (activation_modules, attention, linear,
                             normalization, recurrent, stochastic)

pytestmark = pytest.mark.usefixtures('fast_compiles')

SEEDS = [0, 1, 7]


def _liftmods_namespace():
  ns = types.SimpleNamespace()
  for mod in (activation, attention_fns, linear, normalization, stochastic,
              attention, recurrent, activation_modules):
    for name in dir(mod):
      if not name.startswith('_'):
        setattr(ns, name, getattr(mod, name))
  for name in ('Module', 'compact', 'nowrap', 'merge_param'):
    setattr(ns, name, getattr(module, name))
  ns.initializers = initializers
  return ns


lnn = _liftmods_namespace()
BOTH = pytest.mark.parametrize('nn', [fnn, lnn], ids=['flax', 'liftmods'])


# -- helpers -------------------------------------------------------------------


def rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def tree_sig(tree):
  """{path: (shape, dtype)} of a variable tree."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): (np.shape(x), np.asarray(x).dtype)
          for p, x in flat}


# Exact: container types must match as well (both sides give plain dicts).
assert_identical = functools.partial(treecheck.assert_identical,
                                     same_containers=True)
assert_close = functools.partial(treecheck.assert_close, same_containers=True)


def both(make):
  """``make(nn)`` built with flax.linen and with liftmods."""
  return make(fnn), make(lnn)


def check_init_apply(make, args, seeds=SEEDS, apply_kwargs=None,
                     rngs=None, bitwise_out=False):
  """Init both for each seed (bit-identical), then apply on flax's vars."""
  f_mod, l_mod = both(make)
  for seed in seeds:
    key = jax.random.key(seed)
    f_vars = f_mod.init(key, *args)
    l_vars = l_mod.init(key, *args)
    assert_identical(f_vars, l_vars)
  kw = dict(apply_kwargs or {})
  if rngs is not None:
    kw['rngs'] = rngs
  f_out = f_mod.apply(f_vars, *args, **kw)
  l_out = l_mod.apply(f_vars, *args, **kw)
  if bitwise_out:
    assert_identical(f_out, l_out)
  else:
    assert_close(f_out, l_out, rtol=1e-5, atol=1e-6)
  return f_vars, f_out


# -- signatures ----------------------------------------------------------------

PAIRS = [
    ('MultiHeadDotProductAttention', attention),
    ('MultiHeadAttention', attention),
    ('SelfAttention', attention),
    ('RNNCellBase', recurrent),
    ('LSTMCell', recurrent),
    ('OptimizedLSTMCell', recurrent),
    ('SimpleCell', recurrent),
    ('GRUCell', recurrent),
    ('MGUCell', recurrent),
    ('ConvLSTMCell', recurrent),
    ('PReLU', activation_modules),
]


def _plain_default(value):
  return value is None or isinstance(value, (bool, int, float, str, tuple))


@pytest.mark.parametrize('name,mod', PAIRS, ids=[n for n, _ in PAIRS])
def test_fields_match_linen(name, mod):
  # parent/name are compared by test_constructor_signatures_match_linen.
  fields = lambda cls: [(f.name, f.default) for f in dataclasses.fields(cls)
                        if f.name not in ('parent', 'name')]
  ours, theirs = fields(getattr(mod, name)), fields(getattr(fnn, name))
  assert [n for n, _ in ours] == [n for n, _ in theirs]
  for (n, d), (_, t) in zip(ours, theirs):
    if _plain_default(t) or isinstance(t, type):
      assert d == t, n
    elif n == 'attention_fn':
      assert d is attention_fns.dot_product_attention
    else:  # initializers and activations: compared by what they compute
      assert callable(d) == callable(t), n


@pytest.mark.parametrize('name', [n for n, _ in PAIRS])
def test_constructor_signatures_match_linen(name):
  params = lambda cls: list(inspect.signature(cls).parameters)
  assert params(getattr(lnn, name)) == params(getattr(fnn, name))


@pytest.mark.parametrize('name,method', [
    ('MultiHeadDotProductAttention', '__call__'),
    ('SelfAttention', '__call__'),
    ('LSTMCell', '__call__'), ('LSTMCell', 'initialize_carry'),
    ('OptimizedLSTMCell', '__call__'), ('GRUCell', '__call__'),
    ('MGUCell', 'initialize_carry'), ('ConvLSTMCell', 'initialize_carry'),
    ('PReLU', '__call__'),
])
def test_call_signatures_match_linen(name, method):
  ours = inspect.signature(getattr(getattr(lnn, name), method))
  theirs = inspect.signature(getattr(getattr(fnn, name), method))
  got = [(p.name, p.kind, p.default) for p in ours.parameters.values()]
  want = [(p.name, p.kind, p.default) for p in theirs.parameters.values()]
  assert got == want


def test_default_initializers_compute_the_same():
  key = jax.random.key(3)
  for name in ('LSTMCell', 'MGUCell'):
    ours, theirs = getattr(lnn, name)(4), getattr(fnn, name)(4)
    for f in dataclasses.fields(ours):
      if f.name.endswith('init'):
        assert_identical(getattr(theirs, f.name)(key, (3, 3)),
                         getattr(ours, f.name)(key, (3, 3)))


# -- multi-head attention ------------------------------------------------------

MHA_CONFIGS = {
    'default': dict(num_heads=2),
    'qkv_out': dict(num_heads=3, qkv_features=6, out_features=5),
    'no_bias': dict(num_heads=2, use_bias=False),
    'normalize_qk': dict(num_heads=2, normalize_qk=True),
    'out_inits': dict(num_heads=1, out_kernel_init=jax.nn.initializers.ones,
                      out_bias_init=jax.nn.initializers.normal(0.3),
                      bias_init=jax.nn.initializers.normal(0.2)),
    'fp32_softmax': dict(num_heads=2, force_fp32_for_softmax=True),
    'highest': dict(num_heads=2, precision=jax.lax.Precision.HIGHEST),
}


@pytest.mark.parametrize('cfg', list(MHA_CONFIGS))
def test_mha_self_attention(cfg):
  x = rand(1, (2, 3, 4))
  seeds = SEEDS if cfg == 'default' else SEEDS[1:]
  check_init_apply(
      lambda nn: nn.MultiHeadDotProductAttention(**MHA_CONFIGS[cfg]), (x,),
      seeds=seeds)


def test_mha_cross_attention_and_separate_values():
  q, k, v = rand(1, (2, 3, 4)), rand(2, (2, 5, 6)), rand(3, (2, 5, 3))
  make = lambda nn: nn.MultiHeadDotProductAttention(num_heads=2,
                                                     qkv_features=4)
  check_init_apply(make, (q, k, v))
  check_init_apply(make, (q, k))


def test_mha_dtypes():
  x = rand(1, (1, 3, 4), jnp.bfloat16)
  f_vars, f_out = check_init_apply(
      lambda nn: nn.MultiHeadDotProductAttention(
          num_heads=2, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16), (x,),
      seeds=[0])
  assert f_out.dtype == jnp.bfloat16
  assert tree_sig(f_vars)["['params']['key']['kernel']"][1] == jnp.bfloat16
  check_init_apply(lambda nn: nn.MultiHeadDotProductAttention(num_heads=2),
                   (x,), seeds=[0])


def test_mha_extra_batch_axes():
  x = rand(4, (2, 2, 3, 4))
  check_init_apply(lambda nn: nn.MultiHeadDotProductAttention(num_heads=4),
                   (x,), seeds=[5])


@pytest.mark.parametrize('kind', ['causal', 'padding', 'both'])
def test_mha_masks(kind):
  x = rand(2, (2, 4, 4))
  tokens = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
  causal = fnn.make_causal_mask(tokens)
  padding = fnn.make_attention_mask(tokens > 0, tokens > 0)
  mask = {'causal': causal, 'padding': padding,
          'both': fnn.combine_masks(causal, padding)}[kind]
  _, f_out = check_init_apply(
      lambda nn: nn.MultiHeadDotProductAttention(num_heads=2), (x,),
      seeds=[0], apply_kwargs=dict(mask=mask))
  # liftmods' own mask helpers give the same masks.
  assert_identical(causal, lnn.make_causal_mask(tokens))
  assert_identical(padding, lnn.make_attention_mask(tokens > 0, tokens > 0))


def _dropout_model(nn, **attn_kwargs):

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x, deterministic=None, dropout_rng=None):
      a = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.5,
                                          **attn_kwargs)
      b = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.3,
                                          broadcast_dropout=False,
                                          **attn_kwargs)
      return (a(x, deterministic=deterministic, dropout_rng=dropout_rng),
              b(x, deterministic=deterministic, dropout_rng=dropout_rng))

  return Model()


@pytest.mark.parametrize('seed', SEEDS)
def test_mha_dropout_rngs_bitwise(seed):
  x = rand(seed, (2, 3, 4))
  f_mod, l_mod = both(_dropout_model)
  rngs = {'params': jax.random.key(seed), 'dropout': jax.random.key(seed + 9)}
  f_vars = f_mod.init(rngs, x, deterministic=False)
  assert_identical(f_vars, l_mod.init(rngs, x, deterministic=False))
  drop = {'dropout': jax.random.key(seed + 100)}
  f_out = f_mod.apply(f_vars, x, deterministic=False, rngs=drop)
  l_out = l_mod.apply(f_vars, x, deterministic=False, rngs=drop)
  assert_identical(f_out, l_out)
  no_drop = f_mod.apply(f_vars, x, deterministic=True)
  assert not np.allclose(f_out[0], no_drop[0])


def test_mha_dropout_rng_argument_and_attribute():
  x = rand(3, (2, 3, 4))
  f_mod, l_mod = both(lambda nn: _dropout_model(nn, deterministic=False))
  f_vars = f_mod.init(jax.random.key(0), x)
  key = jax.random.key(11)
  assert_identical(f_mod.apply(f_vars, x, dropout_rng=key),
                   l_mod.apply(f_vars, x, dropout_rng=key))
  drop = {'dropout': jax.random.key(4)}
  assert_identical(f_mod.apply(f_vars, x, rngs=drop),
                   l_mod.apply(f_vars, x, rngs=drop))


def test_mha_sow_weights():
  x = rand(5, (1, 3, 4))

  def make(nn):

    class Model(nn.Module):

      @nn.compact
      def __call__(self, x):
        return nn.MultiHeadDotProductAttention(num_heads=2)(x,
                                                            sow_weights=True)

    return Model()

  f_mod, l_mod = both(make)
  f_vars = f_mod.init(jax.random.key(0), x)
  assert_identical(f_vars, l_mod.init(jax.random.key(0), x))
  f_out = f_mod.apply(f_vars, x, mutable=['intermediates'])
  l_out = l_mod.apply(f_vars, x, mutable=['intermediates'])
  assert_close(f_out, l_out, rtol=1e-5, atol=1e-6)
  assert 'attention_weights' in str(jax.tree_util.tree_structure(l_out[1]))


def test_capture_intermediates_tree_matches_linen():
  x = rand(5, (1, 3, 4))
  f_mod, l_mod = both(lambda nn: nn.MultiHeadDotProductAttention(
      num_heads=2, normalize_qk=True))
  variables = f_mod.init(jax.random.key(0), x)
  kw = dict(capture_intermediates=True, mutable=['intermediates'])
  assert_close(f_mod.apply(variables, x, **kw),
               l_mod.apply(variables, x, **kw), rtol=1e-5, atol=1e-6)


def test_mha_custom_attention_fn_gets_only_declared_kwargs():
  seen = {}

  def my_attention(query, key, value, mask=None):
    seen['mask'] = mask
    return lnn.dot_product_attention(query, key, value, mask=mask)

  x = rand(6, (1, 3, 4))
  layer = lnn.MultiHeadDotProductAttention(num_heads=2,
                                           attention_fn=my_attention)
  variables = layer.init(jax.random.key(0), x)
  assert seen == {'mask': None}
  theirs = fnn.MultiHeadDotProductAttention(num_heads=2)
  assert_close(theirs.apply(variables, x), layer.apply(variables, x),
               rtol=1e-5, atol=1e-6)


def test_mha_einsum_factories():

  def make(nn):
    return nn.MultiHeadDotProductAttention(
        num_heads=2, qk_attn_weights_einsum_cls=lambda: jnp.einsum,
        attn_weights_value_einsum_cls=lambda: jnp.einsum)

  check_init_apply(make, (rand(7, (1, 3, 4)),), seeds=[0])


def test_mha_inputs_kv_deprecated_path():
  q, kv = rand(1, (1, 2, 4)), rand(2, (1, 3, 4))
  f_mod, l_mod = both(lambda nn: nn.MultiHeadDotProductAttention(num_heads=2))
  variables = f_mod.init(jax.random.key(0), q, kv)
  with pytest.warns(DeprecationWarning, match='inputs_kv'):
    out = l_mod.apply(variables, q, inputs_kv=kv)
  assert_close(f_mod.apply(variables, q, kv), out, rtol=1e-5, atol=1e-6)


def test_mha_mask_passed_positionally_warns():
  q = rand(1, (1, 3, 4))
  layer = lnn.MultiHeadDotProductAttention(num_heads=2)
  variables = layer.init(jax.random.key(0), q)
  with pytest.warns(DeprecationWarning, match='mask='):
    with pytest.raises(ValueError, match=r'got \(1, 4\)'):
      layer.apply(variables, q, q, jnp.ones((1, 4, 4)))


def test_alias_and_self_attention_names():

  def make(nn):

    class Model(nn.Module):

      @nn.compact
      def __call__(self, x):
        with warnings.catch_warnings():
          warnings.simplefilter('ignore', DeprecationWarning)
          y = nn.SelfAttention(num_heads=2)(x)
        return nn.MultiHeadAttention(num_heads=2)(y) + \
            nn.MultiHeadDotProductAttention(num_heads=2)(x)

    return Model()

  f_vars, _ = check_init_apply(make, (rand(8, (1, 3, 4)),), seeds=[0, 1])
  assert sorted(f_vars['params']) == [
      'MultiHeadAttention_0', 'MultiHeadDotProductAttention_0',
      'SelfAttention_0']
  assert issubclass(lnn.MultiHeadAttention, lnn.MultiHeadDotProductAttention)
  with pytest.warns(DeprecationWarning, match='SelfAttention'):
    lnn.SelfAttention(num_heads=1).init(jax.random.key(0), jnp.ones((2, 3)))


def test_mha_gradients_match_linen():
  q, kv = rand(18, (2, 3, 4)), rand(19, (2, 5, 4))
  mask = fnn.make_attention_mask(jnp.ones((2, 3)), jnp.arange(5) < 4)
  f_mod, l_mod = both(lambda nn: nn.MultiHeadDotProductAttention(
      num_heads=2))
  variables = f_mod.init(jax.random.key(0), q, kv)

  def grads(mod):
    loss = lambda v, q, kv: jnp.sum(jnp.sin(mod.apply(v, q, kv, mask=mask)))
    return jax.grad(loss, argnums=(0, 1, 2))(variables, q, kv)

  assert_close(grads(f_mod), grads(l_mod), rtol=1e-5, atol=1e-5)


# -- autoregressive decoding ---------------------------------------------------


def _decoder(nn, **kw):
  return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4,
                                         decode=True, **kw)


@pytest.mark.parametrize('kw', [{}, {'normalize_qk': True}],
                         ids=['plain', 'normalize_qk'])
def test_decode_cache_steps_match_linen(kw):
  length = 4
  x = rand(9, (2, length, 3))
  f_mod, l_mod = both(lambda nn: _decoder(nn, **kw))
  f_vars = f_mod.init(jax.random.key(0), x)
  l_vars = l_mod.init(jax.random.key(0), x)
  assert_identical(f_vars, l_vars)
  assert sorted(f_vars['cache']) == ['cache_index', 'cached_key',
                                     'cached_value']
  f_cache, l_cache = f_vars['cache'], l_vars['cache']
  params = {'params': f_vars['params']}
  for t in range(length):
    step = x[:, t:t + 1]
    f_out, f_upd = f_mod.apply({**params, 'cache': f_cache}, step,
                               mutable=['cache'])
    l_out, l_upd = l_mod.apply({**params, 'cache': l_cache}, step,
                               mutable=['cache'])
    assert_close(f_out, l_out, rtol=1e-5, atol=1e-6)
    assert_close(f_upd, l_upd, rtol=1e-5, atol=1e-6)
    f_cache, l_cache = f_upd['cache'], l_upd['cache']
    assert int(l_cache['cache_index']) == t + 1
  # A full causal pass agrees with the step-by-step decode.
  full = fnn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, **kw)
  causal = fnn.make_causal_mask(jnp.ones((2, length)))
  want = full.apply(params, x, mask=causal)
  assert_close(want[:, -1:], l_out, rtol=1e-4, atol=1e-5)


def test_decode_with_extra_mask_and_jit():
  x = rand(10, (1, 3, 4))
  f_mod, l_mod = both(_decoder)
  variables = f_mod.init(jax.random.key(2), x)
  mask = jnp.ones((1, 1, 1, 3))

  def run(mod):
    step = jax.jit(lambda v, s: mod.apply(v, s, mask=mask, mutable=['cache']))
    v, outs = variables, []
    for t in range(3):
      out, upd = step(v, x[:, t:t + 1])
      v = {**v, **upd}
      outs.append(out)
    return outs, v['cache']

  assert_close(run(f_mod), run(l_mod), rtol=1e-5, atol=1e-6)


# -- errors --------------------------------------------------------------------


def _with_parent(layer_factory):

  class Outer(lnn.Module):

    @lnn.compact
    def __call__(self, *args, **kwargs):
      return layer_factory()(*args, **kwargs)

  return Outer()


def test_error_heads_not_dividing_features():
  model = _with_parent(lambda: lnn.MultiHeadDotProductAttention(
      num_heads=3, qkv_features=8, name='attn'))
  with pytest.raises(ValueError, match=r'/attn.*num_heads.*multiple of 3, '
                     r'got 8') as info:
    model.init(jax.random.key(0), jnp.ones((1, 2, 4)))
  assert isinstance(info.value, errors.LiftmodsError)
  with pytest.raises(ValueError, match=r'multiple of 3, got 4'):
    lnn.MultiHeadDotProductAttention(num_heads=3).init(
        jax.random.key(0), jnp.ones((1, 2, 4)))


def test_error_key_value_shapes_differ():
  model = _with_parent(lambda: lnn.MultiHeadDotProductAttention(
      num_heads=2, name='attn'))
  q, k, v = jnp.ones((1, 2, 4)), jnp.ones((1, 5, 4)), jnp.ones((1, 6, 4))
  with pytest.raises(ValueError, match=r'/attn.*expected inputs_v\.shape'
                     r'\[:-1\] == \(1, 5\), got \(1, 6\)'):
    model.init(jax.random.key(0), q, k, v)


def test_error_decode_without_cache():
  layer = lnn.MultiHeadDotProductAttention(num_heads=2, decode=True)
  x = jnp.ones((1, 3, 4))
  params = {'params': layer.init(jax.random.key(0), x)['params']}
  with pytest.raises(errors.ScopeCollectionNotFound,
                     match=r'At /: decode=True needs .*"cache"'):
    layer.apply(params, x[:, :1])
  model = _with_parent(lambda: lnn.MultiHeadDotProductAttention(
      num_heads=2, decode=True, name='dec'))
  params = {'params': model.init(jax.random.key(0), x)['params']}
  with pytest.raises(errors.LiftmodsError, match=r'/dec: decode=True'):
    model.apply(params, x[:, :1])


def test_error_decode_cache_not_mutable():
  layer = lnn.MultiHeadDotProductAttention(num_heads=2, decode=True)
  x = jnp.ones((1, 3, 4))
  variables = layer.init(jax.random.key(0), x)
  with pytest.raises(errors.ModifyScopeVariableError,
                     match=r'"cached_key".*mutable=\["cache"\]'):
    layer.apply(variables, x[:, :1])


def test_error_decode_step_shape():
  model = _with_parent(lambda: lnn.MultiHeadDotProductAttention(
      num_heads=2, decode=True, name='dec'))
  x = jnp.ones((2, 3, 4))
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r'expected query shape \(2, 1, 2, 2\) '
                     r'instead got \(2, 4, 2, 2\).*/dec.*cache length 3'):
    model.apply(variables, jnp.ones((2, 4, 4)), mutable=['cache'])
  with pytest.raises(ValueError, match=r'instead got \(1, 1, 2, 2\)'):
    model.apply(variables, x[:1, :1], mutable=['cache'])


def test_error_input_argument_combinations():
  layer = lnn.MultiHeadDotProductAttention(num_heads=2)
  x = jnp.ones((1, 3, 4))
  with pytest.raises(ValueError, match='inputs_kv or inputs_k/inputs_v'):
    layer.init(jax.random.key(0), x, x, inputs_kv=x)
  with pytest.raises(ValueError, match='`inputs_k` cannot be None if `inputs_v`'):
    layer.init(jax.random.key(0), x, inputs_v=x)


def test_error_dropout_needs_deterministic():
  layer = lnn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1)
  with pytest.raises(ValueError, match='deterministic'):
    layer.init(jax.random.key(0), jnp.ones((1, 3, 4)))


# -- recurrent cells -----------------------------------------------------------

CELLS = {
    'LSTMCell': dict(),
    'OptimizedLSTMCell': dict(),
    'GRUCell': dict(),
    'SimpleCell': dict(),
    'SimpleCell_residual': dict(residual=True),
    'MGUCell': dict(),
    'MGUCell_noreset': dict(reset_gate=False),
    'LSTMCell_custom': dict(gate_fn=jax.nn.hard_sigmoid,
                            activation_fn=jax.nn.relu,
                            bias_init=jax.nn.initializers.normal(0.5)),
    'GRUCell_bf16': dict(dtype=jnp.bfloat16),
}


def _cell(nn, name, features=3):
  return getattr(nn, name.split('_')[0])(features=features,
                                          **CELLS[name])


def _unroll(cell, variables, carry, xs):
  outs = []
  for t in range(xs.shape[1]):
    carry, y = cell.apply(variables, carry, xs[:, t])
    outs.append(y)
  return carry, jnp.stack(outs, 1)


@pytest.mark.parametrize('name', list(CELLS))
def test_cell_steps_match_linen(name):
  xs = rand(11, (2, 4, 5))
  f_cell, l_cell = both(lambda nn: _cell(nn, name))
  key = jax.random.key(1)
  carry = f_cell.initialize_carry(key, xs[:, 0].shape)
  assert_identical(carry, l_cell.initialize_carry(key, xs[:, 0].shape))
  for seed in SEEDS:
    f_vars = f_cell.init(jax.random.key(seed), carry, xs[:, 0])
    assert_identical(f_vars, l_cell.init(jax.random.key(seed), carry,
                                         xs[:, 0]))
  rtol = 2e-2 if 'bf16' in name else 1e-5
  assert_close(_unroll(f_cell, f_vars, carry, xs),
               _unroll(l_cell, f_vars, carry, xs), rtol=rtol, atol=rtol)


@pytest.mark.parametrize('name', ['LSTMCell', 'OptimizedLSTMCell', 'GRUCell',
                                  'MGUCell', 'SimpleCell'])
def test_cell_gradients_match_linen(name):
  xs = rand(12, (2, 3, 4))
  f_cell, l_cell = both(lambda nn: _cell(nn, name))
  carry = f_cell.initialize_carry(jax.random.key(0), xs[:, 0].shape)
  variables = f_cell.init(jax.random.key(2), carry, xs[:, 0])

  def loss(cell):
    return lambda v, x: jnp.sum(_unroll(cell, v, carry, x)[1] ** 2)

  f_grads = jax.grad(loss(f_cell), argnums=(0, 1))(variables, xs)
  l_grads = jax.grad(loss(l_cell), argnums=(0, 1))(variables, xs)
  assert_close(f_grads, l_grads, rtol=1e-5, atol=1e-5)


def test_lstm_and_optimized_lstm_share_parameters():
  x = rand(13, (2, 4))
  cell = lnn.LSTMCell(features=3)
  opt = lnn.OptimizedLSTMCell(features=3)
  carry = cell.initialize_carry(jax.random.key(0), x.shape)
  v = cell.init(jax.random.key(1), carry, x)
  assert_identical(v, opt.init(jax.random.key(1), carry, x))
  assert_close(cell.apply(v, carry, x), opt.apply(v, carry, x),
               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name', ['LSTMCell', 'OptimizedLSTMCell', 'GRUCell',
                                  'SimpleCell', 'MGUCell'])
def test_initialize_carry_with_random_init(name):
  kw = dict(carry_init=jax.nn.initializers.normal(1.0),
            param_dtype=jnp.float16)
  f_cell = getattr(fnn, name)(features=2, **kw)
  l_cell = getattr(lnn, name)(features=2, **kw)
  for shape in [(5,), (2, 5), (3, 2, 5)]:
    key = jax.random.key(len(shape))
    assert_identical(f_cell.initialize_carry(key, shape),
                     l_cell.initialize_carry(key, shape))
  assert l_cell.num_feature_axes == f_cell.num_feature_axes == 1


def test_conv_lstm_cell():
  x = rand(14, (2, 5, 5, 3))

  def make(nn):
    return nn.ConvLSTMCell(features=4, kernel_size=(3, 3))

  f_cell, l_cell = both(make)
  key = jax.random.key(3)
  carry = f_cell.initialize_carry(key, x.shape)
  assert_identical(carry, l_cell.initialize_carry(key, x.shape))
  assert l_cell.num_feature_axes == f_cell.num_feature_axes == 3
  f_vars = f_cell.init(jax.random.key(0), carry, x)
  assert_identical(f_vars, l_cell.init(jax.random.key(0), carry, x))
  assert_close(f_cell.apply(f_vars, carry, x), l_cell.apply(f_vars, carry, x),
               rtol=1e-4, atol=1e-5)


def test_cells_inside_parent_module():

  def make(nn):

    class Stack(nn.Module):

      @nn.compact
      def __call__(self, xs):
        lstm, gru = nn.LSTMCell(3), nn.GRUCell(3, name='gru')
        c1 = lstm.initialize_carry(jax.random.key(0), xs[:, 0].shape)
        c2 = gru.initialize_carry(jax.random.key(0), xs[:, 0].shape)
        ys = []
        for t in range(xs.shape[1]):
          c1, y = lstm(c1, xs[:, t])
          c2, y = gru(c2, y)
          ys.append(y)
        return jnp.stack(ys, 1)

    return Stack()

  f_vars, _ = check_init_apply(make, (rand(15, (2, 3, 4)),))
  assert sorted(f_vars['params']) == ['LSTMCell_0', 'gru']


def test_layers_assigned_in_setup():

  def make(nn):

    class Block(nn.Module):

      def setup(self):
        self.attn = nn.MultiHeadDotProductAttention(num_heads=2,
                                                    out_features=3)
        self.cell = nn.OptimizedLSTMCell(3)
        self.act = nn.PReLU(negative_slope_init=0.2)

      def __call__(self, x):
        y = self.act(self.attn(x))
        carry = self.cell.initialize_carry(jax.random.key(0), y[:, 0].shape)
        return self.cell(carry, y[:, 0])

    return Block()

  f_vars, _ = check_init_apply(make, (rand(20, (2, 3, 4)),), seeds=[0, 3])
  assert sorted(f_vars['params']) == ['act', 'attn', 'cell']


def test_rnn_cell_base_is_abstract():
  cell = lnn.RNNCellBase()
  with pytest.raises(NotImplementedError, match='RNNCellBase'):
    cell.initialize_carry(jax.random.key(0), (2, 3))
  with pytest.raises(NotImplementedError):
    cell.num_feature_axes  # pylint: disable=pointless-statement
  assert issubclass(lnn.GRUCell, lnn.RNNCellBase)


# -- PReLU ---------------------------------------------------------------------


@pytest.mark.parametrize('kw', [{}, {'negative_slope_init': 0.3},
                                {'param_dtype': jnp.bfloat16}])
def test_prelu(kw):
  x = rand(16, (3, 4))
  f_vars, _ = check_init_apply(lambda nn: nn.PReLU(**kw), (x,),
                               bitwise_out=True)
  assert tree_sig(f_vars) == {"['params']['negative_slope']": (
      (), np.dtype(kw.get('param_dtype', jnp.float32)))}


def test_prelu_gradient():
  x = rand(17, (5,))
  f, l = both(lambda nn: nn.PReLU())
  v = f.init(jax.random.key(0), x)
  grad = lambda m: jax.grad(lambda v, x: jnp.sum(m.apply(v, x) * x),
                            argnums=(0, 1))(v, x)
  assert_identical(grad(f), grad(l))
