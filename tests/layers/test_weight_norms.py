"""Differential tests: WeightNorm, SpectralNorm and BatchApply against
flax.linen (variable trees, bit-identical init, outputs, stats updates)."""

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from treecheck import assert_identical, plain

import liftmods as lnn

pytestmark = pytest.mark.usefixtures('fast_compiles')


def rand(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape)


def init_both(build, *args, **kwargs):
  out = []
  for nn in (fnn, lnn):
    model = build(nn)
    out.append((model, model.init(jax.random.key(0), *args, **kwargs)))
  assert_identical(out[0][1], out[1][1])
  return out


WN_CASES = {
    'dense': (lambda nn: nn.WeightNorm(nn.Dense(3)), (2, 4)),
    'dense_all_params': (lambda nn: nn.WeightNorm(
        nn.Dense(3), variable_filter=None), (2, 4)),
    'no_scale_feature_none': (lambda nn: nn.WeightNorm(
        nn.Dense(3), use_scale=False, feature_axes=None), (2, 4)),
    'conv_feature_axes': (lambda nn: nn.WeightNorm(
        nn.Conv(3, (2,)), feature_axes=(-2, -1)), (1, 5, 2)),
    'bf16_dtype': (lambda nn: nn.WeightNorm(
        nn.Dense(3), dtype=jnp.bfloat16, param_dtype=jnp.float16), (2, 4)),
}


@pytest.mark.parametrize('case', sorted(WN_CASES))
def test_weight_norm(case):
  build, shape = WN_CASES[case]
  x = rand(1, shape)
  (fm, fv), (lm, lv) = init_both(build, x)
  assert_identical(fm.apply(fv, x), lm.apply(lv, x))
  grads = [jax.grad(lambda v, m=m: m.apply(v, x).sum())(v)
           for m, v in ((fm, fv), (lm, lv))]
  for a, b in zip(jax.tree_util.tree_leaves(grads[0]),
                  jax.tree_util.tree_leaves(grads[1])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_weight_norm_inside_compact_parent():
  def build(nn):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.WeightNorm(nn.Dense(4))(x)
        return nn.WeightNorm(nn.Dense(2), name='out')(nn.relu(x))

    return Net()

  x = rand(2, (3, 5))
  (fm, fv), (lm, lv) = init_both(build, x)
  assert_identical(fm.apply(fv, x), lm.apply(lv, x))


SN_CASES = {
    'dense': (lambda nn: nn.SpectralNorm(nn.Dense(3)), (2, 4)),
    'conv_3d_kernel': (lambda nn: nn.SpectralNorm(nn.Conv(3, (2,)),
                                                  n_steps=3), (1, 5, 2)),
    'other_collection': (lambda nn: nn.SpectralNorm(
        nn.Dense(3), collection_name='spectral', param_dtype=jnp.float16),
                         (2, 4)),
}


@pytest.mark.parametrize('case', sorted(SN_CASES))
def test_spectral_norm_update_stats_over_several_calls(case):
  build, shape = SN_CASES[case]
  x = rand(3, shape)
  (fm, fv), (lm, lv) = init_both(build, x, update_stats=False)
  col = fm.collection_name
  assert set(fv[col]) == set(lv[col])
  for step in range(3):
    fy, fu = fm.apply(fv, x, update_stats=True, mutable=[col])
    ly, lu = lm.apply(lv, x, update_stats=True, mutable=[col])
    assert_identical(fy, ly)
    assert_identical(fu, lu)
    fv, lv = {**fv, **fu}, {**lv, **lu}
  # Without update_stats nothing changes.
  _, frozen = lm.apply(lv, x, update_stats=False, mutable=[col])
  assert_identical(lv[col], frozen[col])


def test_spectral_norm_rejects_non_matrix_when_asked():
  x = rand(4, (1, 5, 2))
  for nn in (fnn, lnn):
    model = nn.SpectralNorm(nn.Conv(3, (2,)), error_on_non_matrix=True)
    with pytest.raises(ValueError, match='Input is 3D but error_on_non_'):
      model.init(jax.random.key(0), x, update_stats=True)


def test_batch_apply_matches_linen():
  x = rand(5, (2, 3, 4))
  scale = rand(6, (4,))
  for nn in (fnn, lnn):
    dense = nn.Dense(5)
    variables = dense.init(jax.random.key(0), x[0])
    apply = nn.BatchApply(lambda a, s: (dense.apply(variables, a * s), a),
                          num_dims=2)
    out = apply(x, s=scale)
    if nn is fnn:
      expected = out
  assert_identical(expected, out)
  assert out[0].shape == (2, 3, 5)
  for nn in (fnn, lnn):
    with pytest.raises(ValueError, match='at least one input with ndim >= 4'):
      nn.BatchApply(jnp.sum, num_dims=4)(x)
  assert lnn.batch_apply.merge_leading_dims(x, 3).shape == (24,)
  assert not lnn.batch_apply.ndim_at_least(1.0, 1)


