"""Differential tests: liftmods.core.nn (functional layers over a scope)
against flax.core.nn, and liftmods.core's top-level exports."""

import flax.core as fcore
import flax.core.nn as fcnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from treecheck import assert_identical, normal, plain

import liftmods.core as lcore
import liftmods.core.nn as lcnn

pytestmark = pytest.mark.usefixtures('fast_compiles')


def both(name, *args, rngs=None, mutable=False, **kwargs):
  """init then apply of ``nn.<name>`` under flax.core and liftmods.core;
  asserts identical variables and outputs."""
  rngs = rngs or {'params': jax.random.key(0), 'dropout': jax.random.key(1)}
  outs = []
  for core, nn in ((fcore, fcnn), (lcore, lcnn)):
    fn = getattr(nn, name)
    y, variables = core.init(fn)(rngs, *args, **kwargs)
    applied = core.apply(fn, mutable=mutable)(
        variables, *args, rngs={'dropout': rngs['dropout']}, **kwargs)
    outs.append((y, plain(variables), applied))
  assert_identical(outs[0], outs[1])
  return outs[1]


X = normal(0, (2, 3, 4))


@pytest.mark.parametrize('kwargs', [
    dict(features=5), dict(features=(2, 3), axis=(1, 2)),
    dict(features=3, batch_dims=(0,), bias=False),
])
def test_dense_general(kwargs):
  both('dense_general', X, **kwargs)


def test_dense_general_batch_dims_error():
  for nn, core in ((fcnn, fcore), (lcnn, lcore)):
    with pytest.raises(ValueError, match='must be consecutive leading'):
      core.init(nn.dense_general)(jax.random.key(0), X, 3, batch_dims=(1,))


def test_dense_conv_conv_transpose():
  both('dense', X, 3)
  both('dense', X, 3, bias=False, dtype=jnp.bfloat16)
  img = normal(1, (2, 5, 5, 3))
  both('conv', img, 4, (3, 3), strides=(2, 1), padding='VALID')
  both('conv', img, 6, (2, 2), feature_group_count=3, kernel_dilation=(2, 1))
  both('conv_transpose', img, 2, (3, 3), strides=(2, 2))


def test_embedding():
  idx = jnp.array([[0, 3], [2, 1]])
  outs = []
  for core, nn in ((fcore, fcnn), (lcore, lcnn)):
    def f(scope, idx):
      table = nn.embedding(scope, 4, 3)
      return table.lookup(idx), table.attend(jnp.ones((2, 3)))
    outs.append(core.init(f)(jax.random.key(0), idx))
  assert_identical(outs[0], outs[1])
  with pytest.raises(ValueError, match='must be an integer'):
    lcnn.Embedding(jnp.ones((2, 2))).lookup(jnp.ones(2))


@pytest.mark.parametrize('kwargs', [
    dict(), dict(axis=(1, 2), momentum=0.5, bias=False),
    dict(use_running_average=True, scale=False),
])
def test_batch_norm(kwargs):
  both('batch_norm', X, mutable='batch_stats', **kwargs)


def test_layer_norm_group_norm():
  both('layer_norm', X)
  both('layer_norm', X, bias=False, dtype=jnp.float16)
  img = normal(2, (2, 3, 3, 4))
  both('group_norm', img, num_groups=2)
  both('group_norm', img, num_groups=None, group_size=1, scale=False)
  for nn, core in ((fcnn, fcore), (lcnn, lcore)):
    with pytest.raises(ValueError, match='not multiple of the group size'):
      core.init(nn.group_norm)(jax.random.key(0), img, num_groups=None,
                               group_size=3)
    with pytest.raises(ValueError, match='but not both of them'):
      core.init(nn.group_norm)(jax.random.key(0), img, group_size=2)


def test_dropout():
  both('dropout', X, 0.5)
  both('dropout', X, 0.5, deterministic=True)


def test_dot_product_attention():
  q, k, v = (normal(seed, (2, 4, 2, 3)) for seed in (3, 4, 5))
  both('dot_product_attention', q, k, v)
  both('dot_product_attention', q, k, v, dropout_rate=0.3,
       broadcast_dropout=False)


@pytest.mark.parametrize('kwargs', [
    dict(num_heads=2),
    dict(num_heads=2, causal_mask=True, dropout_rate=0.2),
    dict(num_heads=1, qkv_features=6, out_features=3,
         padding_mask=jnp.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])[..., None],
         segmentation=jnp.array([[1, 1, 2, 2, 2], [1, 1, 1, 1, 1]])[..., None]),
])
def test_multi_head_attention(kwargs):
  x = normal(6, (2, 5, 4))
  both('multi_head_dot_product_attention', x, None, **kwargs)


def test_multi_head_attention_decoding_cache():
  x = normal(7, (2, 3, 4))
  results = []
  for core, nn in ((fcore, fcnn), (lcore, lcnn)):
    fn = lambda scope, x: nn.multi_head_dot_product_attention(
        scope, x, None, num_heads=2, causal_mask=True, cache=True)
    _, variables = core.init(fn)(jax.random.key(0), x)
    entry = variables['cache']['entry']((2, 3), jnp.float32)
    variables = {'params': variables['params'], 'cache': {'entry': entry}}
    steps = []
    for t in range(3):
      y, updated = core.apply(fn, mutable='cache')(variables, x[:, t:t + 1])
      variables = {'params': variables['params'], **updated}
      steps.append((y, updated['cache']['entry'].key,
                    updated['cache']['entry'].i))
    results.append(steps)
  assert_identical(results[0], results[1])


def test_core_exports_are_the_lifted_transforms():
  from liftmods.core import lift, meta
  for name in ('scan', 'vmap', 'jit', 'remat', 'remat_scan', 'while_loop',
               'custom_vjp', 'vjp', 'jvp', 'broadcast'):
    assert getattr(lcore, name) is getattr(lift, name), name
  for name in ('AxisMetadata', 'map_axis_meta', 'unbox'):
    assert getattr(lcore, name) is getattr(meta, name), name
  assert lcore.tracers.current_trace() == lcore.tracers.current_trace()
  assert lcore.check_trace_level(None) is None


