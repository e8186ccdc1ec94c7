"""Differential tests: liftmods.core against flax.core (the oracle).

The same scope function is run through both implementations; variable trees
must match in structure, dtype and shape, and values must be bit-identical.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import core as fcore
from flax.core import meta as fmeta
from flax.core.scope import LazyRng

from liftmods import core as lcore
from liftmods.core import meta as lmeta
import treecheck

pytestmark = pytest.mark.usefixtures('fast_compiles')

SEEDS = [0, 1, 2, 42]
KEY_MAKERS = {'typed': jax.random.key, 'raw': jax.random.PRNGKey}

init_normal = jax.nn.initializers.normal(0.5)
init_lecun = jax.nn.initializers.lecun_normal()
init_uniform = jax.nn.initializers.uniform(2.0)
init_zeros = jax.nn.initializers.zeros


@pytest.fixture(params=SEEDS, ids=lambda s: f'seed{s}')
def seed(request):
  return request.param


@pytest.fixture(params=sorted(KEY_MAKERS))
def make_key(request):
  return KEY_MAKERS[request.param]


def _as_bits(x):
  """Keys become their raw uint32 data; everything else a numpy array."""
  if hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype,
                                                     jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


def assert_identical(expected, actual):
  """The shared bit-exact check with container types, and leaves of one kind
  on both sides (jax arrays, or the same Python type)."""
  treecheck.assert_identical(actual, expected, same_containers=True)
  for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(expected),
                          jax.tree_util.tree_leaves(actual)):
    assert type(e) is type(a) or (isinstance(e, jax.Array) and
                                  isinstance(a, jax.Array)), (
                                      jax.tree_util.keystr(path))


def run_init_both(fn, rngs, *args, **kwargs):
  f_out = fcore.init(fn)(rngs, *args, **kwargs)
  l_out = lcore.init(fn)(rngs, *args, **kwargs)
  return f_out, l_out


# -- scope functions shared by both implementations ----------------------------


def dense(scope, x, features):
  kernel = scope.param('kernel', init_lecun, (x.shape[-1], features))
  bias = scope.param('bias', init_normal, (features,))
  return x @ kernel + bias


def mlp(scope, x, widths=(5, 4, 3)):
  for i, width in enumerate(widths):
    layer = scope.push(f'layer_{i}')
    x = dense(layer.push('dense'), x, width)
    scale = layer.push('norm').param('scale', init_uniform, (width,))
    x = jax.nn.relu(x) * scale
  return x


def dropout(scope, x, rate=0.5):
  keep = jax.random.bernoulli(scope.make_rng('dropout'), 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


def two_rng_model(scope, x):
  """'params' and 'dropout' drawn at several depths, a child pushed twice."""
  x = dense(scope.push('in'), x, 6)
  x = dropout(scope, x)
  block = scope.push('block')
  x = dropout(block, x)
  x = dense(block.push('inner'), x, 6)
  x = dropout(block.push('inner', reuse=True), x)  # same child, continued rng
  again = scope.push('block', reuse=True)
  x = dropout(again, x)  # continues block's 'dropout' counter
  extra = again.param('extra', init_normal, (6,))  # continues 'params' too
  x = x + extra
  deep = again.push('inner', reuse=True).push('deep')
  x = dropout(deep, x)
  x = dense(deep, x, 2)
  keys = {
      'root': scope.make_rng('dropout'),
      'block': block.make_rng('dropout'),
      'deep': deep.make_rng('dropout'),
  }
  return x, keys


def batch_norm(scope, x, momentum=0.9):
  mean = scope.variable('batch_stats', 'mean', jnp.zeros, x.shape[-1:])
  var = scope.variable('batch_stats', 'var', jnp.ones, x.shape[-1:])
  count = scope.variable('batch_stats', 'count', lambda: jnp.zeros((),
                                                                   jnp.int32))
  scale = scope.param('scale', init_uniform, x.shape[-1:])
  if scope.is_mutable_collection('batch_stats'):
    m = x.mean(axis=0)
    v = x.var(axis=0)
    mean.value = momentum * mean.value + (1 - momentum) * m
    var.value = momentum * var.value + (1 - momentum) * v
    count.value = count.value + 1
  return (x - mean.value) / jnp.sqrt(var.value + 1e-5) * scale


def bn_model(scope, x):
  x = dense(scope.push('dense0'), x, 4)
  x = batch_norm(scope.push('bn0'), x)
  x = dropout(scope.push('drop'), x, 0.25)
  x = dense(scope.push('dense1'), x, 3)
  return batch_norm(scope.push('bn1'), x)


def _x(seed, shape=(4, 3)):
  return jax.random.normal(jax.random.key(1000 + seed), shape)


# -- tests ---------------------------------------------------------------------


def test_dense(seed, make_key):
  x = _x(seed)
  (f_y, f_vars), (l_y, l_vars) = run_init_both(dense, make_key(seed), x, 5)
  assert set(l_vars) == {'params'}
  assert_identical(f_vars, l_vars)
  assert_identical(f_y, l_y)
  # apply with the oracle's variables gives the same output too.
  assert_identical(fcore.apply(dense)(f_vars, x, 5),
                   lcore.apply(dense)(f_vars, x, 5))


def test_mlp_nested_children(seed, make_key):
  x = _x(seed)
  (f_y, f_vars), (l_y, l_vars) = run_init_both(mlp, make_key(seed), x)
  assert set(l_vars['params']) == {'layer_0', 'layer_1', 'layer_2'}
  assert set(l_vars['params']['layer_1']) == {'dense', 'norm'}
  assert_identical(f_vars, l_vars)
  assert_identical(f_y, l_y)
  assert_identical(fcore.apply(mlp)(f_vars, x), lcore.apply(mlp)(l_vars, x))


def test_two_rng_sequences(seed, make_key):
  x = _x(seed, (3, 4))
  rngs = {'params': make_key(seed), 'dropout': make_key(seed + 7)}
  (f_out, f_vars), (l_out, l_vars) = run_init_both(two_rng_model, rngs, x)
  assert_identical(f_vars, l_vars)
  assert_identical(f_out, l_out)
  # apply with a fresh dropout key: same masks in both.
  apply_rngs = {'dropout': make_key(seed + 100)}
  f_y = fcore.apply(two_rng_model)(f_vars, x, rngs=apply_rngs)
  l_y = lcore.apply(two_rng_model)(l_vars, x, rngs=apply_rngs)
  assert_identical(f_y, l_y)


def test_rng_fallback_to_params(seed, make_key):
  # Only a 'params' rng: make_rng('dropout') falls back to it in both.
  x = _x(seed, (3, 4))
  (f_out, f_vars), (l_out, l_vars) = run_init_both(two_rng_model,
                                                   make_key(seed), x)
  assert_identical(f_vars, l_vars)
  assert_identical(f_out, l_out)


def test_batch_stats_mutable_apply(seed, make_key):
  x = _x(seed, (8, 3))
  rngs = {'params': make_key(seed), 'dropout': make_key(seed + 1)}
  (f_y, f_vars), (l_y, l_vars) = run_init_both(bn_model, rngs, x)
  assert set(l_vars) == {'params', 'batch_stats'}
  assert_identical(f_vars, l_vars)
  assert_identical(f_y, l_y)

  x2 = x * 2.0 + 1.0
  apply_rngs = {'dropout': make_key(seed + 2)}
  f_y2, f_mut = fcore.apply(bn_model, mutable=['batch_stats'])(
      f_vars, x2, rngs=apply_rngs)
  l_y2, l_mut = lcore.apply(bn_model, mutable=['batch_stats'])(
      l_vars, x2, rngs=apply_rngs)
  assert set(l_mut) == {'batch_stats'}
  assert_identical(f_mut, l_mut)
  assert_identical(f_y2, l_y2)
  assert int(l_mut['batch_stats']['bn0']['count']) == 2
  # The stats actually moved.
  assert not np.array_equal(l_mut['batch_stats']['bn1']['mean'],
                            l_vars['batch_stats']['bn1']['mean'])

  # A second step from the updated stats; immutable evaluation afterwards.
  step2_vars = {'params': l_vars['params'], **l_mut}
  f_y3, f_mut3 = fcore.apply(bn_model, mutable=['batch_stats'])(
      step2_vars, x, rngs=apply_rngs)
  l_y3, l_mut3 = lcore.apply(bn_model, mutable=['batch_stats'])(
      step2_vars, x, rngs=apply_rngs)
  assert_identical(f_mut3, l_mut3)
  assert_identical(f_y3, l_y3)
  assert_identical(fcore.apply(bn_model)(step2_vars, x, rngs=apply_rngs),
                   lcore.apply(bn_model)(step2_vars, x, rngs=apply_rngs))


def test_mutable_true_apply_returns_all_collections(seed):
  x = _x(seed, (8, 3))
  rngs = {'params': jax.random.key(seed), 'dropout': jax.random.key(seed + 1)}
  _, variables = fcore.init(bn_model)(rngs, x)
  f = fcore.apply(bn_model, mutable=True)(variables, x, rngs=rngs)
  l = lcore.apply(bn_model, mutable=True)(variables, x, rngs=rngs)
  assert_identical(f, l)


def test_typed_and_raw_keys_give_same_bits(seed):
  x = _x(seed, (3, 4))
  rngs_typed = {'params': jax.random.key(seed),
                'dropout': jax.random.key(seed + 7)}
  rngs_raw = {'params': jax.random.PRNGKey(seed),
              'dropout': jax.random.PRNGKey(seed + 7)}
  (_, vars_typed), (_, vars_raw) = (lcore.init(two_rng_model)(rngs_typed, x),
                                    lcore.init(two_rng_model)(rngs_raw, x))
  assert_identical(vars_typed, vars_raw)
  _, f_vars_raw = fcore.init(two_rng_model)(rngs_raw, x)
  assert_identical(f_vars_raw, vars_typed)


def _default_names(scope):
  a = scope.push(prefix='block_')
  b = scope.push(prefix='block_')
  c = scope.push()
  scope.param('dense0', init_normal, (2,))
  d = scope.push(prefix='dense')
  for s in (a, b, c, d):
    s.param('w', init_normal, (3,))
  return tuple(s.name for s in (a, b, c, d))


def test_default_names(seed, make_key):
  (f_names, f_vars), (l_names, l_vars) = run_init_both(_default_names,
                                                       make_key(seed))
  assert l_names == f_names == ('block_0', 'block_1', '0', 'dense1')
  assert_identical(f_vars, l_vars)


def _rewound_model(scope):
  a = scope.param('a', init_normal, (2,))
  k1 = scope.make_rng('dropout')
  again = scope.rewound()
  a2 = again.param('a', init_normal, (2,))  # stored value, no new key
  k2 = again.make_rng('dropout')
  fresh = scope.rewound(rewind_rngs=True)
  k3 = fresh.make_rng('dropout')
  child = fresh.push('c')
  b = child.param('b', init_normal, (2,))
  return a, a2, k1, k2, k3, b


def test_rewound_rng_counters(seed, make_key):
  rngs = {'params': make_key(seed), 'dropout': make_key(seed + 3)}
  (f_out, f_vars), (l_out, l_vars) = run_init_both(_rewound_model, rngs)
  assert_identical(f_vars, l_vars)
  assert_identical(f_out, l_out)
  a, a2, k1, k2, k3, _ = l_out
  np.testing.assert_array_equal(a, a2)
  assert not np.array_equal(_as_bits(k1), _as_bits(k2))
  np.testing.assert_array_equal(_as_bits(k1), _as_bits(k3))


def _many_rngs(scope):
  child = scope.push('ünïcode-名前')
  keys = [child.make_rng('params') for _ in range(258)]
  return [keys[i] for i in (0, 126, 127, 128, 254, 255, 256, 257)]


def test_large_counters_and_unicode_names(make_key):
  # Counters above 255 hash as two bytes; non-ASCII names hash as UTF-8.
  (f_keys, _), (l_keys, _) = run_init_both(_many_rngs, make_key(5))
  assert_identical(f_keys, l_keys)


def _partitioned(scope, x, *, meta_mod):
  init_fn = meta_mod.with_partitioning(init_lecun, ('embed', 'mlp'))
  k = scope.push('proj').param('kernel', init_fn, (x.shape[-1], 3))
  return x @ k


def test_partitioned_params(seed, make_key):
  x = _x(seed)
  f_y, f_vars = fcore.init(_partitioned)(make_key(seed), x, meta_mod=fmeta)
  l_y, l_vars = lcore.init(_partitioned)(make_key(seed), x, meta_mod=lmeta)
  f_box = f_vars['params']['proj']['kernel']
  l_box = l_vars['params']['proj']['kernel']
  assert isinstance(l_box, lmeta.Partitioned)
  assert l_box.names == f_box.names == ('embed', 'mlp')
  assert_identical(f_box.value, l_box.value)
  assert_identical(f_y, l_y)
  assert_identical(fmeta.unbox(f_vars), lmeta.unbox(l_vars))


def test_flax_lazy_rng_accepted(seed):
  lazy = LazyRng.create(jax.random.key(seed), 'outer', 3)

  def f(scope):
    return scope.push('x').make_rng('params'), scope.make_rng('params')

  f_keys = fcore.apply(f)({}, rngs={'params': lazy})
  l_keys = lcore.apply(f)({}, rngs={'params': lazy})
  assert_identical(f_keys, l_keys)


def test_variable_only_collection_and_get_put(seed):
  def f(scope):
    c = scope.push('c')
    v = c.variable('cache', 'k', jnp.arange, 3)
    v.value = v.value * (seed + 1)
    c.put_variable('cache', 'j', c.get_variable('cache', 'k') + 1)
    return (scope.has_variable('cache', 'c'), c.has_variable('cache', 'j'),
            scope.get_variable('cache', 'missing', -1))

  f_out, f_vars = fcore.init(f)(jax.random.key(seed))
  l_out, l_vars = lcore.init(f)(jax.random.key(seed))
  assert f_out == l_out == (True, True, -1)
  assert_identical(f_vars, l_vars)


# -- the same mistakes raise the same-named errors -------------------------------

_W3 = {'params': {'d': {'w': jnp.zeros(3)}}}


def _err_shape(c):
  c.apply(lambda s: s.push('d').param('w', init_zeros, (4,)))(_W3)


def _err_param_missing(c):
  c.apply(lambda s: s.push('d').param('v', init_zeros, (3,)))(_W3)


def _err_collection_missing(c):
  c.apply(lambda s: s.push('d').variable('batch_stats', 'm'))(_W3)


def _err_variable_missing(c):
  c.apply(lambda s: s.variable('stats', 'n'))({'stats': {'m': 0}})


def _err_modify_immutable(c):
  c.apply(lambda s: s.put_variable('params', 'x', 1))(_W3)


def _err_params_params(c):
  c.apply(lambda s: 0)({'params': _W3})


def _err_rng_missing(c):
  c.apply(lambda s: s.push('d').make_rng('dropout'))(_W3)


def _err_invalid_scope(c):
  kept = []
  c.apply(lambda s: kept.append(s))(_W3)
  kept[0].push('late')


@pytest.mark.parametrize('mistake', [
    _err_shape, _err_param_missing, _err_collection_missing,
    _err_variable_missing, _err_modify_immutable, _err_params_params,
    _err_rng_missing, _err_invalid_scope,
], ids=lambda f: f.__name__[5:])
def test_same_error_class_as_flax(mistake):
  with pytest.raises(Exception) as f_info:
    mistake(fcore)
  with pytest.raises(Exception) as l_info:
    mistake(lcore)
  f_type, l_type = type(f_info.value), type(l_info.value)
  assert f_type.__module__ == 'flax.errors'
  assert l_type.__module__ == 'liftmods.errors'
  assert l_type.__name__ == f_type.__name__
