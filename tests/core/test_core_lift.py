"""Differential tests of liftmods.core.lift against flax.core.lift.

Each scope function is written once as ``make(lift)`` and built against both
libraries; init must give the same variable tree (structure, shapes, dtypes)
with bit-identical values, apply the same outputs and gradients.
"""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import apply as fapply
from flax.core import axes_scan as faxes_scan
from flax.core import init as finit
from flax.core import lift as flift
from flax.core import meta as fmeta

from liftmods.core import apply as lapply
from liftmods.core import init as linit
from liftmods.core import lift as llift
from liftmods.core import meta as lmeta
import treecheck

pytestmark = pytest.mark.usefixtures('fast_compiles')

FLAX = dict(lift=flift, init=finit, apply=fapply, meta=fmeta,
            broadcast=faxes_scan.broadcast)
OURS = dict(lift=llift, init=linit, apply=lapply, meta=lmeta,
            broadcast=llift.broadcast)

lecun = jax.nn.initializers.lecun_normal()
normal = jax.nn.initializers.normal(0.5)


# Container types must match too.
assert_identical = functools.partial(treecheck.assert_identical,
                                     same_containers=True)


def _float_sum(tree):
  return sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(tree)
             if jnp.issubdtype(jnp.result_type(x), jnp.floating))


def differential(make, *args, rngs=None, init_mutable=True, apply_rngs=None,
                 apply_mutable=False, grad=True):
  """Runs ``make(lib)`` through init, apply and grad of both libraries.

  Runs eagerly: that is where bit-identity of the keys and values is
  checked without XLA fusion in the way.
  """
  rngs = rngs if rngs is not None else {'params': jax.random.key(0)}
  fns = {'flax': make(FLAX), 'ours': make(OURS)}
  inits = {'flax': finit, 'ours': linit}
  applies = {'flax': fapply, 'ours': lapply}
  results = {}
  for lib in ('flax', 'ours'):
    fn, init, apply = fns[lib], inits[lib], applies[lib]
    out, variables = init(fn, mutable=init_mutable)(rngs, *args)
    results[lib] = [out, variables]
  f_vars = results['flax'][1]
  with_grad = grad and 'params' in f_vars
  for lib in ('flax', 'ours'):
    applied = applies[lib](fns[lib], mutable=apply_mutable)
    if not with_grad:
      results[lib].append(applied(f_vars, *args, rngs=apply_rngs))
      continue

    def loss(params, applied=applied):
      out = applied({**f_vars, 'params': params}, *args, rngs=apply_rngs)
      return _float_sum(out), out

    # One differentiated run gives both the apply output and the gradients.
    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(
        f_vars['params'])
    results[lib] += [out, grads]
  what = ['init output', 'variables', 'apply output', 'gradients']
  for name, expected, actual in zip(what, results['flax'], results['ours']):
    try:
      assert_identical(expected, actual)
    except AssertionError as err:
      raise AssertionError(f'{name} differ: {err}') from None
  return results['ours'][0], results['ours'][1]


def dense(scope, x, features=3):
  kernel = scope.param('kernel', normal, (x.shape[-1], features))
  bias = scope.param('bias', normal, (features,))
  return x @ kernel + bias


def noisy_dense(scope, x, features=3):
  y = dense(scope, x, features)
  noise = jax.random.uniform(scope.make_rng('dropout'), y.shape)
  return y * noise


RNGS2 = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}
APPLY_RNGS = {'dropout': jax.random.key(7)}


# -- vmap -----------------------------------------------------------------------------


@pytest.mark.parametrize('axes,split', [
    ({'params': 0}, True), ({'params': 0}, False), ({'params': None}, False),
    ({'params': 1}, True)])
def test_vmap_variable_axes(axes, split):
  x = jnp.arange(12.).reshape(4, 3) / 7

  def make(lib):
    def f(scope, x):
      vdense = lib['lift'].vmap(dense, variable_axes=axes,
                                split_rngs={'params': split})
      return vdense(scope.push('stack'), x)
    return f

  _, variables = differential(make, x)
  kernel = variables['params']['stack']['kernel']
  expected = {0: (4, 3, 3), None: (3, 3), 1: (3, 4, 3)}[axes['params']]
  assert kernel.shape == expected


def test_vmap_in_out_axes_trees_and_dropout():
  x = jnp.arange(24.).reshape(3, 4, 2) / 10
  bias = jnp.arange(3.)

  def make(lib):
    def body(scope, pair, b):
      a, c = pair
      y = noisy_dense(scope.push('d'), a + c) + b[0]
      return {'y': y, 'aux': a.sum()}
    def f(scope, x, b):
      vf = lib['lift'].vmap(
          body, variable_axes={'params': 0},
          split_rngs={'params': True, 'dropout': True},
          in_axes=((1, 1), None), out_axes={'y': 1, 'aux': 0})
      return vf(scope, (x, x * 2), b)
    return f

  out, _ = differential(make, x, bias, rngs=RNGS2, apply_rngs=APPLY_RNGS)
  assert out['y'].shape == (3, 4, 3) and out['aux'].shape == (4,)


def test_vmap_axis_name_and_axis_size():
  def make(lib):
    def body(scope, x):
      w = scope.param('w', normal, (2,))
      return jax.lax.psum(x * w, 'batch')
    def f(scope, x):
      return lib['lift'].vmap(body, variable_axes={'params': None},
                              split_rngs={'params': False}, in_axes=None,
                              axis_size=3, axis_name='batch')(scope, x)
    return f

  out, _ = differential(make, jnp.ones(2))
  assert out.shape == (3, 2)


def test_vmap_partitioned_metadata_gains_axis_name():
  def make(lib):
    def body(scope, x):
      init = lib['meta'].with_partitioning(lecun, ('embed', 'mlp'))
      w = scope.param('w', init, (x.shape[-1], 2))
      return x @ w
    def f(scope, x):
      return lib['lift'].vmap(
          body, variable_axes={'params': 0}, split_rngs={'params': True},
          metadata_params={'partition_name': 'layers'})(scope, x)
    return f

  x = jnp.ones((4, 3))
  f_out, f_vars = finit(make(FLAX))(jax.random.key(0), x)
  l_out, l_vars = linit(make(OURS))(jax.random.key(0), x)
  f_box, l_box = f_vars['params']['w'], l_vars['params']['w']
  assert isinstance(l_box, lmeta.Partitioned)
  assert l_box.names == f_box.names == ('layers', 'embed', 'mlp')
  assert_identical(f_box.value, l_box.value)
  assert_identical(f_out, l_out)
  # apply removes and re-adds the axis on the way through.
  assert_identical(fapply(make(FLAX))(f_vars, x),
                   lapply(make(OURS))(l_vars, x))


# -- scan -----------------------------------------------------------------------------


def test_scan_params_and_dropout_split_with_counter_carry():
  xs = jnp.arange(15.).reshape(5, 3) / 10

  def make(lib):
    def body(scope, c, x):
      count = scope.variable('counter', 'n', jnp.zeros, (), jnp.int32)
      count.value += 1
      h = noisy_dense(scope.push('layer'), c + x)
      return h, h.sum()
    def f(scope, xs):
      scope.variable('counter', 'n', jnp.zeros, (), jnp.int32)
      scanned = lib['lift'].scan(
          body, variable_axes={'params': 0}, variable_carry='counter',
          split_rngs={'params': True, 'dropout': True})
      c, ys = scanned(scope, jnp.zeros(3), xs)
      after = jax.random.uniform(scope.make_rng('dropout'), ())
      return c, ys, after
    return f

  _, variables = differential(make, xs, rngs=RNGS2, apply_rngs=APPLY_RNGS,
                              apply_mutable=['counter'])
  assert variables['counter']['n'] == 5
  assert variables['params']['layer']['kernel'].shape == (5, 3, 3)


def test_scan_repeated_applies_keep_flax_keys():
  """Later traces of one scan site (which may skip the invariant trace)
  draw the same keys and leave the same counters as flax."""
  def make(lib):
    def body(scope, c, x):
      h = noisy_dense(scope, c + x)
      return h, ()
    def f(scope, xs):
      c, _ = lib['lift'].scan(body, variable_axes={'params': 0},
                              split_rngs={'params': True, 'dropout': True})(
                                  scope.push('s'), jnp.zeros(3), xs)
      return c, jax.random.uniform(scope.make_rng('dropout'), ())
    return f

  xs = jnp.ones((2, 3))
  _, variables = finit(make(FLAX))(RNGS2, xs)
  for seed in (3, 3, 4):
    rngs = {'dropout': jax.random.key(seed)}
    assert_identical(fapply(make(FLAX))(variables, xs, rngs=rngs),
                     lapply(make(OURS))(variables, xs, rngs=rngs))


def test_scan_broadcast_params_and_broadcast_input():
  xs = jnp.arange(8.).reshape(4, 2) / 3

  def make(lib):
    def body(scope, c, x, shared):
      h = jnp.tanh(dense(scope.push('cell'), jnp.concatenate([c, x]) + shared,
                         features=2))
      return h, h * 2
    def f(scope, xs, shared):
      scanned = lib['lift'].scan(
          body, variable_broadcast='params', split_rngs={'params': False},
          in_axes=(0, lib['broadcast']))
      return scanned(scope, jnp.zeros(2), xs, shared)
    return f

  _, variables = differential(make, xs, jnp.float32(0.5))
  assert variables['params']['cell']['kernel'].shape == (4, 2)


def test_scan_reverse_unroll_and_out_axis():
  xs = jnp.arange(18.).reshape(3, 6) / 9  # scanned along axis 1

  def make(lib):
    def body(scope, c, x):
      h = dense(scope, x[None], features=2)[0]
      return c + h, h
    def f(scope, xs):
      return lib['lift'].scan(
          body, variable_axes={'params': 0}, split_rngs={'params': True},
          in_axes=1, out_axes=1, reverse=True, unroll=2)(
              scope, jnp.zeros(2), xs)
    return f

  (c, ys), _ = differential(make, xs)
  assert ys.shape == (2, 6)


def test_scan_length_without_xs_and_broadcast_output():
  def make(lib):
    def body(scope, c, shift):
      w = scope.param('w', normal, (2,))
      return c * w + shift, shift * 2
    def f(scope, c, shift):
      return lib['lift'].scan(
          body, variable_axes={'params': 0}, split_rngs={'params': True},
          length=3, in_axes=lib['broadcast'], out_axes=lib['broadcast'])(
              scope, c, shift)
    return f

  (c, doubled), variables = differential(make, jnp.ones(2), jnp.float32(3))
  assert variables['params']['w'].shape == (3, 2)
  assert doubled == 6.0


def test_scan_nested_vmap():
  xs = jnp.arange(24.).reshape(3, 4, 2) / 10

  def make(lib):
    lift = lib['lift']
    def layer(scope, x):
      return jnp.tanh(noisy_dense(scope, x, features=2))
    def body(scope, c, x):
      v = lift.vmap(layer, variable_axes={'params': 0},
                    split_rngs={'params': True, 'dropout': True})
      h = v(scope.push('v'), x + c)
      return h, h.sum(-1)
    def f(scope, xs):
      return lift.scan(body, variable_axes={'params': 0},
                       split_rngs={'params': True, 'dropout': True})(
                           scope, jnp.zeros((4, 2)), xs)
    return f

  _, variables = differential(make, xs, rngs=RNGS2, apply_rngs=APPLY_RNGS)
  assert variables['params']['v']['kernel'].shape == (3, 4, 2, 2)


def test_scan_partitioned_metadata():
  def make(lib):
    def body(scope, c):
      init = lib['meta'].with_partitioning(normal, ('embed',))
      w = scope.param('w', init, (2,))
      return c * w, ()
    def f(scope, c):
      return lib['lift'].scan(
          body, variable_axes={'params': 0}, split_rngs={'params': True},
          length=3, in_axes=(), metadata_params={'partition_name': 'layers'})(
              scope, c)
    return f

  c = jnp.ones(2)
  _, f_vars = finit(make(FLAX))(jax.random.key(0), c)
  _, l_vars = linit(make(OURS))(jax.random.key(0), c)
  assert l_vars['params']['w'].names == ('layers', 'embed')
  assert f_vars['params']['w'].names == ('layers', 'embed')
  assert_identical(f_vars['params']['w'].value, l_vars['params']['w'].value)
  assert_identical(fapply(make(FLAX))(f_vars, c), lapply(make(OURS))(l_vars, c))


def test_remat_scan():
  """Nested scans with remat inside scan."""
  def make(lib):
    def body(scope, x):
      return jnp.tanh(dense(scope, x, features=2))
    def f(scope, x):
      return lib['lift'].remat_scan(body, lengths=(2, 3))(scope, x)
    return f

  _, variables = differential(make, jnp.ones(2))
  assert variables['params']['kernel'].shape == (2, 3, 2, 2)


# -- checkpoint / jit -------------------------------------------------------------------


def test_checkpoint_static_argnums_and_kwargs():
  def make(lib):
    def body(scope, x, features, scale=1.0):
      return noisy_dense(scope, x, features) * scale
    def f(scope, x):
      rematted = lib['lift'].checkpoint(body, static_argnums=(1,),
                                        prevent_cse=False)
      return rematted(scope.push('r'), x, 4, scale=2.0)
    return f

  out, _ = differential(make, jnp.ones((2, 3)), rngs=RNGS2,
                        apply_rngs=APPLY_RNGS)
  assert out.shape == (2, 4)


def _jit_model(lib, jitted):
  def sub(scope, hash_key, x):
    return noisy_dense(scope, x)

  if jitted is None:
    jitted = lib['lift'].jit(sub)

  def f(scope, x):
    y = jitted(scope.push('a'), ('jit-test', id(jitted)), x)
    after = jax.random.uniform(scope.make_rng('dropout'), ())
    return y, after
  return f


def test_jit_matches_flax():
  x = jnp.ones((2, 3))
  differential(lambda lib: _jit_model(lib, None), x, rngs=RNGS2,
               apply_rngs=APPLY_RNGS)


def test_jit_cache_hits_and_replays_rng_counters():
  traces = []

  def sub(scope, hash_key, x):
    traces.append(1)
    return noisy_dense(scope, x)

  jitted = llift.jit(sub)
  plain = lambda scope, hash_key, x: noisy_dense(scope, x)  # noqa: E731

  def model(fn):
    def f(scope, x):
      y = fn(scope.push('a'), 'k', x)
      return y, jax.random.uniform(scope.make_rng('dropout'), ())
    return f

  x = jnp.ones((2, 3))
  _, variables = linit(model(jitted))(RNGS2, x)
  assert len(traces) == 1
  ref = lapply(model(plain))(variables, x, rngs=APPLY_RNGS)
  for i in range(3):
    out = lapply(model(jitted))(variables, x, rngs=APPLY_RNGS)
    assert len(traces) == 2, 'apply should trace once, then hit the cache'
    # The counter after the jitted call is advanced the same way on hits.
    assert_identical(ref[1], out[1])
  lapply(model(jitted))(variables, jnp.ones((5, 3)), rngs=APPLY_RNGS)
  assert len(traces) == 3  # a new shape retraces


def test_jit_static_and_donate_argnums():
  # *args: flax checks static_argnums against this signature with an offset.
  def sub(scope, hash_key, *args):
    x, features = args
    return dense(scope, x, features)

  def make(lib):
    jitted = lib['lift'].jit(sub, static_argnums=(2,))
    def f(scope, x):
      return jitted(scope, ('static', id(jitted)), x, 4)
    return f

  out, _ = differential(make, jnp.ones((2, 3)))
  assert out.shape == (2, 4)


def test_jit_mutable_collection_roundtrip():
  def sub(scope, hash_key, x):
    count = scope.variable('stats', 'count', lambda: jnp.zeros((), jnp.int32))
    count.value += 1
    return dense(scope, x)

  def make(lib):
    jitted = lib['lift'].jit(sub)
    def f(scope, x):
      return jitted(scope.push('j'), ('mut', id(jitted)), x)
    return f

  _, variables = differential(make, jnp.ones((2, 3)), apply_mutable=['stats'])
  assert variables['stats']['j']['count'] == 1


def test_fold_rngs_matches_flax():
  def sub(scope, hash_key, x):
    return noisy_dense(scope, x)

  def make(lib):
    folded = lib['lift'].fold_rngs(sub)
    return lambda scope, x: folded(scope.push('f'), ('fold', id(folded)), x)

  differential(make, jnp.ones((2, 3)), rngs=RNGS2, apply_rngs=APPLY_RNGS)


# -- control flow ------------------------------------------------------------------------


def _check_other_branch(make, variables, *args, **apply_kw):
  assert_identical(
      fapply(make(FLAX), mutable=['state'])(variables, *args, **apply_kw),
      lapply(make(OURS), mutable=['state'])(variables, *args, **apply_kw))


def test_cond():
  def make(lib):
    def true_fn(scope, x):
      scope.variable('state', 'true_count').value += 1
      return noisy_dense(scope.push('d'), x)
    def false_fn(scope, x):
      scope.variable('state', 'false_count').value += 1
      return -noisy_dense(scope.push('d'), x)
    def f(scope, x, p):
      scope.variable('state', 'true_count', lambda: 0)
      scope.variable('state', 'false_count', lambda: 0)
      return lib['lift'].cond(p, true_fn, false_fn, scope, x)
    return f

  x = jnp.ones((2, 3))
  _, variables = differential(make, x, jnp.asarray(True), rngs=RNGS2,
                              apply_rngs=APPLY_RNGS, apply_mutable=['state'])
  assert variables['state']['true_count'] == 1
  _check_other_branch(make, variables, x, jnp.asarray(False),
                      rngs=APPLY_RNGS)


def test_switch():
  def make(lib):
    def branch(k):
      def fn(scope, x):
        scope.variable('state', f'count{k}').value += 1
        return dense(scope.push('d'), x) * (k + 1)
      return fn
    def f(scope, x, i):
      for k in range(3):
        scope.variable('state', f'count{k}', lambda: 0)
      return lib['lift'].switch(i, [branch(k) for k in range(3)], scope, x)
    return f

  x = jnp.ones((2, 3))
  _, variables = differential(make, x, jnp.asarray(2),
                              apply_mutable=['state'])
  assert variables['state']['count2'] == 1
  _check_other_branch(make, variables, x, jnp.asarray(0))


def test_while_loop_with_carry_variables():
  def make(lib):
    def cond_fn(scope, c):
      return scope.get_variable('state', 'acc') < 4
    def body_fn(scope, c):
      acc = scope.variable('state', 'acc')
      acc.value += 1
      noise = jax.random.uniform(scope.make_rng('dropout'), c.shape)
      return dense(scope.push('d'), c) * noise
    def f(scope, x):
      scope.variable('state', 'acc', lambda: jnp.zeros((), jnp.int32))
      x = body_fn(scope.rewound(), x)  # creates the parameters
      return lib['lift'].while_loop(cond_fn, body_fn, scope, x,
                                    carry_variables='state',
                                    split_rngs={'dropout': True})
    return f

  _, variables = differential(make, jnp.ones((2, 3)), rngs=RNGS2,
                              apply_rngs=APPLY_RNGS, apply_mutable=['state'],
                              grad=False)
  assert variables['state']['acc'] == 4


def test_fori_loop():
  def body(scope, i, c):
    scope.variable('state', 'acc').value += i
    return c * scope.get_variable('params', 'w')

  def f(scope, x):
    scope.param('w', lambda k: jnp.full((2,), 2.0))
    scope.variable('state', 'acc', lambda: jnp.zeros((), jnp.int32))
    return llift.fori_loop(1, 4, body, scope, x, carry_variables='state')

  out, variables = linit(f)(jax.random.key(0), jnp.ones(2))
  np.testing.assert_array_equal(out, jnp.full((2,), 8.0))
  assert variables['state']['acc'] == 6


# -- differentiation ------------------------------------------------------------------------


def test_vjp():
  def make(lib):
    def f(scope, x):
      y, bwd = lib['lift'].vjp(noisy_dense, scope.push('d'), x)
      params_grad, x_grad = bwd(jnp.ones_like(y))
      return y, params_grad, x_grad
    return f

  differential(make, jnp.ones((2, 3)), rngs=RNGS2, apply_rngs=APPLY_RNGS)


def test_vjp_has_aux():
  def make(lib):
    def fn(scope, x):
      y = dense(scope, x)
      return y, {'mean': y.mean()}
    def f(scope, x):
      y, bwd, aux = lib['lift'].vjp(fn, scope, x, has_aux=True)
      return y, bwd(jnp.ones_like(y)), aux
    return f

  differential(make, jnp.ones((2, 3)))


def test_jvp():
  def make(lib):
    def f(scope, x):
      scope.push('d')  # reserve, so dense's params live under 'd'
      child = scope.push('d', reuse=True)
      dense(child, x)
      tangents = jax.tree_util.tree_map(
          jnp.ones_like, scope.variables()['params']['d'])
      return lib['lift'].jvp(noisy_dense, child, (x,), (jnp.zeros_like(x),),
                             {'params': tangents})
    return f

  differential(make, jnp.ones((2, 3)), rngs=RNGS2, apply_rngs=APPLY_RNGS)


def test_value_and_grad():
  def make(lib):
    def fn(scope, x, y):
      return (dense(scope, x) * y).sum(), x.mean()
    def f(scope, x, y):
      return lib['lift'].value_and_grad(fn, scope.push('d'), x, y,
                                        has_aux=True)
    return f

  differential(make, jnp.ones((2, 3)), jnp.arange(6.).reshape(2, 3) / 6)


def test_custom_vjp():
  def make(lib):
    lift = lib['lift']
    def fwd(scope, x):
      y, vjp_fn = lift.vjp(dense, scope, x)
      return y, vjp_fn
    def bwd(vjp_fn, y_t):
      params_t, *inputs_t = vjp_fn(y_t)
      params_t = jax.tree_util.tree_map(jnp.sign, params_t)
      return (params_t, *inputs_t)
    sign_grad = lift.custom_vjp(dense, forward_fn=fwd, backward_fn=bwd)
    return lambda scope, x: sign_grad(scope.push('s'), x)

  _, variables = differential(make, jnp.arange(6.).reshape(2, 3) - 2)
  grads = jax.grad(lambda p: lapply(make(OURS))({'params': p},
                                                jnp.ones((2, 3))).sum())(
                                                    variables['params'])
  assert set(np.unique(grads['s']['kernel'])) <= {-1.0, 0.0, 1.0}


# -- map_variables / swap_collection -----------------------------------------------------------


def test_map_variables_transposed_kernel():
  def make(lib):
    def f(scope, x):
      transposed = lib['lift'].map_variables(
          dense, 'params',
          lambda v: jax.tree_util.tree_map(lambda a: a.T, v),
          lambda v: jax.tree_util.tree_map(lambda a: a.T, v),
          init=True, mutable=True)
      return transposed(scope.push('t'), x, 3)
    return f

  _, variables = differential(make, jnp.ones((2, 3)))
  assert variables['params']['t']['kernel'].shape == (3, 3)


def test_map_variables_read_only_view():
  def make(lib):
    def f(scope, x):
      dense(scope.push('d'), x)
      doubled = lib['lift'].map_variables(
          dense, 'params',
          lambda v: jax.tree_util.tree_map(lambda a: a * 2, v))
      return doubled(scope.push('d', reuse=True), x)
    return f

  differential(make, jnp.ones((2, 3)))


def test_swap_collection():
  def make(lib):
    def body(scope):
      old = scope.get_variable('a', 'v')
      scope.put_variable('a', 'v', old + 1)
      return scope.get_variable('b', 'v')
    def f(scope):
      scope.variable('a', 'v', lambda: jnp.ones(()))
      scope.variable('b', 'v', lambda: jnp.full((), 10.))
      return lib['lift'].swap_collection(body, 'a', 'b')(scope)
    return f

  out, variables = differential(make, init_mutable=True, apply_mutable=True)
  assert out == 1.0 and variables['b']['v'] == 11.0


# -- packing machinery ---------------------------------------------------------------------------


def test_pack_tree_of_scopes_with_duplicates():
  """A tuple holding a scope, its child and the same scope again."""
  def make(lib):
    def body(scopes, x):
      parent, child, again = scopes
      y = dense(child, x)
      parent.variable('state', 'seen', lambda: jnp.zeros(()))
      # The duplicate is the very same inner scope: it sees the write.
      again.put_variable('state', 'seen',
                         again.get_variable('state', 'seen') + 1)
      return noisy_dense(parent.push('other'), y)
    def f(scope, x):
      child = scope.push('child')
      return lib['lift'].vmap(
          body, variable_axes={'params': 0, 'state': None},
          split_rngs={'params': True, 'dropout': True})(
              (scope, child, scope), x)
    return f

  _, variables = differential(make, jnp.ones((4, 3)), rngs=RNGS2,
                              apply_rngs=APPLY_RNGS, apply_mutable=['state'])
  assert variables['params']['child']['kernel'].shape == (4, 3, 3)


def test_pack_kwargs_warning_and_counter_sharing():
  seen = []

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
    scope = scope_fn(variable_groups, rng_groups)
    seen.append(scope.make_rng('params'))
    return None, repack_fn(scope)

  packed = llift.pack(inner, (True,), (True,), (True,))

  def f(scope):
    with pytest.warns(RuntimeWarning, match='ignoring'):
      packed(scope, unused=1)
    return scope.make_rng('params')

  key, _ = linit(f)(jax.random.key(0))
  # The inner scope shares the counter: outside draws counter 2, not 1.
  plain = lambda s: (s.make_rng('params'), s.make_rng('params'))  # noqa: E731
  (first, second), _ = linit(plain)(jax.random.key(0))
  assert_identical(first, seen[0])
  assert_identical(second, key)
