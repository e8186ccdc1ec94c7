"""Differential tests: liftmods' pure-function Linen API against flax.linen.

flax is only the oracle here. Every comparison is bitwise where the two sides
run the same computation (which is the case for all of these functions).
"""
import functools
import inspect

import flax.linen as flax_nn
import flax.linen.activation as flax_activation
import flax.linen.attention as flax_attention
import flax.linen.dtypes as flax_dtypes
import flax.linen.initializers as flax_init
import flax.linen.pooling as flax_pooling
import flax.typing
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from liftmods import activation, attention_fns, dtypes, initializers, pooling
from treecheck import assert_identical

pytestmark = pytest.mark.usefixtures('fast_compiles')


def rand(seed, shape, dtype=jnp.float32, scale=3.0):
  """Test input from numpy's RNG (jax's samplers are slow to compile)."""
  x = np.random.default_rng(seed).standard_normal(shape) * scale
  return jnp.asarray(x.astype(np.float32), dtype)


def rand_bool(seed, shape, p=0.5):
  return jnp.asarray(np.random.default_rng(seed).random(shape) < p)


def public_names(mod):
  return {n for n in vars(mod) if not n.startswith('_')}


def assert_same_signature(ours, theirs):
  """Same parameter names, order, kinds and defaults (annotations aside)."""
  ps = list(inspect.signature(ours).parameters.values())
  ts = list(inspect.signature(theirs).parameters.values())
  assert [p.name for p in ps] == [t.name for t in ts]
  for p, t in zip(ps, ts):
    assert p.kind == t.kind, p.name
    assert p.default is t.default or p.default == t.default, p.name


# --------------------------------------------------------------------------
# initializers
# --------------------------------------------------------------------------

INIT_NAMES = sorted(
    n for n in public_names(flax_init)
    if n not in {'Initializer', 'zeros_init', 'ones_init'}
)


def test_initializer_namespace_matches_linen():
  assert public_names(initializers) == public_names(flax_init)
  assert initializers.Initializer == flax.typing.Initializer
  assert len(INIT_NAMES) == 19


@pytest.mark.parametrize('name', INIT_NAMES)
def test_initializer_is_the_same_object(name):
  assert getattr(initializers, name) is getattr(flax_init, name)
  assert getattr(initializers, name) is getattr(jax.nn.initializers, name)


def test_zeros_init_ones_init():
  assert initializers.zeros_init() is flax_init.zeros_init()
  assert initializers.ones_init() is flax_init.ones_init()
  key = jax.random.key(3)
  for dtype in [jnp.float32, jnp.int32, jnp.bfloat16]:
    assert_identical(initializers.zeros_init()(key, (2, 5), dtype),
                      flax_init.zeros_init()(key, (2, 5), dtype))
    assert_identical(initializers.ones_init()(key, (4,), dtype),
                      flax_init.ones_init()(key, (4,), dtype))
  assert_same_signature(initializers.zeros_init, flax_init.zeros_init)
  assert_same_signature(initializers.ones_init, flax_init.ones_init)


# (factory name, factory kwargs, shape)
# jax compiles its samplers per shape, rank and dtype (higher rank compiles
# slower), so the cases share two shapes to keep the file fast: DENSE is
# (in, out) and CONV a 1-d conv kernel (width 3, in 2, out 4).
DENSE, CONV = (4, 6), (3, 2, 4)
# (factory name, factory kwargs or None for a plain initializer, shape)
INIT_CASES = [
    ('zeros', None, DENSE),
    ('ones', None, CONV),
    ('constant', dict(value=0.25), DENSE),
    ('normal', dict(stddev=0.3), DENSE),
    ('uniform', dict(scale=2.0), DENSE),
    ('truncated_normal', dict(stddev=0.5, lower=-1.5, upper=1.0), DENSE),
    ('variance_scaling', dict(scale=2.0, mode='fan_avg',
                              distribution='uniform'), CONV),
    ('variance_scaling', dict(scale=1.0, mode='fan_out',
                              distribution='truncated_normal', in_axis=0,
                              out_axis=1), DENSE),
    ('variance_scaling', dict(scale=0.5, mode='fan_geo_avg',
                              distribution='normal', batch_axis=(0,)),
     CONV),
    ('lecun_normal', {}, DENSE),
    ('lecun_uniform', {}, CONV),
    ('glorot_normal', {}, DENSE),
    ('glorot_uniform', {}, DENSE),
    ('xavier_normal', {}, DENSE),
    ('xavier_uniform', {}, DENSE),
    ('he_normal', {}, DENSE),
    ('he_uniform', {}, CONV),
    ('kaiming_normal', {}, DENSE),
    ('kaiming_uniform', {}, DENSE),
    ('orthogonal', dict(scale=1.5), DENSE),
    ('orthogonal', dict(column_axis=0), DENSE),
    ('delta_orthogonal', dict(scale=0.9), CONV),
]
# Half precision for a few samplers (the QR-based orthogonal initializers
# have no half-precision LAPACK kernel on CPU).
HALF_INIT_CASES = [
    INIT_CASES[3] + (jnp.bfloat16,),    # normal
    INIT_CASES[12] + (jnp.float16,),    # glorot_uniform
    INIT_CASES[2] + (jnp.float16,),     # constant
]
INIT_MATRIX = [c + (jnp.float32,) for c in INIT_CASES] + HALF_INIT_CASES


@pytest.mark.parametrize(
    'name,kwargs,shape,dtype', INIT_MATRIX,
    ids=[f'{c[0]}{i}-{jnp.dtype(c[3]).name}'
         for i, c in enumerate(INIT_MATRIX)])
def test_initializer_values_bit_identical(name, kwargs, shape, dtype):
  ours, theirs = getattr(initializers, name), getattr(flax_init, name)
  if kwargs is not None:
    ours, theirs = ours(**kwargs), theirs(**kwargs)
  key = jax.random.key(17)
  out = ours(key, shape, dtype)
  assert out.shape == shape and out.dtype == dtype
  assert_identical(out, theirs(key, shape, dtype))


def test_initializer_keys_matter():
  """Guards against a test that compares constants: keys change outputs."""
  init = initializers.lecun_normal()
  a = init(jax.random.key(0), DENSE)
  b = init(jax.random.key(1), DENSE)
  assert not np.array_equal(a, b)
  # legacy raw uint32 keys work the same way on both sides
  raw = jax.random.PRNGKey(5)
  assert_identical(init(raw, DENSE), flax_init.lecun_normal()(raw, DENSE))


# --------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------

ACTIVATION_NAMES = sorted([
    'celu', 'elu', 'gelu', 'glu', 'hard_sigmoid', 'hard_silu', 'hard_swish',
    'hard_tanh', 'leaky_relu', 'log_sigmoid', 'log_softmax', 'logsumexp',
    'normalize', 'one_hot', 'relu6', 'relu', 'selu', 'sigmoid', 'silu',
    'soft_sign', 'softmax', 'softplus', 'standardize', 'swish', 'tanh',
])


def test_activation_name_set_matches_linen():
  exported_by_linen = {
      n for n in ACTIVATION_NAMES + ['PReLU'] if hasattr(flax_nn, n)
  }
  assert exported_by_linen == set(ACTIVATION_NAMES) | {'PReLU'}
  from_activation = {
      n for n in public_names(flax_activation)
      if getattr(flax_nn, n, None) is getattr(flax_activation, n)
      and n not in ('Dense', 'Module', 'compact')
  }
  assert from_activation - {'PReLU'} <= set(ACTIVATION_NAMES)
  missing = [n for n in ACTIVATION_NAMES if not hasattr(activation, n)]
  assert not missing


@pytest.mark.parametrize('name', ACTIVATION_NAMES)
def test_activation_is_the_same_function(name):
  assert getattr(activation, name) is getattr(flax_nn, name)


def test_normalize_is_standardize_alias():
  assert activation.normalize is activation.standardize
  assert activation.tanh is jnp.tanh


# name -> callable(fn, x) exercising non-default arguments too
ACTIVATION_CALLS = {
    'celu': lambda f, x: f(x, alpha=0.7),
    'elu': lambda f, x: f(x, alpha=1.3),
    'gelu': lambda f, x: (f(x), f(x, approximate=False)),
    'glu': lambda f, x: f(x, axis=-1),
    'leaky_relu': lambda f, x: f(x, negative_slope=0.2),
    'log_softmax': lambda f, x: (f(x), f(x, axis=0)),
    'logsumexp': lambda f, x: (f(x), f(x, axis=1, keepdims=True)),
    'normalize': lambda f, x: f(x, axis=-1, epsilon=1e-3),
    'one_hot': lambda f, x: (f(jnp.abs(x).astype(jnp.int32) % 5, 5),
                             f(jnp.abs(x).astype(jnp.int32), 4,
                               dtype=jnp.int8, axis=0)),
    'softmax': lambda f, x: (f(x), f(x, axis=(0, 1))),
    'standardize': lambda f, x: f(x, axis=0),
}


def _activation_input(dtype):
  x = rand(1, (4, 6), dtype)
  return x.at[0, 0].set(0.0)  # exercise the kink of piecewise functions


@pytest.mark.parametrize('name', ACTIVATION_NAMES)
def test_activation_outputs_identical_eager(name):
  call = ACTIVATION_CALLS.get(name, lambda f, x: f(x))
  x = _activation_input(jnp.float32)
  ours = call(getattr(activation, name), x)
  theirs = call(getattr(flax_nn, name), x)
  assert_identical(ours, theirs)


@pytest.mark.parametrize('name', ['gelu', 'silu', 'softplus', 'log_softmax',
                                  'softmax', 'standardize', 'logsumexp'])
def test_activation_outputs_identical_bfloat16_jit(name):
  call = ACTIVATION_CALLS.get(name, lambda f, x: f(x))
  x = _activation_input(jnp.bfloat16)
  ours = jax.jit(functools.partial(call, getattr(activation, name)))(x)
  theirs = jax.jit(functools.partial(call, getattr(flax_nn, name)))(x)
  assert_identical(ours, theirs)


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------

def _ones(dtype):  # host-made: an eager jnp.ones compiles once per dtype
  return jnp.asarray(np.ones(2, dtype))


DTYPE_CASES = [
    ((_ones(jnp.int32),), {}),
    ((_ones(jnp.int32), _ones(jnp.float16)), {}),
    ((_ones(jnp.bfloat16), 1.0, None), {}),
    ((_ones(jnp.bfloat16), _ones(jnp.float16)), {}),
    ((_ones(jnp.int8), 3), dict(inexact=False)),
    ((_ones(bool),), {}),
    ((_ones(bool),), dict(inexact=False)),
    ((_ones(jnp.complex64), _ones(jnp.float32)), {}),
    ((_ones(jnp.int32), None), dict(dtype=jnp.bfloat16)),
    ((_ones(jnp.float32),), dict(dtype=jnp.int32, inexact=False)),
    ((None, np.float64(2.0), np.arange(3)), {}),
    ((1, 2.5), {}),
    ((_ones(jnp.uint8),), {}),
]


@pytest.mark.parametrize('args,kwargs', DTYPE_CASES)
def test_canonicalize_dtype_matches(args, kwargs):
  ours = dtypes.canonicalize_dtype(*args, **kwargs)
  theirs = flax_dtypes.canonicalize_dtype(*args, **kwargs)
  assert ours == theirs
  assert type(ours) is type(theirs)


@pytest.mark.parametrize('args,kwargs', DTYPE_CASES)
def test_promote_dtype_matches(args, kwargs):
  ours = dtypes.promote_dtype(*args, **kwargs)
  theirs = flax_dtypes.promote_dtype(*args, **kwargs)
  assert isinstance(ours, list) and len(ours) == len(theirs)
  for o, t in zip(ours, theirs):
    if t is None:
      assert o is None
    else:
      assert_identical(o, t)


def test_dtype_explicit_dtype_returned_unchanged():
  assert dtypes.canonicalize_dtype(jnp.ones(1), dtype=jnp.float16) is (
      jnp.float16)
  assert dtypes.canonicalize_dtype(dtype='bfloat16') == 'bfloat16'


@pytest.mark.parametrize('args,kwargs', [
    ((_ones(jnp.float32),), dict(dtype=jnp.int32)),
    ((_ones(jnp.float32),), dict(dtype=bool)),
    ((), {}),
])
def test_dtype_errors_match(args, kwargs):
  with pytest.raises(Exception) as theirs:
    flax_dtypes.canonicalize_dtype(*args, **kwargs)
  with pytest.raises(type(theirs.value)) as ours:
    dtypes.canonicalize_dtype(*args, **kwargs)
  assert str(ours.value) == str(theirs.value)
  with pytest.raises(type(theirs.value)):
    dtypes.promote_dtype(*args, **kwargs)


def test_dtype_signatures():
  assert_same_signature(dtypes.canonicalize_dtype,
                        flax_dtypes.canonicalize_dtype)
  assert_same_signature(dtypes.promote_dtype, flax_dtypes.promote_dtype)


# --------------------------------------------------------------------------
# pooling
# --------------------------------------------------------------------------

# (input shape, window, strides, padding)
POOL_CASES = [
    ((2, 7, 6, 3), (2, 2), None, 'VALID'),
    ((2, 7, 6, 3), (3, 2), (2, 1), 'SAME'),
    ((2, 7, 6, 3), (3, 3), (2, 2), ((1, 0), (2, 1))),
    ((2, 7, 6, 3), (3, 3), (1, 2), [[1, 1], [0, 2]]),
    ((7, 6, 3), (2, 3), (2, 2), 'SAME'),                # no batch dim
    ((7, 6, 3), (2, 2), None, ((1, 1), (1, 0))),        # no batch dim
    ((2, 9, 4), (4,), (3,), ((2, 1),)),
    ((9, 4), (3,), None, 'SAME'),
    ((1, 4, 5, 6, 2), (2, 3, 2), (1, 2, 2), 'SAME'),
    ((2, 3, 6, 5, 2), (2, 2), (2, 1), 'SAME'),          # two batch dims
]
POOL_IDS = [f'case{i}' for i in range(len(POOL_CASES))]


@pytest.mark.parametrize('shape,window,strides,padding', POOL_CASES,
                         ids=POOL_IDS)
def test_max_min_pool(shape, window, strides, padding):
  x = rand(2, shape)
  for name in ('max_pool', 'min_pool'):
    ours = getattr(pooling, name)(x, window, strides=strides, padding=padding)
    theirs = getattr(flax_pooling, name)(x, window, strides=strides,
                                         padding=padding)
    assert_identical(ours, theirs)


@pytest.mark.parametrize('count_include_pad', [True, False])
@pytest.mark.parametrize('shape,window,strides,padding', POOL_CASES,
                         ids=POOL_IDS)
def test_avg_pool(shape, window, strides, padding, count_include_pad):
  x = rand(3, shape)
  ours = pooling.avg_pool(x, window, strides, padding, count_include_pad)
  theirs = flax_pooling.avg_pool(x, window, strides, padding,
                                 count_include_pad)
  assert_identical(ours, theirs)


@pytest.mark.parametrize('case,dtype', [(2, jnp.bfloat16), (4, jnp.float16)],
                         ids=str)
def test_pool_half_precision(case, dtype):
  shape, window, strides, padding = POOL_CASES[case]
  x = rand(case, shape, dtype)
  for name in ('max_pool', 'min_pool'):
    assert_identical(
        getattr(pooling, name)(x, window, strides, padding),
        getattr(flax_pooling, name)(x, window, strides, padding))
  for include in (True, False):
    out = pooling.avg_pool(x, window, strides, padding, include)
    assert_identical(out, flax_pooling.avg_pool(x, window, strides, padding,
                                                 include))


def test_avg_pool_count_include_pad_changes_borders():
  x = jnp.ones((1, 4, 4, 1))
  incl = pooling.avg_pool(x, (3, 3), padding='SAME')
  excl = pooling.avg_pool(x, (3, 3), padding='SAME', count_include_pad=False)
  assert incl[0, 0, 0, 0] == pytest.approx(4 / 9)
  np.testing.assert_array_equal(excl, np.ones((1, 4, 4, 1), np.float32))


def test_pool_custom_reduce_and_jit():
  x = rand(4, (2, 8, 3))
  ours = jax.jit(lambda v: pooling.pool(v, 1.0, jax.lax.mul, (3,), (2,),
                                        ((1, 1),)))(x)
  theirs = flax_pooling.pool(x, 1.0, jax.lax.mul, (3,), (2,), ((1, 1),))
  assert_identical(ours, theirs)


@pytest.mark.parametrize('padding', [((1, 1),), ((1, 1, 1), (0, 0))])
def test_pool_bad_padding_raises_like_linen(padding):
  x = jnp.ones((1, 5, 5, 1))
  with pytest.raises(AssertionError):
    flax_pooling.max_pool(x, (2, 2), padding=padding)
  with pytest.raises(AssertionError):
    pooling.max_pool(x, (2, 2), padding=padding)


def test_pool_strides_length_mismatch_raises():
  with pytest.raises(AssertionError):
    pooling.avg_pool(jnp.ones((1, 5, 5, 1)), (2, 2), strides=(1,))


def test_pool_signatures():
  for name in ('pool', 'avg_pool', 'max_pool', 'min_pool'):
    assert_same_signature(getattr(pooling, name), getattr(flax_pooling, name))
  assert flax_nn.pool is flax_pooling.pool  # the oracle is the right one


@settings(max_examples=8, deadline=None)
@given(
    length=st.integers(3, 9),
    window=st.integers(1, 3),
    stride=st.integers(1, 3),
    pads=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    batched=st.booleans(),
    include=st.booleans(),
)
def test_avg_pool_property(length, window, stride, pads, batched, include):
  shape = (2, length, 2) if batched else (length, 2)
  x = rand(length, shape)
  ours = pooling.avg_pool(x, (window,), (stride,), (pads,), include)
  theirs = flax_pooling.avg_pool(x, (window,), (stride,), (pads,), include)
  assert_identical(ours, theirs)


# --------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------

def qkv(batch, q_len=5, kv_len=6, heads=2, depth=5, v_depth=3,
        dtype=jnp.float32):
  q = rand(10, batch + (q_len, heads, depth), dtype)
  k = rand(11, batch + (kv_len, heads, depth), dtype)
  v = rand(12, batch + (kv_len, heads, v_depth), dtype)
  return q, k, v


def both_attention(*args, fn='dot_product_attention', **kwargs):
  ours = getattr(attention_fns, fn)(*args, **kwargs)
  theirs = getattr(flax_attention, fn)(*args, **kwargs)
  assert_identical(ours, theirs)
  return ours


BATCHES = [(), (2,), (2, 2)]


@pytest.mark.parametrize('batch,dtype', [(b, jnp.float32) for b in BATCHES] +
                         [((2,), jnp.bfloat16), ((2,), jnp.float16)],
                         ids=str)
def test_attention_plain(batch, dtype):
  q, k, v = qkv(batch, dtype=dtype)
  out = both_attention(q, k, v)
  assert out.shape == batch + (5, 2, 3) and out.dtype == dtype
  w = both_attention(q, k, fn='dot_product_attention_weights')
  assert w.shape == batch + (2, 5, 6)


@pytest.mark.parametrize('batch', [(), (2, 2)], ids=str)
def test_attention_bias_and_mask(batch):
  q, k, v = qkv(batch)
  bias = rand(13, batch + (1, 5, 6))
  mask = rand_bool(3, batch + (2, 5, 6), 0.6)
  float_mask = mask.astype(jnp.float32)
  for kwargs in (dict(bias=bias), dict(mask=mask), dict(mask=float_mask),
                 dict(bias=bias, mask=mask)):
    both_attention(q, k, v, **kwargs)
    both_attention(q, k, fn='dot_product_attention_weights', **kwargs)
  w = attention_fns.dot_product_attention_weights(q, k, mask=mask)
  assert float(jnp.max(jnp.where(mask, 0.0, w))) < 1e-30


@pytest.mark.parametrize('dtype', [jnp.float16, jnp.bfloat16, jnp.float32])
def test_attention_fully_masked_row(dtype):
  # Masked logits become finfo(dtype).min: a fully masked query row is then
  # uniform (and finite even in float16).
  q, k, v = qkv((2,), dtype=dtype)
  mask = jnp.ones((2, 1, 5, 6), bool).at[:, :, 1, :].set(False)
  both_attention(q, k, v, mask=mask)
  w = both_attention(q, k, mask=mask, fn='dot_product_attention_weights')
  row = np.asarray(w[:, :, 1].astype(jnp.float32))
  assert np.isfinite(row).all()
  np.testing.assert_allclose(row, 1 / 6, rtol=1e-2)


def test_attention_with_linen_masks():
  q, k, v = qkv((2,), q_len=6)
  tokens = jnp.array([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 0]])
  mask = attention_fns.combine_masks(
      attention_fns.make_causal_mask(tokens),
      attention_fns.make_attention_mask(tokens > 0, tokens > 0),
  )
  both_attention(q, k, v, mask=mask)


@pytest.mark.parametrize('batch,dtype,broadcast_dropout', [
    ((2,), jnp.float32, True),
    ((2,), jnp.float32, False),
    ((2,), jnp.bfloat16, True),
    ((2, 2), jnp.float32, True),
], ids=str)
def test_attention_dropout_bit_identical(batch, dtype, broadcast_dropout):
  q, k, v = qkv(batch, dtype=dtype)
  kwargs = dict(dropout_rng=jax.random.key(7), dropout_rate=0.4,
                broadcast_dropout=broadcast_dropout, deterministic=False)
  out = both_attention(q, k, v, **kwargs)
  w = both_attention(q, k, fn='dot_product_attention_weights', **kwargs)
  dropped = np.asarray(w.astype(jnp.float32)) == 0
  assert dropped.any() and not dropped.all()
  if broadcast_dropout and batch:
    assert (dropped == dropped.reshape((-1,) + dropped.shape[-2:])[0]).all()
  clean = attention_fns.dot_product_attention(q, k, v)
  assert not np.array_equal(out, clean)


def test_attention_dropout_respects_deterministic_and_rate():
  q, k, v = qkv((2,))
  clean = attention_fns.dot_product_attention(q, k, v)
  key = jax.random.PRNGKey(1)
  for kwargs in (dict(dropout_rate=0.5, deterministic=True),
                 dict(dropout_rate=0.0, deterministic=False)):
    out = both_attention(q, k, v, dropout_rng=key, **kwargs)
    assert_identical(out, clean)


def test_attention_dtype_and_promotion():
  q, k, v = qkv((2,))
  both_attention(q, k, v, dtype=jnp.bfloat16)
  both_attention(q.astype(jnp.bfloat16), k, v.astype(jnp.float16))
  both_attention(q, k.astype(jnp.bfloat16), dtype=jnp.float16,
                 fn='dot_product_attention_weights')
  # a float32 bias promotes the logits; the weights come back in bfloat16
  q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
  bias = rand(13, (2, 1, 5, 6))
  w = both_attention(q16, k16, bias=bias, fn='dot_product_attention_weights')
  assert w.dtype == jnp.bfloat16
  assert both_attention(q16, k16, v16, bias=bias).dtype == jnp.bfloat16


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
def test_attention_force_fp32_softmax(dtype):
  q, k, v = qkv((2,), dtype=dtype)
  out = both_attention(q, k, v, force_fp32_for_softmax=True)
  w = both_attention(q, k, force_fp32_for_softmax=True,
                     fn='dot_product_attention_weights')
  assert w.dtype == jnp.float32


def test_attention_precision_and_custom_einsums():
  q, k, v = qkv((2,))
  both_attention(q, k, v, precision=jax.lax.Precision.HIGHEST)
  both_attention(q, k, v, precision='highest')

  def counting_dot_general(calls):
    def dot_general(*args, **kwargs):
      calls.append(1)
      return jax.lax.dot_general(*args, **kwargs)
    return dot_general

  ours_calls, theirs_calls = [], []
  assert_identical(
      attention_fns.dot_product_attention(
          q, k, v, einsum_dot_general=counting_dot_general(ours_calls)),
      flax_attention.dot_product_attention(
          q, k, v, einsum_dot_general=counting_dot_general(theirs_calls)))
  assert len(ours_calls) == len(theirs_calls) == 2  # both einsums use it

  def scaled_einsum(spec, a, b):
    return jnp.einsum(spec, a, b) * 0.5

  ours = both_attention(q, k, v, qk_attn_weights_einsum=scaled_einsum,
                        attn_weights_value_einsum=scaled_einsum)
  assert not np.array_equal(ours, attention_fns.dot_product_attention(q, k, v))
  both_attention(q, k, einsum=scaled_einsum,
                 fn='dot_product_attention_weights')


@pytest.mark.parametrize('fn,kwargs', [
    ('dot_product_attention', dict(qk_attn_weights_einsum=jnp.einsum)),
    ('dot_product_attention', dict(attn_weights_value_einsum=jnp.einsum)),
    ('dot_product_attention', dict(
        precision='highest', qk_attn_weights_einsum=jnp.einsum,
        attn_weights_value_einsum=jnp.einsum)),
    ('dot_product_attention_weights', dict(precision='high',
                                           einsum=jnp.einsum)),
    ('dot_product_attention_weights', dict(
        einsum_dot_general=jax.lax.dot_general, einsum=jnp.einsum)),
])
def test_attention_argument_errors(fn, kwargs):
  q, k, v = qkv(())
  args = (q, k, v) if fn == 'dot_product_attention' else (q, k)
  with pytest.raises(ValueError):
    getattr(flax_attention, fn)(*args, **kwargs)
  with pytest.raises(ValueError):
    getattr(attention_fns, fn)(*args, **kwargs)


@pytest.mark.parametrize('shapes', [
    ((5, 2, 4), (2, 6, 2, 4), (2, 6, 2, 3)),   # rank
    ((5, 2, 4), (6, 3, 4), (6, 3, 3)),         # heads
    ((5, 2, 4), (6, 2, 4), (7, 2, 3)),         # kv lengths
    ((5, 2, 4), (6, 2, 3), (6, 2, 3)),         # depth
])
def test_attention_shape_checks(shapes):
  q, k, v = (jnp.ones(s) for s in shapes)
  with pytest.raises((AssertionError, ValueError, TypeError)):
    flax_attention.dot_product_attention(q, k, v)
  with pytest.raises(AssertionError):
    attention_fns.dot_product_attention(q, k, v)


class _Recorder:
  """Duck-typed stand-in for a module: records ``sow`` calls."""

  def __init__(self):
    self.calls = []

  def sow(self, col, name, value):
    self.calls.append((col, name, value))
    return True


def test_attention_sows_into_duck_typed_module():
  q, k, v = qkv((2,))
  rec = _Recorder()
  attention_fns.dot_product_attention(
      q, k, v, module=rec, dropout_rng=jax.random.key(0), dropout_rate=0.3)
  assert len(rec.calls) == 1
  col, name, value = rec.calls[0]
  assert (col, name) == ('intermediates', 'attention_weights')
  # the pre-dropout weights are what gets sown
  assert_identical(value,
                    flax_attention.dot_product_attention_weights(q, k))
  attention_fns.dot_product_attention(q, k, v, module=None)
  assert len(rec.calls) == 1


@pytest.mark.parametrize('impl', ['ours', 'flax'])
def test_attention_sow_into_linen_intermediates(impl):
  lib = attention_fns if impl == 'ours' else flax_attention

  class Attend(flax_nn.Module):

    @flax_nn.compact
    def __call__(self, q, k, v):
      return lib.dot_product_attention(q, k, v, module=self)

  class Reference(flax_nn.Module):

    @flax_nn.compact
    def __call__(self, q, k, v):
      return flax_attention.dot_product_attention(q, k, v, module=self)

  q, k, v = qkv((2,))
  out, state = Attend().apply({}, q, k, v, mutable=['intermediates'])
  ref_out, ref_state = Reference().apply({}, q, k, v,
                                         mutable=['intermediates'])
  assert_identical(out, ref_out)
  assert jax.tree_util.tree_structure(state) == (
      jax.tree_util.tree_structure(ref_state))
  assert_identical(state, ref_state)
  assert state['intermediates']['attention_weights'][0].shape == (2, 2, 5, 6)


def test_attention_under_jit_matches():
  q, k, v = qkv((2,))
  key = jax.random.key(9)
  ours = jax.jit(functools.partial(
      attention_fns.dot_product_attention, dropout_rate=0.2))(
          q, k, v, dropout_rng=key)
  theirs = jax.jit(functools.partial(
      flax_attention.dot_product_attention, dropout_rate=0.2))(
          q, k, v, dropout_rng=key)
  assert_identical(ours, theirs)


# --------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bool_, jnp.int32])
@pytest.mark.parametrize('extra_batch_dims', [0, 2])
def test_make_attention_mask(dtype, extra_batch_dims):
  qi = jnp.array([[1, 2, 0], [3, 0, 0]])
  ki = jnp.array([[5, 0, 0, 0], [1, 1, 1, 0]])
  for args in ((qi > 0, ki > 0), (qi, ki, jnp.greater_equal)):
    ours = attention_fns.make_attention_mask(
        *args, extra_batch_dims=extra_batch_dims, dtype=dtype)
    theirs = flax_attention.make_attention_mask(
        *args, extra_batch_dims=extra_batch_dims, dtype=dtype)
    assert_identical(ours, theirs)
    assert ours.shape == (1,) * extra_batch_dims + (2, 1, 3, 4)


@pytest.mark.parametrize('shape', [(4,), (2, 5), (2, 3, 6)])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bool_])
def test_make_causal_mask(shape, dtype):
  x = jnp.zeros(shape, jnp.int32)
  for extra in (0, 1):
    ours = attention_fns.make_causal_mask(x, extra_batch_dims=extra,
                                          dtype=dtype)
    assert_identical(ours, flax_attention.make_causal_mask(
        x, extra_batch_dims=extra, dtype=dtype))
  n = shape[-1]
  np.testing.assert_array_equal(
      attention_fns.make_causal_mask(x)[..., 0, :, :].reshape(-1, n, n)[0],
      np.tril(np.ones((n, n), np.float32)))


def test_combine_masks():
  a = rand_bool(0, (2, 1, 4, 4))
  b = rand_bool(1, (2, 1, 4, 4))
  c = jnp.ones((1, 1, 4, 4), jnp.float32).at[0, 0, 0, 0].set(0.0)
  for masks in ((a,), (a, b), (a, None, b), (None, a, b, c), (c, c)):
    for dtype in (jnp.float32, jnp.bool_):
      assert_identical(attention_fns.combine_masks(*masks, dtype=dtype),
                        flax_attention.combine_masks(*masks, dtype=dtype))
  assert attention_fns.combine_masks() is None
  assert attention_fns.combine_masks(None, None) is None
  with pytest.raises(AssertionError):
    flax_attention.combine_masks(a, jnp.ones((4, 4)))
  with pytest.raises(AssertionError):
    attention_fns.combine_masks(a, jnp.ones((4, 4)))


@pytest.mark.parametrize('name', [
    'dot_product_attention_weights', 'dot_product_attention',
    'make_attention_mask', 'make_causal_mask', 'combine_masks',
])
def test_attention_signatures(name):
  assert_same_signature(getattr(attention_fns, name),
                        getattr(flax_attention, name))
  assert getattr(flax_nn, name) is getattr(flax_attention, name)


# --------------------------------------------------------------------------
# hygiene
# --------------------------------------------------------------------------

MODULES = [initializers, activation, dtypes, pooling, attention_fns]


@pytest.mark.parametrize('mod', MODULES, ids=lambda m: m.__name__)
def test_modules_do_not_import_flax(mod):
  source = inspect.getsource(mod)
  assert 'import flax' not in source and 'from flax' not in source
