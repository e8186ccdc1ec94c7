"""Programs that flax.linen rejects or gets wrong (open flax issues), run.

Each test states the flax issue, shows what flax.linen does with the program
(raises, or computes the wrong thing), and checks liftmods' result against
a reference that Linen does compute: the same model unscanned or unlifted,
or the same arithmetic written out in JAX. The table of these issues is in
docs/coming-from-linen.md ("Linen issues that work in liftmods").
"""
import flax.errors
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
from liftmods import errors
from treecheck import assert_close, assert_identical, normal, plain

pytestmark = pytest.mark.usefixtures('fast_compiles')

KEY = jax.random.key(0)


# -- flax 3870: remat_scan over partitioned parameters --------------------------


def _partitioned_block(nn, partitioned=True):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.initializers.lecun_normal()
      if partitioned:
        init = nn.with_partitioning(init, ('embed', 'mlp'))
      return jnp.tanh(nn.Dense(3, kernel_init=init, name='dense')(x))
  return Block


def _remat_scan_model(nn, lengths, partitioned=True, **kwargs):
  block = nn.remat_scan(_partitioned_block(nn, partitioned), lengths=lengths,
                        **kwargs)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return block(name='layers')(x)
  return Model()


X3 = normal(3, (2, 3))


def test_3870_linen_remat_scan_cannot_stack_partitioned_params():
  with pytest.raises(flax.errors.PartitioningUnspecifiedError):
    _remat_scan_model(fnn, (2, 2)).init(KEY, X3)
  with pytest.raises(TypeError, match='metadata_params'):
    _remat_scan_model(fnn, (2, 2), metadata_params={
        fnn.PARTITION_NAME: 'layers'}).init(KEY, X3)


@pytest.mark.parametrize('lengths', [(4,), (2, 2)])
def test_3870_remat_scan_takes_metadata_params(lengths):
  """Same values as Linen's remat_scan of the unpartitioned block, the
  layer axes named in the spec, and the output of the layers applied one
  after the other."""
  model = _remat_scan_model(lnn, lengths,
                            metadata_params={lnn.PARTITION_NAME: 'layers'})
  variables = model.init(KEY, X3)
  kernel = variables['params']['layers']['dense']['kernel']
  assert kernel.names == ('layers',) * len(lengths) + ('embed', 'mlp')
  reference = _remat_scan_model(fnn, lengths, partitioned=False).init(KEY, X3)
  assert_identical(lnn.unbox(variables), plain(reference))

  flat = jax.tree.map(lambda a: a.reshape((4,) + a.shape[len(lengths):]),
                      lnn.unbox(variables)['params']['layers'])
  y = X3
  for i in range(4):
    layer = jax.tree.map(lambda a, i=i: a[i], flat)
    y = fnn.Dense(3).apply({'params': layer['dense']}, y)
    y = jnp.tanh(y)
  assert_close(model.apply(variables, X3), y, rtol=1e-6, atol=1e-6)


def test_3870_remat_scan_gradients_match_linen_unpartitioned():
  def loss(model, params):
    return jnp.sum(model.apply({'params': params}, X3) ** 2)

  ours = _remat_scan_model(lnn, (2, 2),
                           metadata_params={lnn.PARTITION_NAME: 'layers'})
  theirs = _remat_scan_model(fnn, (2, 2), partitioned=False)
  params = lnn.unbox(ours.init(KEY, X3))['params']
  assert_close(jax.grad(lambda p: loss(ours, p))(params),
               jax.grad(lambda p: loss(theirs, p))(params),
               rtol=1e-6, atol=1e-6)


def test_3870_remat_scan_names_each_level():
  model = _remat_scan_model(lnn, (2, 2), metadata_params=[
      {lnn.PARTITION_NAME: 'stages'}, {lnn.PARTITION_NAME: None}])
  kernel = model.init(KEY, X3)['params']['layers']['dense']['kernel']
  assert kernel.names == ('stages', None, 'embed', 'mlp')
  with pytest.raises(ValueError, match=r'2 levels; give one mapping per'):
    lnn.remat_scan(_partitioned_block(lnn), lengths=(2, 2),
                   metadata_params=[{lnn.PARTITION_NAME: 'layers'}])


def test_3870_error_names_the_transform_and_what_it_accepts():
  with pytest.raises(errors.PartitioningUnspecifiedError) as info:
    _remat_scan_model(lnn, (2, 2)).init(KEY, X3)
  assert info.value.transform == 'remat_scan'
  assert info.value.path == '/layers'
  assert 'to remat_scan at /layers,' in str(info.value)
  assert "('embed', 'mlp')" in str(info.value)

  class Vmapped(lnn.Module):
    @lnn.compact
    def __call__(self, x):
      return lnn.vmap(_partitioned_block(lnn), variable_axes={'params': 0},
                      split_rngs={'params': True})(name='v')(x)
  with pytest.raises(errors.PartitioningUnspecifiedError,
                     match='to vmap at /v,'):
    Vmapped().init(KEY, X3)

  class Plain(lnn.Module):
    def __call__(self, tree):
      return lnn.meta.add_axis(tree, 0, {})
  box = lnn.Partitioned(jnp.ones((2,)), ('embed',))
  with pytest.raises(errors.PartitioningUnspecifiedError) as info:
    Plain().apply({}, box)
  assert info.value.transform is None
  assert 'metadata_params=' not in str(info.value).split(' -- ')[1]


# -- flax 2773: map_variables(init=True) applied with another mutable collection


def _signed_dense_bn(nn, mapped):
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      sign = lambda t: jax.tree.map(jnp.sign, t)
      dense = (nn.map_variables(nn.Dense, 'params', sign, init=True)
               if mapped else nn.Dense)
      x = dense(3, name='dense')(x)
      return nn.BatchNorm(use_running_average=False, name='bn')(x)
  return Model()


def test_2773_map_variables_init_true_applies_with_mutable_batch_stats():
  x = normal(4, (4, 3))
  theirs = _signed_dense_bn(fnn, mapped=True)
  variables = theirs.init(KEY, x)
  with pytest.raises(flax.errors.ScopeCollectionNotFound):
    theirs.apply(variables, x, mutable=['batch_stats'])

  ours = _signed_dense_bn(lnn, mapped=True)
  assert_identical(ours.init(KEY, x), variables)
  y, state = ours.apply(variables, x, mutable=['batch_stats'])
  signed = dict(variables, params=jax.tree.map(jnp.sign, variables['params']))
  y_ref, state_ref = _signed_dense_bn(fnn, mapped=False).apply(
      signed, x, mutable=['batch_stats'])
  assert_identical((y, state), (y_ref, state_ref))


# -- flax 3171: nn.jit's static_argnums and arguments passed by keyword -------


def _dropout_model(nn):
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, training: bool):
      x = nn.Dense(3)(x)
      return nn.Dropout(rate=0.5, deterministic=not training)(x)
  return nn.jit(Model, static_argnums=2)


def test_3171_jit_static_argnums_cover_keyword_arguments():
  """Linen traces ``training`` when it is passed by keyword; jax.jit (and
  liftmods) treat the parameter at a static position as static either way,
  giving Linen's results for the positional call."""
  x, keys = X3, {'params': KEY, 'dropout': jax.random.key(1)}
  with pytest.raises(jax.errors.TracerBoolConversionError):
    _dropout_model(fnn)().init(keys, x, training=False)

  theirs = _dropout_model(fnn)()
  ref_vars = theirs.init(keys, x, False)
  ref_train = theirs.apply(ref_vars, x, True, rngs={'dropout': KEY})
  ref_eval = theirs.apply(ref_vars, x, False)

  ours = _dropout_model(lnn)()
  variables = ours.init(keys, x, training=False)
  assert_identical(variables, ref_vars)
  assert_identical(ours.apply(variables, x, training=True,
                              rngs={'dropout': KEY}), ref_train)
  assert_identical(ours.apply(variables, x, training=False), ref_eval)
  assert_identical(ours.apply(variables, x, True, rngs={'dropout': KEY}),
                   ref_train)


# -- nn.remat's static_argnums and arguments passed by keyword -----------------
# (no flax issue found for the keyword form; jax.checkpoint fails the same
# way, jax-ml/jax#18405)


def _remat_block(nn):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic):
      x = nn.Dense(3)(x)
      if not deterministic:
        x = nn.Dropout(0.5, deterministic=False)(x)
      return x
  return nn.remat(Block, static_argnums=(2,))


def test_remat_static_argnums_cover_keyword_arguments():
  """Linen passes the keyword on to jax.checkpoint, whose static_argnums
  then point past the positional arguments (ValueError); liftmods binds it
  statically, giving Linen's results for the positional call, gradients
  included."""
  keys = {'params': KEY, 'dropout': jax.random.key(1)}
  with pytest.raises(ValueError, match='static_argnums'):
    _remat_block(fnn)().init(keys, X3, deterministic=True)

  theirs, ours = _remat_block(fnn)(), _remat_block(lnn)()
  variables = ours.init(keys, X3, deterministic=False)
  assert_identical(variables, theirs.init(keys, X3, False))
  rngs = {'dropout': KEY}

  def loss(model, params, **kwargs):
    return jnp.sum(model.apply({'params': params}, X3, rngs=rngs, **kwargs))

  params = variables['params']
  assert_identical(jax.grad(lambda p: loss(ours, p, deterministic=False))(
      params), jax.grad(lambda p: jnp.sum(theirs.apply(
          {'params': p}, X3, False, rngs=rngs)))(params))
  assert_identical(ours.apply(variables, X3, deterministic=True),
                   theirs.apply(variables, X3, True))
