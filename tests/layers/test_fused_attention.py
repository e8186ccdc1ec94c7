"""``nn.fused_dot_product_attention`` against the default (Linen) path.

The fused function hands attention to ``jax.nn.dot_product_attention``; on
the CPU that is XLA's implementation, whose results differ from Linen's
einsums only by float rounding (the scale is applied to the logits instead of
the query, the softmax always runs in float32). Each case compares the two
paths on the same inputs: values and gradients to float32 rounding, the
parameters of a layer using it bit for bit, and the calls it cannot fuse
(dropout, sown weights, precision, custom einsums, unequal depths) bit for
bit, since those run the default path itself. Which path ran is checked by
counting calls of ``jax.nn.dot_product_attention``.
"""
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as nn
import treecheck
from treecheck import normal

pytestmark = pytest.mark.usefixtures('fast_compiles')

# Float32 rounding: observed differences are below 1e-6 for unit-normal
# inputs; the bound leaves room for other CPUs and XLA versions.
ATOL = 1e-5
GRAD_ATOL = 5e-5


def assert_close(fused, default, atol=ATOL):
  assert fused.shape == default.shape
  assert fused.dtype == default.dtype, (fused.dtype, default.dtype)
  diff = float(jnp.max(jnp.abs(fused.astype(jnp.float32) -
                               default.astype(jnp.float32))))
  assert diff <= atol, diff
  return diff


def qkv(shape_q, shape_kv, seed=0, dtype=np.float32, v_depth=None):
  q = normal(seed, shape_q, dtype)
  k = normal(seed + 1, shape_kv, dtype)
  v_shape = shape_kv if v_depth is None else shape_kv[:-1] + (v_depth,)
  v = normal(seed + 2, v_shape, dtype)
  return q, k, v


@pytest.fixture
def jax_calls(monkeypatch):
  """The keyword arguments of every call of jax.nn.dot_product_attention."""
  calls = []
  real = jax.nn.dot_product_attention

  @functools.wraps(real)  # keeps the signature the options are probed from
  def spy(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(jax.nn, 'dot_product_attention', spy)
  return calls


def explicit_window(q_len, kv_len, left, right, causal=False):
  """The window as a ``[q, kv]`` 0/1 mask, written out element by element."""
  out = np.zeros((q_len, kv_len), np.float32)
  for i in range(q_len):
    for j in range(kv_len):
      ok = i - left <= j <= i + right
      out[i, j] = ok and (j <= i or not causal)
  return jnp.asarray(out)


# -- values -----------------------------------------------------------------


@pytest.mark.parametrize('batch', [(), (3,), (2, 3)], ids=str)
def test_no_mask_equals_default(batch, jax_calls):
  q, k, v = qkv(batch + (5, 4, 8), batch + (7, 4, 8))
  fused = nn.fused_dot_product_attention(q, k, v)
  assert_close(fused, nn.dot_product_attention(q, k, v))
  assert len(jax_calls) == 1  # the fused path ran


def test_padding_mask_equals_default():
  q, k, v = qkv((3, 6, 2, 8), (3, 5, 2, 8))
  q_valid = jnp.array([[1, 1, 1, 1, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]])
  k_valid = jnp.array([[1, 1, 1, 0, 0], [1] * 5, [0, 0, 0, 0, 0]])
  mask = nn.make_attention_mask(q_valid, k_valid)
  # Rows with nothing to attend to (padded queries, and the whole third
  # sequence) are uniform over the keys on both paths.
  assert not bool(mask[2].any())
  fused = nn.fused_dot_product_attention(q, k, v, mask=mask)
  default = nn.dot_product_attention(q, k, v, mask=mask)
  assert_close(fused, default)
  assert_close(fused[2], jnp.broadcast_to(v[2].mean(0), fused[2].shape))
  # A boolean mask and a key-only mask broadcast over the queries.
  key_only = (k_valid > 0)[:, None, None, :]
  assert_close(nn.fused_dot_product_attention(q, k, v, mask=key_only),
               nn.dot_product_attention(q, k, v, mask=key_only))


def test_causal_mask_and_is_causal_equal_default(jax_calls):
  q, k, v = qkv((2, 6, 3, 8), (2, 6, 3, 8))
  causal = nn.make_causal_mask(jnp.ones((2, 6)))
  default = nn.dot_product_attention(q, k, v, mask=causal)
  assert_close(nn.fused_dot_product_attention(q, k, v, mask=causal), default)
  assert_close(nn.fused_dot_product_attention(q, k, v, is_causal=True),
               default)
  assert jax_calls[-1].get('is_causal') is True  # JAX's option, not a mask
  # Causal and padding together.
  valid = jnp.array([[1, 1, 1, 1, 0, 0], [1] * 6])
  padding = nn.make_attention_mask(valid, valid)
  assert_close(
      nn.fused_dot_product_attention(q, k, v, mask=padding, is_causal=True),
      nn.dot_product_attention(q, k, v,
                               mask=nn.combine_masks(padding, causal)))


@pytest.mark.parametrize('bias_shape', [(2, 3, 4, 6), (1, 3, 4, 6), (4, 6),
                                        (2, 1, 1, 6)], ids=str)
def test_bias_equals_default(bias_shape):
  q, k, v = qkv((2, 4, 3, 8), (2, 6, 3, 8))
  bias = normal(5, bias_shape)
  mask = nn.make_attention_mask(jnp.ones((2, 4)),
                                jnp.array([[1] * 6, [1, 1, 1, 0, 0, 0]]))
  for m in (None, mask):
    assert_close(nn.fused_dot_product_attention(q, k, v, bias, m),
                 nn.dot_product_attention(q, k, v, bias, m))


@pytest.mark.parametrize('window,causal', [((2, 1), False), (2, False),
                                           ((0, 0), False), ((3, 0), False),
                                           ((2, 2), True)], ids=str)
def test_local_window_equals_explicit_mask(window, causal, jax_calls):
  q, k, v = qkv((2, 8, 2, 4), (2, 8, 2, 4))
  left, right = (window, window) if isinstance(window, int) else window
  mask = explicit_window(8, 8, left, right, causal)
  fused = nn.fused_dot_product_attention(q, k, v, local_window_size=window,
                                         is_causal=causal)
  assert_close(fused, nn.dot_product_attention(q, k, v, mask=mask))
  assert jax_calls[-1]['local_window_size'] == (left, right)


def test_several_batch_axes_with_broadcast_masks():
  batch = (2, 3)
  q, k, v = qkv(batch + (4, 2, 8), batch + (5, 2, 8))
  rng = np.random.default_rng(3)
  for shape in [(2, 1, 1, 4, 5), (1, 3, 2, 4, 5), (2, 3, 1, 1, 5),
                (3, 1, 4, 5), (5,)]:
    mask = jnp.asarray(rng.random(shape) > 0.3)
    bias = normal(4, shape)
    assert_close(nn.fused_dot_product_attention(q, k, v, bias, mask),
                 nn.dot_product_attention(q, k, v, bias, mask))


def test_grouped_query_attention_equals_repeated_heads():
  q, k, v = qkv((2, 5, 6, 8), (2, 5, 2, 8))
  mask = nn.make_causal_mask(jnp.ones((2, 5)))
  fused = nn.fused_dot_product_attention(q, k, v, mask=mask)
  k3, v3 = (jnp.repeat(x, 3, axis=-2) for x in (k, v))
  assert_close(fused, nn.dot_product_attention(q, k3, v3, mask=mask))


def test_dtypes_follow_the_default_path():
  q, k, v = qkv((2, 5, 2, 8), (2, 5, 2, 8))
  for kwargs in ({'dtype': jnp.bfloat16},
                 {'dtype': jnp.bfloat16, 'force_fp32_for_softmax': True}):
    fused = nn.fused_dot_product_attention(q, k, v, **kwargs)
    default = nn.dot_product_attention(q, k, v, **kwargs)
    assert_close(fused, default, atol=3e-2)  # bfloat16 rounding
  assert fused.dtype == jnp.float32  # force_fp32_for_softmax, as Linen
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  fused = nn.fused_dot_product_attention(qb, kb, vb)
  assert_close(fused, nn.dot_product_attention(qb, kb, vb), atol=3e-2)


def test_jit_and_implementation_xla(jax_calls):
  q, k, v = qkv((2, 5, 2, 8), (2, 5, 2, 8))
  xla = functools.partial(nn.fused_dot_product_attention,
                          implementation='xla', is_causal=True)
  fused = jax.jit(xla)(q, k, v)
  assert jax_calls[-1]['implementation'] == 'xla'
  causal = nn.make_causal_mask(jnp.ones((2, 5)))
  assert_close(fused, nn.dot_product_attention(q, k, v, mask=causal))


# -- gradients ----------------------------------------------------------------


def test_gradients_close():
  q, k, v = qkv((2, 6, 2, 8), (2, 6, 2, 8))
  bias = normal(7, (2, 1, 6, 6))
  valid = jnp.array([[1] * 6, [1, 1, 1, 1, 0, 0]])
  mask = nn.combine_masks(nn.make_attention_mask(valid, valid),
                          nn.make_causal_mask(valid))
  weights = normal(8, (2, 6, 2, 8))

  def loss(fn, *args):
    return jnp.sum(fn(*args, mask=mask) * weights)

  grads = [jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3))(
      q, k, v, bias) for fn in (nn.fused_dot_product_attention,
                                nn.dot_product_attention)]
  for fused, default in zip(*grads):
    assert_close(fused, default, atol=GRAD_ATOL)


# -- inside MultiHeadDotProductAttention ---------------------------------------


def _layers(**kwargs):
  default = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16,
                                            **kwargs)
  fused = default.clone(attention_fn=nn.fused_dot_product_attention)
  return default, fused


def test_layer_parameters_identical_and_outputs_close(jax_calls):
  default, fused = _layers()
  x = normal(0, (2, 6, 12))
  mask = nn.make_causal_mask(jnp.ones((2, 6)))
  v_default = default.init(jax.random.key(0), x, mask=mask)
  v_fused = fused.init(jax.random.key(0), x, mask=mask)
  treecheck.assert_identical(v_fused, v_default, 'init')
  calls = len(jax_calls)
  out = fused.apply(v_default, x, mask=mask)
  assert len(jax_calls) == calls + 1
  assert_close(out, default.apply(v_default, x, mask=mask))
  causal = default.clone(attention_fn=functools.partial(
      nn.fused_dot_product_attention, is_causal=True))
  assert_close(causal.apply(v_default, x),
               default.apply(v_default, x, mask=mask))

  def loss(layer, params):
    return jnp.sum(layer.apply({'params': params}, x, mask=mask) ** 2)

  g_fused = jax.grad(functools.partial(loss, fused))(v_default['params'])
  g_default = jax.grad(functools.partial(loss, default))(v_default['params'])
  treecheck.assert_close(g_fused, g_default, rtol=0, atol=GRAD_ATOL)


def test_layer_decode_with_the_fused_function():
  default, fused = _layers(decode=True)
  x = normal(1, (2, 5, 12))
  variables = default.init(jax.random.key(0), x)
  outs = {}
  for name, layer in (('default', default), ('fused', fused)):
    cache, steps = variables['cache'], []
    for t in range(5):
      y, updated = layer.apply({'params': variables['params'],
                                'cache': cache}, x[:, t:t + 1],
                               mutable=['cache'])
      cache = updated['cache']
      steps.append(y)
    outs[name] = jnp.concatenate(steps, axis=1)
  assert_close(outs['fused'], outs['default'])
  # is_causal cannot align one query with a cache of five keys.
  causal = default.clone(attention_fn=functools.partial(
      nn.fused_dot_product_attention, is_causal=True))
  with pytest.raises(nn.FusedAttentionError, match='q_length == kv_length'):
    causal.apply(variables, x[:, :1], mutable=['cache'])


# -- fallbacks ---------------------------------------------------------------


def test_dropout_falls_back_bit_for_bit(jax_calls):
  q, k, v = qkv((2, 5, 2, 8), (2, 5, 2, 8))
  mask = nn.make_causal_mask(jnp.ones((2, 5)))
  rng = jax.random.key(3)
  args = dict(dropout_rng=rng, dropout_rate=0.3, deterministic=False)
  with pytest.warns(nn.FusedAttentionWarning, match='dropout'):
    fused = nn.fused_dot_product_attention(q, k, v, mask=mask, **args)
  default = nn.dot_product_attention(q, k, v, mask=mask, **args)
  treecheck.assert_identical(fused, default)
  with pytest.warns(nn.FusedAttentionWarning):  # causal becomes a mask
    treecheck.assert_identical(
        nn.fused_dot_product_attention(q, k, v, is_causal=True, **args),
        default)
  assert not jax_calls
  # Deterministic: fused, no warning.
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    nn.fused_dot_product_attention(q, k, v, mask=mask, dropout_rate=0.3,
                                   deterministic=True)
  assert len(jax_calls) == 1


def test_layer_dropout_falls_back_bit_for_bit():
  default, fused = _layers(dropout_rate=0.5, deterministic=False)
  x = normal(2, (2, 6, 12))
  variables = default.init(jax.random.key(0), x)
  rngs = {'dropout': jax.random.key(9)}
  with pytest.warns(nn.FusedAttentionWarning, match='dropout'):
    out = fused.apply(variables, x, rngs=rngs)
  treecheck.assert_identical(out, default.apply(variables, x, rngs=rngs))


def test_sown_weights_fall_back_bit_for_bit():
  default, fused = _layers()
  x = normal(3, (2, 6, 12))
  variables = default.init(jax.random.key(0), x)
  with pytest.warns(nn.FusedAttentionWarning, match='never forms'):
    got = fused.apply(variables, x, sow_weights=True,
                      mutable=['intermediates'])
  treecheck.assert_identical(
      got, default.apply(variables, x, sow_weights=True,
                         mutable=['intermediates']))


@pytest.mark.parametrize('what', ['precision', 'einsum', 'v_depth'])
def test_other_fallbacks_bit_for_bit(what, jax_calls):
  q, k, v = qkv((2, 5, 2, 8), (2, 5, 2, 8), v_depth=6 if what == 'v_depth'
                else None)
  kwargs = {'precision': {'precision': jax.lax.Precision.HIGHEST},
            'einsum': {'qk_attn_weights_einsum': jnp.einsum,
                       'attn_weights_value_einsum': jnp.einsum},
            'v_depth': {}}[what]
  with pytest.warns(nn.FusedAttentionWarning) as caught:
    fused = nn.fused_dot_product_attention(q, k, v, **kwargs)
  text = str(caught[0].message)
  assert {'precision': 'precision=', 'einsum': 'qk_attn_weights_einsum',
          'v_depth': 'value depth 6'}[what] in text, text
  treecheck.assert_identical(fused, nn.dot_product_attention(q, k, v,
                                                             **kwargs))
  assert not jax_calls


def test_no_fallback_raises():
  q, k, v = qkv((2, 5, 2, 8), (2, 5, 2, 8))
  with pytest.raises(nn.FusedAttentionError,
                     match=r'cannot fuse this call: dropout .*fallback=False'):
    nn.fused_dot_product_attention(q, k, v, dropout_rate=0.1,
                                   dropout_rng=jax.random.key(0),
                                   fallback=False)


# -- feature probing and errors -------------------------------------------------


def test_options_missing_from_jax_become_a_mask(monkeypatch):
  """A JAX whose dot_product_attention lacks is_causal/local_window_size
  (probed from its signature) gets them as a mask instead."""
  real = jax.nn.dot_product_attention
  seen = []

  def older(query, key, value, bias=None, mask=None, *, scale=None):
    seen.append(mask)
    return real(query, key, value, bias, mask, scale=scale)

  monkeypatch.setattr(jax.nn, 'dot_product_attention', older)
  q, k, v = qkv((2, 6, 2, 4), (2, 6, 2, 4))
  fused = nn.fused_dot_product_attention(q, k, v, is_causal=True,
                                         local_window_size=(2, 0))
  mask = explicit_window(6, 6, 2, 0, causal=True)
  assert seen[-1] is not None and seen[-1].dtype == jnp.bool_
  assert_close(fused, nn.dot_product_attention(q, k, v, mask=mask))
  with pytest.raises(nn.FusedAttentionError, match='no implementation='):
    nn.fused_dot_product_attention(q, k, v, implementation='xla')


@pytest.mark.parametrize('shapes,match', [
    (((2, 5, 2, 8), (5, 2, 8), (5, 2, 8)), 'same rank'),
    (((5, 8), (5, 8), (5, 8)), 'rank 3 or more'),
    (((2, 5, 2, 8), (3, 5, 2, 8), (3, 5, 2, 8)), 'same batch axes'),
    (((2, 5, 2, 8), (2, 5, 2, 8), (2, 4, 2, 8)), 'same length'),
    (((2, 5, 4, 8), (2, 5, 2, 8), (2, 5, 1, 8)), 'same number of heads'),
    (((2, 5, 2, 8), (2, 5, 2, 4), (2, 5, 2, 4)), 'same depth'),
    (((2, 5, 3, 8), (2, 5, 2, 8), (2, 5, 2, 8)), 'multiple of the key'),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_shapes_raise(shapes, match):
  q, k, v = (jnp.zeros(s) for s in shapes)
  with pytest.raises(nn.FusedAttentionError, match=match):
    nn.fused_dot_product_attention(q, k, v)


def test_bad_masks_and_options_raise():
  q, k, v = qkv((2, 4, 2, 8), (2, 5, 2, 8))
  with pytest.raises(nn.FusedAttentionError,
                     match=r'mask of shape \(1, 1, 3, 5\) does not broadcast'):
    nn.fused_dot_product_attention(q, k, v, mask=jnp.ones((3, 5)))
  with pytest.raises(nn.FusedAttentionError, match='bias has rank 5'):
    nn.fused_dot_product_attention(q, k, v, bias=jnp.ones((1, 2, 2, 4, 5)))
  with pytest.raises(nn.FusedAttentionError, match='q_length == kv_length'):
    nn.fused_dot_product_attention(q, k, v, is_causal=True)
  with pytest.raises(nn.FusedAttentionError, match='q_length == kv_length'):
    nn.fused_dot_product_attention(q, k, v, local_window_size=2)
  q, k, v = qkv((2, 5, 2, 8), (2, 5, 2, 8))
  for bad in (-1, (1, 2, 3), (1.5, 2), True, 'left'):
    with pytest.raises(nn.FusedAttentionError, match='local_window_size'):
      nn.fused_dot_product_attention(q, k, v, local_window_size=bad)
  error = nn.FusedAttentionError('x')
  assert isinstance(error, ValueError) and 'docs/attention.md' in str(error)


# -- the benchmark's attention phase ----------------------------------------------


def test_accelerator_attention_phase(tmp_path):
  """``benchmarks.accelerator --phases=attention`` at the tiny size: the LM
  step with and without the fused function, both timed, the same first
  loss to bf16 rounding, its two table rows."""
  root = pathlib.Path(__file__).resolve().parents[2]
  out = tmp_path / 'out'
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS='1')
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.accelerator', '--preset=tiny',
       '--phases=attention', f'--out_dir={out}', '--attention_budget_s=400'],
      cwd=root, env=env, capture_output=True, text=True, timeout=900,
      check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  results = json.loads((out / 'accelerator.json').read_text())
  assert list(results['phases']) == ['attention']
  att = results['attention']
  assert att['status'] == 'ok', att
  assert (att['size'], att['implementation']) == ('tiny', 'xla')
  for name in ('default', 'fused'):
    for key in ('compile_s', 'step_median_s', 'step_best_s', 'tokens_per_s'):
      assert att[name][key] > 0, (name, key)
    assert len(att[name]['step_rounds_s']) >= 2
  assert math.isclose(att['fused']['first_loss'],
                      att['default']['first_loss'], rel_tol=1e-3)
  assert att['step_ratio']['median'] > 0 and att['step_ratio']['best'] > 0
  rows = [line for line in (out / 'accelerator.md').read_text().splitlines()
          if line.startswith('| ') and not line.startswith('| figure')]
  assert len(rows) == 2, rows
  assert 'nn.fused_dot_product_attention(implementation=xla)' in rows[0]
  assert 'first-step loss' in rows[1]


# -- cuDNN, on a GPU only --------------------------------------------------------


@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='needs a GPU')
def test_cudnn_equals_default_on_gpu():
  q, k, v = qkv((2, 128, 4, 64), (2, 128, 4, 64), dtype=jnp.bfloat16)
  valid = (jnp.arange(128)[None] < jnp.array([[128], [100]])).astype(
      jnp.int32)
  padding = nn.make_attention_mask(valid, valid)
  causal = nn.make_causal_mask(valid)
  bias = normal(3, (1, 4, 128, 128), jnp.bfloat16)
  cudnn = functools.partial(nn.fused_dot_product_attention,
                            implementation='cudnn')
  reference = functools.partial(nn.dot_product_attention,
                                force_fp32_for_softmax=True)
  cases = [
      (dict(is_causal=True), dict(mask=causal)),
      (dict(mask=padding, is_causal=True),
       dict(mask=nn.combine_masks(padding, causal))),
      (dict(bias=bias, mask=padding), dict(bias=bias, mask=padding)),
      (dict(local_window_size=(16, 0)),
       dict(mask=explicit_window(128, 128, 16, 0))),
  ]
  for fused_kwargs, default_kwargs in cases:
    fused = cudnn(q, k, v, **fused_kwargs)
    default = reference(q, k, v, **default_kwargs).astype(jnp.bfloat16)
    # Compared where a query has a key to attend to: cuDNN need not make
    # fully masked rows uniform.
    assert_close(fused[0], default[0], atol=5e-2)
    assert_close(fused[1, :100], default[1, :100], atol=5e-2)
