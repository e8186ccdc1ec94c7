"""Differential tests of the module-level lifted transforms against Flax Linen.

Every model is written ONCE as ``build(nn)`` and run with ``nn = flax.linen``
(the oracle) and ``nn = liftmods``. For each model we assert

* identical variable trees (tree structure, shapes, dtypes),
* BIT-IDENTICAL init values for at least two seeds,
* equal outputs (``rtol=1e-5, atol=1e-6``), at init and perturbed params,
* equal gradients of a scalar loss w.r.t. ``params``.

Init runs eagerly (as user code does); the apply/gradient comparisons run
under ``jax.jit`` (compiled once per library and input case); a few tests
also compare eager applies and jitted inits. A module fixture turns off most
XLA optimizations and enables a throw-away persistent compilation cache for
speed (same settings for both libraries; nothing compared depends on them).
"""
import functools

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn

SEEDS = (0, 1)
BACKENDS = (fnn, lnn)
RTOL, ATOL = 1e-5, 1e-6


_CACHE_FLAGS = ('jax_compilation_cache_dir',
                'jax_persistent_cache_min_compile_time_secs',
                'jax_persistent_cache_min_entry_size_bytes',
                'jax_disable_most_optimizations')


@pytest.fixture(scope='module', autouse=True)
def _fast_compiles(tmp_path_factory):
  """Many tiny programs are compiled, most of them twice with identical HLO
  (flax and liftmods, seed 0 and seed 1): skip most XLA optimizations (for
  both libraries alike) and let a throw-away persistent compilation cache
  serve the repeats. Neither changes what is compared. Restored after."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  old = {k: (jax.config.read(k) if k == 'jax_disable_most_optimizations'
              else getattr(jax.config, k)) for k in _CACHE_FLAGS}
  jax.config.update('jax_compilation_cache_dir',
                    str(tmp_path_factory.mktemp('xla_cache')))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  jax.config.update('jax_disable_most_optimizations', True)
  cc.reset_cache()
  yield
  for k, v in old.items():
    jax.config.update(k, v)
  cc.reset_cache()


# -- comparison helpers --------------------------------------------------------


def _as_dicts(tree):
  """Plain nested dicts (FrozenDicts thawed) with ``Partitioned`` boxes of
  either library replaced by ``('Partitioned', names, value)`` tuples, so
  that flax and liftmods trees compare structurally (names included)."""
  if isinstance(tree, (fnn.Partitioned, lnn.Partitioned)):
    return ('Partitioned', tuple(tree.names), _as_dicts(tree.value))
  if hasattr(tree, 'items'):
    return {k: _as_dicts(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)) and not hasattr(tree, 'shape'):
    return type(tree)(_as_dicts(v) for v in tree)
  return tree


def _compare(actual, expected, what, leaf_check):
  a, e = _as_dicts(actual), _as_dicts(expected)
  sa, se = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(e)
  assert sa == se, f'{what}: tree structure differs:\n{sa}\n!=\n{se}'
  la, le = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(e)
  assert len(la) == len(le)
  for i, (x, y) in enumerate(zip(la, le)):
    if isinstance(y, str) or isinstance(x, str):
      assert x == y, f'{what} leaf {i}: {x!r} != {y!r}'
      continue
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape, f'{what} leaf {i}: {x.shape} != {y.shape}'
    assert x.dtype == y.dtype, f'{what} leaf {i}: {x.dtype} != {y.dtype}'
    leaf_check(x, y, f'{what} leaf {i}')


def assert_identical(actual, expected, what=''):
  """Same structure, shapes, dtypes and bit-identical values."""
  _compare(actual, expected, what,
           lambda x, y, m: np.testing.assert_array_equal(x, y, err_msg=m))


def assert_close(actual, expected, what=''):
  _compare(actual, expected, what,
           lambda x, y, m: np.testing.assert_allclose(
               x, y, rtol=RTOL, atol=ATOL, err_msg=m))


def scalar_loss(tree):
  """A scalar depending on every floating leaf with distinct weights."""
  total = jnp.zeros((), jnp.float32)
  for leaf in jax.tree_util.tree_leaves(tree):
    leaf = jnp.asarray(leaf)
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      continue
    w = 1.0 + 0.1 * jnp.arange(leaf.size, dtype=jnp.float32).reshape(
        leaf.shape)
    total = total + jnp.sum(jnp.tanh(leaf) * w)
  return total


def _unbox(tree):
  is_box = lambda x: isinstance(x, (fnn.Partitioned, lnn.Partitioned))
  return jax.tree_util.tree_map(lambda x: x.value if is_box(x) else x, tree,
                                is_leaf=is_box)


def perturb(variables, amount=0.2):
  """Moves every float param away from its init value deterministically."""
  def f(path, x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return x
    h = (sum(len(str(p)) for p in path) % 5) + 1
    return x + amount * h * jnp.cos(
        jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
  out = dict(variables)
  out['params'] = jax.tree_util.tree_map_with_path(f, variables['params'])
  return out


def _rngs(seed, names):
  key = jax.random.key(seed)
  if not names:
    return key
  keys = jax.random.split(key, len(names) + 1)
  out = {'params': keys[0]}
  out.update({n: k for n, k in zip(names, keys[1:])})
  return out


def check(build, init_args, apply_cases=None, *, mutable=False,
          rng_names=(), seeds=SEEDS, method=None, grads=True,
          perturbed=True, init_kwargs=None, apply_kwargs=None,
          eager_apply=False, jit_later_seeds=False):
  """Runs ``build(nn)`` with both backends and compares init, apply, grads.

  Init runs eagerly (with ``jit_later_seeds``, seeds after the first run
  under ``jax.jit``); apply outputs and gradients are computed under ``jax.jit`` (plus one eager
  apply with ``eager_apply=True``). Returns ``{'vars': {nn: variables},
  'out': {nn: apply output of the first case}, 'init_out': {nn: init
  output}}`` (first seed) for extra checks.
  """
  if apply_cases is None:
    apply_cases = [init_args]
  init_kwargs = dict(init_kwargs or {})
  apply_kwargs = dict(apply_kwargs or {})
  if method is not None:
    init_kwargs.setdefault('method', method)
    apply_kwargs.setdefault('method', method)
  mods = {nn: build(nn) for nn in BACKENDS}
  result = {}
  jit_inits = {nn: jax.jit(functools.partial(
      lambda rngs, nn: mods[nn].init_with_output(rngs, *init_args,
                                                 **init_kwargs), nn=nn))
               for nn in BACKENDS}
  for i, seed in enumerate(seeds):
    # eagerly, as user code would (jit_later_seeds: seeds after the first
    # under jax.jit)
    if i == 0 or not jit_later_seeds:
      res = {nn: mods[nn].init_with_output(_rngs(seed, rng_names), *init_args,
                                           **init_kwargs)
             for nn in BACKENDS}
    else:
      res = {nn: jit_inits[nn](_rngs(seed, rng_names)) for nn in BACKENDS}
    (fo, fv), (lo, lv) = res[fnn], res[lnn]
    assert_identical(lv, fv, f'init variables (seed {seed})')
    assert_close(lo, fo, f'init output (seed {seed})')
    if not result:
      result = {'vars': {fnn: fv, lnn: lv}, 'init_out': {fnn: fo, lnn: lo}}
  variables = result['vars']
  apply_rngs = ({n: jax.random.key(100 + i) for i, n in enumerate(rng_names)}
                if rng_names else None)

  tags = [('init', variables)]
  if perturbed and 'params' in variables[fnn]:
    tags.append(('perturbed', {nn: perturb(v) for nn, v in variables.items()}))
  for ci, case in enumerate(apply_cases):

    def run(vs, nn, case=case):
      """Output and param gradients; jitted once per backend and case (the
      case is closed over so that Python scalars in it stay concrete)."""
      def apply(params):
        v = dict(vs)
        if params is not None:
          v['params'] = params
        return mods[nn].apply(v, *case, mutable=mutable, rngs=apply_rngs,
                              **apply_kwargs)
      out = apply(None)
      if not grads or 'params' not in vs:
        return out, None

      def loss(params):
        y = apply(params)
        return scalar_loss(y[0] if mutable else y)
      return out, jax.grad(loss)(vs['params'])

    runs = {nn: jax.jit(functools.partial(run, nn=nn)) for nn in BACKENDS}
    if ci == 0 and eager_apply:
      outs = {nn: mods[nn].apply(variables[nn], *case, mutable=mutable,
                                 rngs=apply_rngs, **apply_kwargs)
              for nn in BACKENDS}
      assert_close(outs[lnn], outs[fnn], 'eager apply output (init)')
    for tag, vs in tags:
      res = {nn: runs[nn](vs[nn]) for nn in BACKENDS}
      assert_close(res[lnn][0], res[fnn][0], f'apply output ({tag}, case {ci})')
      assert_close(res[lnn][1], res[fnn][1], f'param grads ({tag}, case {ci})')
      if ci == 0 and tag == 'init':
        result['out'] = {nn: r[0] for nn, r in res.items()}
  return result


def shapes(tree):
  return jax.tree_util.tree_map(lambda x: tuple(np.shape(x)), _unbox(tree))


X4 = jax.random.normal(jax.random.key(7), (4, 3))


# -- vmap ------------------------------------------------------------------------


def _mlp(nn):
  class MLP(nn.Module):
    features: int = 3

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(4)(x)
      x = nn.tanh(x)
      return nn.Dense(self.features, name='out')(x)
  return MLP


@pytest.mark.parametrize('axis', [0, 1])
def test_vmap_params_stacked_split(axis):
  def build(nn):
    return nn.vmap(_mlp(nn), variable_axes={'params': axis},
                   split_rngs={'params': True}, in_axes=0, out_axes=0)(2)

  r = check(build, (X4,))
  k = np.asarray(r['vars'][fnn]['params']['Dense_0']['kernel'])
  assert k.shape == ((4, 3, 4) if axis == 0 else (3, 4, 4))
  k0, k1 = np.take(k, 0, axis), np.take(k, 1, axis)
  assert not np.array_equal(k0, k1)


def test_vmap_params_stacked_no_split():
  def build(nn):
    return nn.vmap(_mlp(nn), variable_axes={'params': 0},
                   split_rngs={'params': False})(2)

  r = check(build, (X4,))
  k = np.asarray(r['vars'][lnn]['params']['out']['kernel'])
  assert k.shape == (4, 4, 2)
  for i in range(1, 4):
    np.testing.assert_array_equal(k[i], k[0])


def test_vmap_params_shared():
  def build(nn):
    return nn.vmap(_mlp(nn), variable_axes={'params': None},
                   split_rngs={'params': False})(2)

  r = check(build, (X4,), jit_later_seeds=True, eager_apply=True)
  assert shapes(r['vars'][fnn])['params']['Dense_0']['kernel'] == (3, 4)


def test_vmap_in_out_axes_trees():
  a = jax.random.normal(jax.random.key(1), (4, 2))
  b = jax.random.normal(jax.random.key(2), (2, 4))
  ctx = jnp.float32(1.5)
  d = {'u': jax.random.normal(jax.random.key(3), (4, 5)),
       'v': jax.random.normal(jax.random.key(4), (3, 4))}

  def build(nn):
    class Two(nn.Module):
      @nn.compact
      def __call__(self, pair, ctx, d):
        a, b = pair
        h = nn.Dense(3)(a) + nn.Dense(3)(b) * ctx
        h = h + nn.Dense(3)(d['u']) - d['v'].sum()
        return h, (jnp.sum(h), ctx * 2)

    return nn.vmap(Two, variable_axes={'params': None},
                   split_rngs={'params': False},
                   in_axes=((0, 1), None, {'u': 0, 'v': 1}),
                   out_axes=(1, (0, None)))()

  r = check(build, ((a, b), ctx, d))
  h, (s, c) = r['out'][lnn]
  assert h.shape == (3, 4) and s.shape == (4,) and c.shape == ()


def test_vmap_axis_size_without_mapped_inputs():
  def build(nn):
    return nn.vmap(_mlp(nn), variable_axes={'params': 0},
                   split_rngs={'params': True}, in_axes=None, out_axes=0,
                   axis_size=3)(2)

  x = jax.random.normal(jax.random.key(5), (3,))
  r = check(build, (x,))
  assert r['out'][lnn].shape == (3, 2)
  assert shapes(r['vars'][lnn])['params']['out']['kernel'] == (3, 4, 2)


def test_vmap_axis_name_batchnorm():
  def build(nn):
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(3)(x)
        x = nn.BatchNorm(use_running_average=False, axis_name='batch',
                         momentum=0.8)(x)
        return nn.relu(x)

    return nn.vmap(Net, variable_axes={'params': None, 'batch_stats': None},
                   split_rngs={'params': False}, in_axes=0, out_axes=0,
                   axis_name='batch')()

  x = jax.random.normal(jax.random.key(9), (5, 3))
  r = check(build, (x,), mutable=['batch_stats'])
  y, upd = r['out'][lnn]
  stats = upd['batch_stats']['BatchNorm_0']
  # the per-example stats are averaged over the vmapped axis
  assert stats['mean'].shape == (3,)
  assert_close(upd, r['out'][fnn][1], 'updated batch_stats')
  assert not np.allclose(stats['mean'], 0.0)


def _autoencoder(nn):
  class AE(nn.Module):
    def setup(self):
      self.enc = nn.Dense(2)
      self.dec = nn.Dense(3)

    def encode(self, x):
      return self.enc(x)

    def decode(self, z):
      return self.dec(z)

    def __call__(self, x):
      return self.decode(self.encode(x))
  return AE


def test_vmap_methods_list():
  def build(nn):
    VAE = nn.vmap(_autoencoder(nn), variable_axes={'params': 0},
                  split_rngs={'params': True}, methods=['encode', 'decode'])

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        ae = VAE()
        z = ae.encode(x)
        return ae.decode(z), z
    return Outer()

  r = check(build, (X4,))
  p = shapes(r['vars'][lnn]['params'])
  assert p['VmapAE_0']['enc']['kernel'] == (4, 3, 2)
  assert p['VmapAE_0']['dec']['kernel'] == (4, 2, 3)


def test_vmap_methods_dict():
  def build(nn):
    VAE = nn.vmap(_autoencoder(nn), methods={
        'encode': dict(variable_axes={'params': 0},
                       split_rngs={'params': True}, in_axes=0, out_axes=1),
        'decode': dict(variable_axes={'params': 0},
                       split_rngs={'params': True}, in_axes=1, out_axes=0),
    })

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        ae = VAE()
        z = ae.encode(x)
        return ae.decode(z), z
    return Outer()

  r = check(build, (X4,))
  y, z = r['out'][lnn]
  assert z.shape == (2, 4) and y.shape == (4, 3)


def test_vmap_init_via_method():
  def build(nn):
    return nn.vmap(_autoencoder(nn), variable_axes={'params': 0},
                   split_rngs={'params': True},
                   methods=['encode', 'decode', '__call__'])()

  r = check(build, (X4,))
  # apply a single method of the vmapped class
  zs = {nn: build(nn).apply(r['vars'][nn], X4, method='encode')
        for nn in BACKENDS}
  assert_close(zs[lnn], zs[fnn], 'encode')


# -- scan ------------------------------------------------------------------------


def _block(nn, features=3):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      h = nn.Dense(features)(jnp.concatenate([c, x], -1))
      c = nn.tanh(h) + c
      return c, h * 2
  return Block


C0 = jax.random.normal(jax.random.key(21), (2, 3))
XS = jax.random.normal(jax.random.key(22), (4, 2, 2))


def test_scan_variable_axes_split():
  def build(nn):
    return nn.scan(_block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True})()

  r = check(build, (C0, XS), jit_later_seeds=True, eager_apply=True)
  k = np.asarray(r['vars'][lnn]['params']['Dense_0']['kernel'])
  assert k.shape == (4, 5, 3)
  assert not np.array_equal(k[0], k[1])


def test_scan_variable_broadcast():
  def build(nn):
    return nn.scan(_block(nn), variable_broadcast='params',
                   split_rngs={'params': False})()

  r = check(build, (C0, XS))
  assert shapes(r['vars'][lnn]['params'])['Dense_0']['kernel'] == (5, 3)


def test_scan_variable_carry_counter():
  """A counter collection carried through the iterations (it must exist
  before the loop, so the parent creates it and scans a function of
  itself)."""
  def build(nn):
    class Counted(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        self.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))
        self.variable('counter', 'acc', lambda: jnp.zeros((2, 3)))

        def body(mdl, c, x):
          n = mdl.variable('counter', 'n')
          acc = mdl.variable('counter', 'acc')
          n.value += 1
          h = nn.Dense(3, name='dense')(x) + c
          acc.value = acc.value + h
          return h, acc.value

        return nn.scan(body, variable_axes={'params': 0},
                       variable_carry='counter',
                       split_rngs={'params': True})(self, c, xs)
    return Counted()

  r = check(build, (C0, XS), mutable=['counter'])
  v = r['vars'][lnn]
  assert int(v['counter']['n']) == 4
  assert shapes(v['params'])['dense']['kernel'] == (4, 2, 3)
  (_, ys), upd = r['out'][lnn]
  assert int(upd['counter']['n']) == 8
  assert_close(upd, r['out'][fnn][1], 'counter after apply')
  np.testing.assert_allclose(upd['counter']['acc'], ys[-1], rtol=RTOL,
                             atol=ATOL)
  # apply again, continuing from the carried counter
  for nn in BACKENDS:
    again = build(nn).apply({**r['vars'][nn], **r['out'][nn][1]}, C0, XS,
                            mutable=['counter'])[1]
    assert int(again['counter']['n']) == 12


def test_scan_variable_carry_class_form():
  """Class form: the carried collection is created by the scanned module's
  own init-time logic outside the loop via a non-scanned warm-up call."""
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c, x):
        n = self.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))
        n.value += 1
        return c * 0.5 + x.sum(), n.value

    class Model(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        S = nn.scan(Step, variable_carry='counter', split_rngs={})
        step = S(name='step')
        return step(c, xs)
    return Model()

  c = jnp.zeros((2,))
  xs = jnp.ones((3, 2))
  init_counter = {'n': jnp.zeros((), jnp.int32)}
  for nn in BACKENDS:
    m = build(nn)
    (c1, ns), upd = m.apply({'counter': {'step': init_counter}}, c, xs,
                            mutable=['counter'])
    np.testing.assert_array_equal(ns, [1, 2, 3])
    assert int(upd['counter']['step']['n']) == 3


def _dropout_block(nn):
  class DBlock(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      h = nn.Dense(3)(x) + c
      h = nn.Dropout(0.5, deterministic=False)(h)
      return nn.tanh(h), h
  return DBlock


@pytest.mark.parametrize('split_dropout', [True, False])
def test_scan_split_rngs_dropout(split_dropout):
  def build(nn):
    return nn.scan(_dropout_block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True, 'dropout': split_dropout})()

  r = check(build, (C0, XS), rng_names=('dropout',))
  _, ys = r['out'][lnn]
  masks = np.asarray(ys) == 0
  assert masks.any()
  # with split dropout rngs the masks differ between iterations
  same = all(np.array_equal(masks[0], masks[i]) for i in range(1, 4))
  assert same != split_dropout


@pytest.mark.parametrize('reverse,unroll', [(True, 1), (False, 2),
                                            (True, 2)])
def test_scan_reverse_unroll(reverse, unroll):
  def build(nn):
    return nn.scan(_block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True}, reverse=reverse,
                   unroll=unroll)()

  check(build, (C0, XS))


def test_scan_reverse_reverses_order():
  for nn in BACKENDS:
    fwd = nn.scan(_block(nn), variable_broadcast='params',
                  split_rngs={'params': False})()
    bwd = nn.scan(_block(nn), variable_broadcast='params',
                  split_rngs={'params': False}, reverse=True)()
    v = fwd.init(jax.random.key(0), C0, XS)
    c_f, ys_f = fwd.apply(v, C0, XS[::-1])
    c_b, ys_b = bwd.apply(v, C0, XS)
    np.testing.assert_allclose(c_f, c_b, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ys_f[::-1], ys_b, rtol=RTOL, atol=ATOL)


def test_scan_length_without_xs():
  def build(nn):
    class Step(nn.Module):
      @nn.compact
      def __call__(self, c):
        c = nn.tanh(nn.Dense(3)(c))
        return c, c.sum(-1)

    return nn.scan(Step, variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3)()

  r = check(build, (C0,))
  c, ys = r['out'][lnn]
  assert ys.shape == (3, 2)
  assert shapes(r['vars'][lnn]['params'])['Dense_0']['kernel'] == (3, 3, 3)


def test_scan_broadcast_in_axes_and_out_axes():
  def build(nn):
    class Ctx(nn.Module):
      @nn.compact
      def __call__(self, c, x, ctx):
        h = nn.Dense(3)(x) + nn.Dense(3, use_bias=False)(ctx) + c
        return nn.tanh(h), h

    return nn.scan(Ctx, variable_broadcast='params',
                   split_rngs={'params': False},
                   in_axes=(1, nn.broadcast), out_axes=2)()

  xs = jax.random.normal(jax.random.key(3), (2, 5, 2))  # time on axis 1
  ctx = jax.random.normal(jax.random.key(4), (2, 4))
  r = check(build, (C0, xs, ctx))
  c, ys = r['out'][lnn]
  assert ys.shape == (2, 3, 5)


def test_scan_lstm_over_time():
  """The classic Linen RNN: a scanned LSTMCell with broadcast params."""
  def build(nn):
    class RNN(nn.Module):
      hidden: int = 4

      @nn.compact
      def __call__(self, xs):
        cell = nn.scan(nn.LSTMCell, variable_broadcast='params',
                       split_rngs={'params': False}, in_axes=1,
                       out_axes=1)(self.hidden, name='lstm')
        carry = cell.initialize_carry(jax.random.key(0), xs[:, 0].shape)
        carry, ys = cell(carry, xs)
        return nn.Dense(2)(ys), carry

    return RNN()

  xs = jax.random.normal(jax.random.key(5), (2, 6, 3))
  r = check(build, (xs,))
  p = shapes(r['vars'][lnn]['params'])
  assert set(p['lstm']) == {'ii', 'if', 'ig', 'io', 'hi', 'hf', 'hg', 'ho'}
  assert r['out'][lnn][0].shape == (2, 6, 2)


def test_scan_stack_of_layers_with_layernorm():
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        y = nn.LayerNorm()(x)
        y = nn.Dense(4)(y)
        return x + nn.gelu(y), None

    class Stack(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = nn.scan(Layer, variable_axes={'params': 0},
                       split_rngs={'params': True}, length=3)(
                           name='layers')(x, None)
        return x
    return Stack()

  x = jax.random.normal(jax.random.key(6), (2, 4))
  r = check(build, (x,))
  assert shapes(r['vars'][lnn])['params']['layers']['LayerNorm_0'][
      'scale'] == (3, 4)


# -- nesting -----------------------------------------------------------------------


def test_scan_of_remat():
  def build(nn):
    return nn.scan(nn.remat(_block(nn)), variable_axes={'params': 0},
                   split_rngs={'params': True})()

  check(build, (C0, XS))


def test_vmap_of_scan():
  def build(nn):
    Scanned = nn.scan(_block(nn), variable_axes={'params': 0},
                      split_rngs={'params': True})
    return nn.vmap(Scanned, variable_axes={'params': None},
                   split_rngs={'params': False}, in_axes=(0, 1),
                   out_axes=(0, 1))()

  c0 = jax.random.normal(jax.random.key(1), (2, 3))  # vmapped over 2
  xs = jax.random.normal(jax.random.key(2), (4, 2, 2))  # time 4, batch 2
  r = check(build, (c0, xs))
  assert shapes(r['vars'][lnn])['params']['Dense_0']['kernel'] == (4, 5, 3)


def test_vmap_of_scan_stacked_both():
  def build(nn):
    Scanned = nn.scan(_block(nn), variable_axes={'params': 0},
                      split_rngs={'params': True})
    return nn.vmap(Scanned, variable_axes={'params': 1},
                   split_rngs={'params': True}, in_axes=(0, 1),
                   out_axes=(0, 1))()

  c0 = jax.random.normal(jax.random.key(1), (2, 3))
  xs = jax.random.normal(jax.random.key(2), (4, 2, 2))
  r = check(build, (c0, xs))
  assert shapes(r['vars'][lnn])['params']['Dense_0']['kernel'] == (4, 2, 5,
                                                                     3)


def test_remat_of_vmap():
  def build(nn):
    return nn.remat(nn.vmap(_mlp(nn), variable_axes={'params': 0},
                            split_rngs={'params': True}))(2)

  check(build, (X4,))


def test_jit_around_scan():
  def build(nn):
    Scanned = nn.scan(_block(nn), variable_axes={'params': 0},
                      split_rngs={'params': True})
    return nn.jit(Scanned)()

  check(build, (C0, XS))


def test_jit_of_parent_containing_scan():
  def build(nn):
    class Parent(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        c, ys = nn.scan(_block(nn), variable_axes={'params': 0},
                        split_rngs={'params': True})(name='scan')(c, xs)
        return nn.Dense(2)(ys), c
    return nn.jit(Parent)()

  check(build, (C0, XS))


def test_transformed_submodules_in_setup():
  def build(nn):
    class Model(nn.Module):
      def setup(self):
        self.vdense = nn.vmap(nn.Dense, variable_axes={'params': 0},
                              split_rngs={'params': True})(3)
        self.rdense = nn.remat(nn.Dense)(2)

      def __call__(self, x):
        return self.rdense(nn.relu(self.vdense(x)))
    return Model()

  r = check(build, (X4,))
  p = shapes(r['vars'][lnn]['params'])
  assert p['vdense']['kernel'] == (4, 3, 3) and p['rdense']['kernel'] == (3,
                                                                            2)


def test_scan_in_setup_layers():
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return x + nn.tanh(nn.Dense(4)(x)), None

    class Model(nn.Module):
      def setup(self):
        self.layers = nn.scan(Layer, variable_axes={'params': 0},
                              split_rngs={'params': True}, length=3)()
        self.head = nn.Dense(2)

      def __call__(self, x):
        x, _ = self.layers(x, None)
        return self.head(x)
    return Model()

  x = jax.random.normal(jax.random.key(6), (2, 4))
  r = check(build, (x,))
  assert shapes(r['vars'][lnn])['params']['layers']['Dense_0'][
      'kernel'] == (3, 4, 4)


@pytest.mark.parametrize('in_axes', [0, (None, 0)])
def test_vmap_function_with_module_arguments(in_axes):
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        other = nn.Dense(3, name='other')

        def fn(mdl, other, x):
          h = nn.Dense(3, name='own')(x)
          return other(h) + h
        vfn = nn.vmap(fn, variable_axes={'params': 0},
                      split_rngs={'params': True}, in_axes=in_axes)
        return vfn(self, other, x)
    return Model()

  r = check(build, (X4,))
  p = shapes(r['vars'][lnn]['params'])
  assert p['own']['kernel'] == (4, 3, 3) and p['other']['kernel'] == (4, 3, 3)


@pytest.mark.parametrize('in_axes', [0, (None, 0)])
def test_vmap_function_with_module_argument_shared(in_axes):
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        other = nn.Dense(3, name='other')
        other(x[0])  # initialise outside the transform: shared

        def fn(mdl, other, x):
          return other(x) * 2
        vfn = nn.vmap(fn, variable_axes={'params': None},
                      split_rngs={'params': False}, in_axes=in_axes)
        return vfn(self, other, x)
    return Model()

  r = check(build, (X4,))
  assert shapes(r['vars'][lnn])['params']['other']['kernel'] == (3, 3)


@pytest.mark.parametrize('which', ['jit', 'remat', 'checkpoint'])
def test_function_with_module_argument(which):
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        other = nn.Dense(3, name='other')

        def fn(mdl, other, x):
          return nn.tanh(other(x)) + nn.Dense(3, name='own')(x)
        return getattr(nn, which)(fn)(self, other, x)
    return Model()

  r = check(build, (X4,))
  assert set(r['vars'][lnn]['params']) == {'other', 'own'}


def test_module_as_dataclass_field_of_transformed():
  def build(nn):
    class Wrapper(nn.Module):
      inner: nn.Module

      @nn.compact
      def __call__(self, x):
        return self.inner(x) + nn.Dense(2)(x)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        inner = nn.Dense(2, name='inner')
        VW = nn.vmap(Wrapper, variable_axes={'params': 0},
                     split_rngs={'params': True})
        return VW(inner)(x)
    return Model()

  r = check(build, (X4,))
  p = shapes(r['vars'][lnn]['params'])
  assert p['inner']['kernel'] == (4, 3, 2)


def test_module_field_of_scan_shared():
  def build(nn):
    class Wrapper(nn.Module):
      inner: nn.Module

      @nn.compact
      def __call__(self, c, x):
        c = nn.tanh(self.inner(c) + nn.Dense(3)(x))
        return c, c

    class Model(nn.Module):
      @nn.compact
      def __call__(self, c, xs):
        inner = nn.Dense(3, name='inner')
        SW = nn.scan(Wrapper, variable_axes={'params': 0},
                     variable_broadcast=False, split_rngs={'params': True})
        return SW(inner, name='scan')(c, xs)
    return Model()

  r = check(build, (C0, XS))
  p = shapes(r['vars'][lnn]['params'])
  assert p['inner']['kernel'] == (4, 3, 3)


def test_decorator_jit_and_remat():
  def build(nn):
    class JitBlock(nn.Module):
      @nn.jit
      @nn.compact
      def __call__(self, x):
        return nn.relu(nn.Dense(3)(x))

    class RematBlock(nn.Module):
      @nn.remat
      @nn.compact
      def __call__(self, x):
        return nn.tanh(nn.Dense(2)(x))

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return RematBlock()(JitBlock()(x))
    return Model()

  r = check(build, (X4,))
  assert set(r['vars'][lnn]['params']) == {'JitBlock_0', 'RematBlock_0'}


def test_decorator_vmap_on_method():
  def build(nn):
    class Model(nn.Module):
      @functools.partial(nn.vmap, variable_axes={'params': 0},
                         split_rngs={'params': True})
      @nn.compact
      def __call__(self, x):
        return nn.Dense(2)(x)
    return Model()

  r = check(build, (X4,))
  assert shapes(r['vars'][lnn])['params']['Dense_0']['kernel'] == (4, 3, 2)


# -- checkpoint ----------------------------------------------------------------------


def test_checkpoint_static_argnums():
  def build(nn):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, scale: float, relu: bool):
        h = nn.Dense(3)(x) * scale
        return nn.relu(h) if relu else nn.tanh(h)

    class Model(nn.Module):
      relu: bool = True

      @nn.compact
      def __call__(self, x):
        B = nn.remat(Block, static_argnums=(2, 3))
        return B()(x, 2.0, self.relu) + B()(x, 0.5, not self.relu)
    return Model()

  check(build, (X4,))
  check(lambda nn: build(nn).clone(relu=False), (X4,))


def test_checkpoint_policy_nothing_saveable():
  def build(nn):
    return nn.checkpoint(_mlp(nn),
                         policy=jax.checkpoint_policies.nothing_saveable)(2)

  check(build, (X4,))


def test_checkpoint_rematerializes():
  """The jaxpr of the gradient contains a remat (checkpoint) primitive."""
  for nn in BACKENDS:
    m = nn.remat(_mlp(nn))(2)
    v = m.init(jax.random.key(0), X4)
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda p: m.apply({'params': p}, X4).sum()))(v['params'])
    assert 'remat' in str(jaxpr) or 'checkpoint' in str(jaxpr)


def test_remat_scan_lengths():
  def build(nn):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + nn.tanh(nn.Dense(3)(x))

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.remat_scan(Layer, lengths=(2, 3))(name='stack')(x)
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  assert shapes(r['vars'][lnn])['params']['stack']['Dense_0'][
      'kernel'] == (2, 3, 3, 3)


# -- jit -----------------------------------------------------------------------------


def _counting(nn, counter):
  class Counted(nn.Module):
    @nn.compact
    def __call__(self, x):
      counter.append(x.shape)
      return nn.Dense(2)(x)
  return Counted


@pytest.mark.parametrize('nn', BACKENDS, ids=['flax', 'liftmods'])
def test_jit_compile_cache(nn):
  counter = []
  m = nn.jit(_counting(nn, counter))()
  v = m.init(jax.random.key(0), X4)
  counter.clear()
  ys = [m.apply(v, X4) for _ in range(3)]
  assert len(counter) == 1, counter
  for y in ys[1:]:
    np.testing.assert_array_equal(y, ys[0])
  m.apply(v, X4 + 1.0)  # same shape: cache hit
  assert len(counter) == 1
  m.apply(v, jnp.ones((5, 3)))  # new shape: new trace
  assert len(counter) == 2
  m.apply(v, jnp.ones((5, 3)))
  assert len(counter) == 2


def test_jit_trace_counts_match_flax():
  counts = {}
  for nn in BACKENDS:
    counter = []
    m = nn.jit(_counting(nn, counter))()
    v = m.init(jax.random.key(0), X4)
    n_init = len(counter)
    for _ in range(3):
      m.apply(v, X4)
    m.apply(v, jnp.ones((6, 3)))
    counts[nn] = (n_init, len(counter))
  assert counts[lnn] == counts[fnn]


@pytest.mark.parametrize('pass_rngs', [False, True])
def test_jit_shared_submodule_trace_counts(pass_rngs):
  """A jitted submodule called twice per apply: after the first apply,
  further applies hit the compile cache, and liftmods never traces more
  often than Flax (it may trace less: calls whose rng states differ only in
  untouched child counters share one compiled function)."""
  counts = {}
  for nn in BACKENDS:
    counter = []

    class Lin(nn.Module):
      @nn.jit
      @nn.compact
      def __call__(self, x):
        counter.append(x.shape)
        return nn.Dense(3)(x)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        d = Lin()
        return d(x) + d(x)

    m = Model()
    v = m.init(jax.random.key(0), X4)
    seq = [len(counter)]
    for i in range(3):
      m.apply(v, X4, rngs={'dropout': jax.random.key(i)} if pass_rngs
              else None)
      seq.append(len(counter))
    counts[nn] = seq
  assert all(a <= b for a, b in zip(counts[lnn], counts[fnn])), counts
  assert counts[lnn][-1] == counts[lnn][-2] == counts[lnn][-3]


def test_jit_dropout_called_twice_rng_counters():
  def build(nn):
    class Drop(nn.Module):
      @nn.jit
      @nn.compact
      def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(x)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        d = Drop()
        a = d(x)
        b = d(x)
        c = Drop()(x)
        return a, b, c, jax.random.key_data(self.make_rng('dropout'))
    return Model()

  x = jnp.ones((4, 6))
  r = check(build, (x,), rng_names=('dropout',), grads=False)
  a, b, c, key = r['out'][lnn]
  assert not np.array_equal(a, b)
  fa, fb, fc, fkey = r['out'][fnn]
  np.testing.assert_array_equal(a, fa)
  np.testing.assert_array_equal(b, fb)
  np.testing.assert_array_equal(c, fc)
  np.testing.assert_array_equal(key, fkey)


def test_jit_class_dropout_called_twice():
  def build(nn):
    JDrop = nn.jit(nn.Dropout)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        d = JDrop(0.5, deterministic=False)
        return d(x), d(x), nn.Dropout(0.5, deterministic=False)(x)
    return Model()

  x = jnp.ones((4, 6))
  r = check(build, (x,), rng_names=('dropout',), grads=False)
  for a, b in zip(r['out'][lnn], r['out'][fnn]):
    np.testing.assert_array_equal(a, b)


def test_jit_static_argnums():
  def build(nn):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, mode: str):
        h = nn.Dense(3)(x)
        return nn.relu(h) if mode == 'relu' else jnp.sin(h)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        B = nn.jit(Block, static_argnums=(2,))
        b = B()
        return b(x, 'relu') + b(x, 'sin')
    return Model()

  check(build, (X4,))


def test_jit_then_vmap():
  def build(nn):
    return nn.vmap(nn.jit(_mlp(nn)), variable_axes={'params': 0},
                   split_rngs={'params': True})(2)

  check(build, (X4,))


# -- cond / switch / while_loop --------------------------------------------------


def test_cond_both_branches_init():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x, pred):
        a = nn.Dense(3, name='a')
        b = nn.Dense(3, name='b')
        if self.is_initializing():
          a(x), b(x)

        def t(mdl, x):
          return a(x)

        def f(mdl, x):
          return -b(x) * 2
        return nn.cond(pred, t, f, self, x)
    return Model()

  cases = [(X4, True), (X4, False), (X4, jnp.array(True)),
           (X4, jnp.array(False))]
  r = check(build, (X4, True), cases)
  assert set(r['vars'][lnn]['params']) == {'a', 'b'}


def test_cond_under_jit_traced_pred():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def t(mdl, x):
          return nn.Dense(3, name='d')(x)

        def f(mdl, x):
          return nn.Dense(3, name='d')(x) * -1
        return nn.cond(x.sum() > 0, t, f, self, x)
    return Model()

  check(build, (X4,), [(X4,), (-X4,)])


def test_switch_both_branches_init():
  def build(nn):
    class Model(nn.Module):
      def setup(self):
        self.heads = [nn.Dense(2), nn.Dense(2), nn.Dense(2)]

      def __call__(self, x, i):
        if self.is_mutable_collection('params'):
          for h in self.heads:
            h(x)
        branches = [lambda m, x, k=k: m.heads[k](x) * (k + 1)
                    for k in range(3)]
        return nn.switch(i, branches, self, x)
    return Model()

  cases = [(X4, i) for i in range(3)] + [(X4, jnp.array(2))]
  r = check(build, (X4, 0), cases)
  assert set(r['vars'][lnn]['params']) == {'heads_0', 'heads_1', 'heads_2'}


def test_while_loop_carry_counter():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        self.variable('counter', 'n', lambda: jnp.zeros((), jnp.int32))
        dense = nn.Dense(3)
        if self.is_initializing():
          dense(x)

        def cond_fn(mdl, c):
          return mdl.variables['counter']['n'] < 5

        def body_fn(mdl, c):
          mdl.variable('counter', 'n').value += 1
          return nn.tanh(dense(c))
        return nn.while_loop(cond_fn, body_fn, self, x,
                             carry_variables='counter')
    return Model()

  x = jax.random.normal(jax.random.key(3), (2, 3))
  r = check(build, (x,), mutable=['counter'], grads=False)
  _, upd = r['out'][lnn]
  assert int(upd['counter']['n']) == 5
  assert int(r['out'][fnn][1]['counter']['n']) == 5


# -- map_variables ---------------------------------------------------------------


def test_map_variables_weight_transform_init():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        # kernel used as its sign-preserving square; also transformed on init
        SqDense = nn.map_variables(
            nn.Dense, 'params',
            trans_in_fn=lambda vs: jax.tree_util.tree_map(
                lambda w: w * jnp.abs(w), vs),
            init=True)
        return SqDense(3, name='sq')(x)
    return Model()

  r = check(build, (X4,))
  v = r['vars'][lnn]['params']['sq']
  y = X4 @ (v['kernel'] * np.abs(v['kernel'])) + v['bias'] * np.abs(
      v['bias'])
  np.testing.assert_allclose(r['out'][lnn], y, rtol=RTOL, atol=ATOL)


def test_map_variables_trans_out_and_mutable():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        Scaled = nn.map_variables(
            nn.Dense, 'params',
            trans_in_fn=lambda vs: jax.tree_util.tree_map(
                lambda w: w / 2.0, vs),
            trans_out_fn=lambda vs: jax.tree_util.tree_map(
                lambda w: w * 2.0, vs),
            init=True, mutable=True)
        return Scaled(3)(x)
    return Model()

  check(build, (X4,))


# -- vjp / jvp / grad / value_and_grad / custom_vjp ------------------------------


def test_vjp_module_level():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return mdl(x)
        y, bwd = nn.vjp(f, _mlp(nn)(2), x)
        params_t, x_t = bwd(jnp.ones_like(y))
        return y, params_t, x_t
    return Model()

  r = check(build, (X4,))
  y, params_t, x_t = r['out'][lnn]
  assert x_t.shape == X4.shape
  assert set(params_t['params']) == {'Dense_0', 'out'}


def test_vjp_has_aux_and_vjp_variables():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          y = mdl(x)
          return y, jnp.sum(y ** 2)
        y, bwd, aux = nn.vjp(f, _mlp(nn)(2), x, has_aux=True)
        params_t, x_t = bwd(y)
        return y, aux, params_t, x_t
    return Model()

  check(build, (X4,))


def test_value_and_grad_and_grad_module_level():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return jnp.sum(mdl(x) ** 2)
        mlp = _mlp(nn)(2)
        value, (x_grad,) = nn.value_and_grad(f, mlp, x)
        (x_grad2,) = nn.grad(f, mlp, x)
        return value, x_grad, x_grad2
    return Model()

  r = check(build, (X4,))
  value, xg, xg2 = r['out'][lnn]
  assert value.shape == ()
  assert_identical(xg, xg2)
  assert xg.shape == X4.shape


def test_value_and_grad_has_aux():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          y = mdl(x)
          return jnp.sum(y), y.mean(0)
        (value, aux), (x_grad,) = nn.value_and_grad(
            f, _mlp(nn)(2), x, has_aux=True)
        (x_grad2,), aux2 = nn.grad(f, _mlp(nn)(2, name='b'), x, has_aux=True)
        return value, aux, x_grad, x_grad2, aux2
    return Model()

  check(build, (X4,))


def test_jvp_module_level():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        mlp = _mlp(nn)(2)
        y0 = mlp(x)  # create the params before taking tangents
        p = mlp.variables['params']
        t = jax.tree_util.tree_map(lambda a: jnp.full_like(a, 0.5), p)
        y, y_t = nn.jvp(lambda mdl, x: mdl(x), mlp, (x,),
                        (jnp.ones_like(x),), {'params': t})
        return y0, y, y_t
    return Model()

  r = check(build, (X4,))
  y0, y, y_t = r['out'][lnn]
  np.testing.assert_allclose(y0, y, rtol=RTOL, atol=ATOL)


def test_custom_vjp_sign_grad():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return mdl(x)

        def fwd(mdl, x):
          return nn.vjp(f, mdl, x)

        def bwd(vjp_fn, y_t):
          params_t, *inputs_t = vjp_fn(y_t)
          params_t = jax.tree_util.tree_map(jnp.sign, params_t)
          return (params_t, *inputs_t)

        sign_grad = nn.custom_vjp(f, forward_fn=fwd, backward_fn=bwd)
        return sign_grad(nn.Dense(1), x).sum()
    return Model()

  r = check(build, (X4,))
  for nn in BACKENDS:
    g = jax.grad(lambda p: build(nn).apply({'params': p}, X4))(
        r['vars'][nn]['params'])
    for leaf in jax.tree_util.tree_leaves(g):
      assert set(np.unique(np.asarray(leaf))) <= {-1.0, 0.0, 1.0}


# -- axis metadata -----------------------------------------------------------------


def _partitioned_block(nn):
  class PBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      k = nn.with_partitioning(nn.initializers.lecun_normal(),
                               ('embed', 'mlp'))
      y = nn.Dense(3, kernel_init=k, use_bias=False)(x)
      w = self.param('w', nn.with_partitioning(nn.initializers.ones_init(),
                                               ('mlp',)), (3,))
      return x + nn.tanh(y * w), None
  return PBlock


def _check_names(r, expected):
  names = {}
  for nn in BACKENDS:
    boxes = [b for b in jax.tree_util.tree_leaves(
        r['vars'][nn], is_leaf=lambda x: isinstance(x, nn.Partitioned))]
    names[nn] = [tuple(b.names) for b in boxes]
    specs = nn.get_partition_spec(r['vars'][nn])
    names[nn, 'spec'] = [tuple(s) for s in jax.tree_util.tree_leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))]
  assert names[lnn] == names[fnn] == expected
  assert names[lnn, 'spec'] == names[fnn, 'spec']


def test_partitioned_through_scan():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = nn.scan(_partitioned_block(nn), variable_axes={'params': 0},
                       split_rngs={'params': True}, length=2,
                       metadata_params={nn.meta.PARTITION_NAME: 'layers'})(
                           name='scan')(x, None)
        return x
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  _check_names(r, [('layers', 'embed', 'mlp'), ('layers', 'mlp')])


def test_partitioned_through_scan_unnamed_axis():
  """metadata_params={PARTITION_NAME: None}: the stacked axis is unsharded."""
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        x, _ = nn.scan(_partitioned_block(nn), variable_axes={'params': 0},
                       split_rngs={'params': True}, length=2,
                       metadata_params={nn.meta.PARTITION_NAME: None})(
                           name='scan')(x, None)
        return x
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,), grads=False)
  _check_names(r, [(None, 'embed', 'mlp'), (None, 'mlp')])


def test_partitioned_through_vmap_axis1():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return _partitioned_block(nn)()(x, None)[0]
        return nn.vmap(f, variable_axes={'params': 1},
                       split_rngs={'params': True},
                       metadata_params={nn.meta.PARTITION_NAME: 'batch'})(
                           self, x)
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  _check_names(r, [('embed', 'batch', 'mlp'), ('mlp', 'batch')])


def test_add_metadata_axis():
  def build(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        Tagged = nn.add_metadata_axis(
            _partitioned_block(nn), variable_axes={'params': 0},
            metadata_params={nn.meta.PARTITION_NAME: 'stage'})
        return Tagged()(x, None)[0]
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  r = check(build, (x,))
  _check_names(r, [('stage', 'embed', 'mlp'), ('stage', 'mlp')])


def test_partitioned_scan_of_vmap_names():
  def build(nn):
    Inner = nn.vmap(_partitioned_block(nn), variable_axes={'params': 0},
                    split_rngs={'params': True}, in_axes=(0, None),
                    metadata_params={nn.meta.PARTITION_NAME: 'heads'})
    Outer = nn.scan(Inner, variable_axes={'params': 0},
                    split_rngs={'params': True}, length=2,
                    in_axes=(nn.broadcast,),
                    metadata_params={nn.meta.PARTITION_NAME: 'layers'})

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Outer(name='stack')(x, None)
    return Model()

  x = jax.random.normal(jax.random.key(1), (2, 3))
  # out: carry (2, 3) is vmapped over heads=2 too
  r = check(build, (x,))
  _check_names(r, [('layers', 'heads', 'embed', 'mlp'),
                   ('layers', 'heads', 'mlp')])


# -- more patterns -----------------------------------------------------------------


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
    return nn.vmap(_mlp(nn), variable_axes={'params': 0,
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
    JAE = nn.jit(_autoencoder(nn), methods=['encode', 'decode'])

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
    return nn.scan(_dropout_block(nn), variable_axes={'params': 0},
                   split_rngs={'params': True})()

  outcome = {}
  for nn in BACKENDS:
    try:
      v = build(nn).init(_rngs(0, ('dropout',)), C0, XS)
      outcome[nn] = ('ok', build(nn).apply(
          v, C0, XS, rngs={'dropout': jax.random.key(3)}))
    except Exception as e:  # pylint: disable=broad-except
      outcome[nn] = ('error', e)
  assert outcome[lnn][0] == outcome[fnn][0], outcome
  if outcome[fnn][0] == 'ok':
    assert_close(outcome[lnn][1], outcome[fnn][1], 'apply')


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
        self.body = nn.vmap(_mlp(nn), variable_axes={'params': 0},
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
  assert_close(feats[lnn], feats[fnn], 'features')


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
        return nn.scan(_block(nn), variable_axes={'params': 1},
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
        return nn.map_variables(_mlp(nn), 'params', trans_in_fn=normalize,
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
    Block = _dropout_block(nn)

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
    out, v = m.init_with_output(_rngs(0, ('dropout',)), C0, XS)
    out2 = m.apply(v, C0, XS, rngs={'dropout': jax.random.key(5)})
    res[nn] = (v, out, out2)
  assert_identical(res[lnn], res[fnn], kind)
