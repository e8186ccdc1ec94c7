"""nn.Stack: init identical to a hand-written nn.scan (liftmods and
flax.linen), fold/scan results and gradients equal across modes and
policies, layout conversion, policies' memory ordering, errors."""
import contextlib
import io
import warnings

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
from liftmods import errors
from liftmods.core.rng_counters import RngReplay
from liftmods.stack import StackOffloadWarning
from program_compare import assert_match, run_compiled
from treecheck import assert_close, assert_identical, normal


def blocks(nn):
  """Blocks written once against a Linen-style namespace."""

  class Block(nn.Module):
    """Fold block: LayerNorm -> Dense -> gelu (named) -> Dense, a direct
    param (drawn on the block's own scope) and dropout."""
    rate: float = 0.0

    @nn.compact
    def __call__(self, x, deterministic=True):
      gain = self.param('gain', nn.initializers.normal(1.0), (x.shape[-1],))
      h = nn.Dense(2 * x.shape[-1])(nn.LayerNorm()(x))
      h = jax.ad_checkpoint.checkpoint_name(nn.gelu(h), 'mlp_up')
      h = nn.Dropout(self.rate, deterministic=deterministic)(h)
      return x + gain * nn.Dense(x.shape[-1])(h)

  class ScanBlock(nn.Module):
    """Scan block: a per-layer scale and a shared bias; emits a per-layer
    output."""

    @nn.compact
    def __call__(self, x, scale, bias):
      x = jnp.tanh(nn.Dense(x.shape[-1])(x)) * scale + bias
      return x, x.sum(-1)

  class Wrapped(Block):
    """Block as an nn.scan body: (carry, ys)."""

    def __call__(self, x, deterministic=True):
      return super().__call__(x, deterministic), None

  return Block, ScanBlock, Wrapped


Block, ScanBlock, _ = blocks(lnn)


class Tiny(lnn.Module):
  """A cheap fold block (fast to compile) with a named internal."""

  @lnn.compact
  def __call__(self, x):
    h = jnp.tanh(lnn.Dense(2 * x.shape[-1])(x))
    h = jax.ad_checkpoint.checkpoint_name(h, 'mlp_up')
    return x + lnn.Dense(x.shape[-1])(h)
L, H = 5, 4
X = normal(1, (3, H))
KEY = jax.random.key(0)


def stack_model(**kw):
  return lnn.Stack(Block, length=L, **kw)(name='blocks')


def ref_model(nn, length=L, rate=0.0):
  _, _, wrapped = blocks(nn)
  scan = nn.scan(wrapped, variable_axes={'params': 0},
                 split_rngs={'params': True, 'dropout': True}, length=length,
                 in_axes=nn.broadcast)
  return scan(rate=rate, name='blocks')


class Holder(lnn.Module):
  """A parent module, so the stack's path is /blocks."""
  make: object
  use_scan: bool = False

  @lnn.compact
  def __call__(self, x, *args, **kwargs):
    stack = self.make()
    return (stack.scan if self.use_scan else stack)(x, *args, **kwargs)


CONFIGS = [
    dict(),
    dict(policy='full'),
    dict(policy=lnn.StackPolicy(nested=2, save_block_internals=['mlp_up'])),
    dict(mode='unrolled'),
    dict(mode='unrolled', policy='nested'),
]
RNGS = {'dropout': jax.random.key(7)}


def _stack(cfg, rate=0.0):
  return lnn.Stack(Block, length=L, **cfg)(rate=rate, name='blocks')


def _loss(model, wrapped):
  def loss(v):
    out = model.apply(v, X, False, rngs=RNGS)
    return jnp.sum((out[0] if wrapped else out) ** 2)
  return loss


@pytest.fixture(scope='module')
def reference():
  """Variables, dropout outputs and gradients of a hand-written nn.scan
  (liftmods), checked once against flax.linen's."""
  flax_vars = ref_model(fnn).init(KEY, X)
  variables = ref_model(lnn).init(KEY, X)
  assert_identical(variables['params'], dict(flax_vars['params']))
  ref = ref_model(lnn, rate=0.3)
  y = ref.apply(variables, X, False, rngs=RNGS)[0]
  y_flax = ref_model(fnn, rate=0.3).apply(variables, X, False, rngs=RNGS)[0]
  np.testing.assert_allclose(y, y_flax, rtol=1e-6, atol=1e-6)
  grads = jax.jit(jax.grad(_loss(ref, True)))(variables)
  return variables, y, grads


def assert_same_init(init, reference_init, *args):
  """``init(KEY, *args)`` against ``reference_init``'s, both jitted: bit
  for bit where they compile to the same program, else to the initializers'
  float32 rounding (a few ulps), which another program may round otherwise
  on another CPU."""
  (ours, hlo), (theirs, ref_hlo) = (run_compiled(jax.jit(i), KEY, *args)
                                    for i in (init, reference_init))
  assert_match(ours, theirs, [(hlo, ref_hlo)], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('cfg', CONFIGS, ids=str)
def test_init_outputs_grads_match_hand_written_scan(cfg, reference):
  variables, y_ref, g_ref = reference
  assert_same_init(_stack(cfg).init, ref_model(lnn).init, X)
  model = _stack(cfg, rate=0.3)
  y = model.apply(variables, X, False, rngs=RNGS)  # same dropout masks
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  g = jax.jit(jax.grad(_loss(model, False)))(variables)
  assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('length,nested', [(7, 3), (10, 3)])
def test_nested_uneven_groups_grads_equal_flat(length, nested):
  flat = lnn.Stack(Tiny, length=length, policy='full')(name='blocks')
  deep = lnn.Stack(Tiny, length=length,
                   policy=lnn.StackPolicy(nested=nested))(name='blocks')
  variables = flat.init(KEY, X)
  assert_same_init(deep.init, flat.init, X)
  loss = lambda m: jax.grad(lambda v: jnp.sum(m.apply(v, X) ** 2))
  g_flat, g_deep = jax.jit(loss(flat))(variables), jax.jit(loss(deep))(
      variables)
  assert_close(g_flat, g_deep, rtol=1e-5, atol=1e-5)
  assert jax.tree_util.tree_leaves(g_deep)[0].shape[0] == length


def test_group_sizes():
  pol = lnn.StackPolicy
  assert pol(nested=True).groups(64) == 8
  assert pol(nested=True).groups(61) == 8   # 7 groups of 8, then 5
  assert pol(nested=True).groups(7) == 3    # 3 + 3 + 1
  # 'nested' falls back to flat when grouping would keep more bytes.
  assert pol(nested=True).groups(4) is None  # 2 + 2 carries, not fewer
  assert pol(nested=True).groups(7, carry_bytes=2048,
                                 sliced_bytes=16384) is None
  assert pol(nested=True).groups(61, carry_bytes=2048,
                                 sliced_bytes=150_000) is None
  assert pol(nested=True).groups(61, carry_bytes=1 << 19,
                                 sliced_bytes=8 << 20) == 8
  assert pol(nested=3).groups(10) == 4      # 4 + 4 + 2
  assert pol(nested=100).groups(5) == 1
  assert pol().groups(64) is None


SCAN_CONFIGS = [dict(policy='nested'),
                dict(mode='unrolled', policy='save_all')]


@pytest.mark.parametrize('cfg', SCAN_CONFIGS, ids=str)
def test_scan_per_layer_inputs_match_nn_scan(cfg):
  scale = jnp.linspace(0.5, 1.5, L)
  bias = jnp.full((H,), 0.1)
  stack = lnn.Stack(ScanBlock, length=L, in_axes=(0, lnn.broadcast),
                    **cfg)(name='blocks')
  ref = lnn.scan(ScanBlock, variable_axes={'params': 0},
                 split_rngs={'params': True},
                 in_axes=(0, lnn.broadcast))(name='blocks')
  fref = fnn.scan(blocks(fnn)[1], variable_axes={'params': 0},
                  split_rngs={'params': True},
                  in_axes=(0, fnn.broadcast))(name='blocks')
  variables = ref.init(KEY, X, scale, bias)
  assert_same_init(lambda *a: stack.init(*a, method='scan'), ref.init, X,
                   scale, bias)
  out = stack.apply(variables, X, scale, bias, method='scan')
  expected = ref.apply(variables, X, scale, bias)
  assert out[1].shape == (L, 3)
  assert_close(out, expected, rtol=1e-5, atol=1e-5)
  assert_close(expected, fref.apply(variables, X, scale, bias),
               rtol=1e-5, atol=1e-5)

  def loss(fn):
    def f(v, s):
      c, ys = fn(v, s)
      return jnp.sum(c ** 2) + jnp.sum(jnp.sin(ys))
    return jax.jit(jax.grad(f, argnums=(0, 1)))

  g = loss(lambda v, s: stack.apply(v, X, s, bias, method='scan'))(
      variables, scale)
  g_ref = loss(lambda v, s: ref.apply(v, X, s, bias))(variables, scale)
  assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


def test_unroll_passes_through():
  stack = lnn.Stack(ScanBlock, length=4, in_axes=(0, lnn.broadcast),
                    unroll=2)(name='blocks')
  args = (X, jnp.ones(4), 0.0)
  variables = stack.init(KEY, *args, method='scan')
  jaxpr = str(jax.make_jaxpr(
      lambda v: stack.apply(v, *args, method='scan'))(variables))
  assert 'unroll=2' in jaxpr


def test_unrolled_mode_has_no_loop_and_applies_policy():
  variables = stack_model().init(KEY, X)

  def residuals(**cfg):
    model = _stack(cfg)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      jax.ad_checkpoint.print_saved_residuals(
          lambda v: model.apply(v, X), variables)
    return buf.getvalue()

  jaxpr = str(jax.make_jaxpr(lambda v: _stack(dict(
      mode='unrolled')).apply(v, X))(variables))
  assert 'scan' not in jaxpr
  full = residuals(mode='unrolled', policy='full')
  assert full.count("named 'stack_carry'") == L
  assert "'mlp_up'" not in full
  named = residuals(mode='unrolled', policy=lnn.StackPolicy(
      save_block_internals=['mlp_up']))
  assert named.count("named 'mlp_up'") == L
  none = residuals(mode='unrolled')
  assert 'stack_carry' not in none and len(none.splitlines()) > 2 * L


def test_memory_ordering_of_policies():
  x = jax.random.normal(jax.random.key(1), (256, 16))
  depth = 9

  def temp(**cfg):
    model = lnn.Stack(Tiny, length=depth, **cfg)(name='blocks')
    variables = lnn.Stack(Tiny, length=depth)(name='blocks').init(KEY, x)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x))))
    return grad.lower(variables).compile().memory_analysis(
    ).temp_size_in_bytes

  none, save_all = temp(), temp(policy='save_all')
  named = temp(policy=lnn.StackPolicy(save_block_internals=('mlp_up',)))
  full, nested = temp(policy='full'), temp(policy='nested')
  assert none >= save_all > named > full > nested
  # Saving a named internal costs exactly its activations, once per layer.
  per_layer = 256 * 32 * 4
  assert (depth - 1) * per_layer <= named - full <= (depth + 1) * per_layer


def test_unstack_stack_round_trip():
  variables = stack_model().init(KEY, X)
  layers = lnn.unstack_layers(variables['params'])
  assert sorted(layers) == [f'layers_{i}' for i in range(L)]
  assert layers['layers_3']['Dense_0']['kernel'].shape == (H, 2 * H)
  np.testing.assert_array_equal(
      layers['layers_3']['gain'], variables['params']['gain'][3])
  assert_identical(lnn.stack_layers(layers), variables['params'])
  with pytest.raises(ValueError, match='layers_0 ... layers_<L-1>'):
    lnn.stack_layers({'layer_0': {}})
  with pytest.raises(ValueError, match='not 0 ... 1'):
    lnn.stack_layers({'layers_0': {'w': 1.0}, 'layers_2': {'w': 1.0}})


def test_loads_unscanned_linen_checkpoint():
  fblock = blocks(fnn)[0]

  class Unscanned(fnn.Module):

    @fnn.compact
    def __call__(self, x):
      for i in range(L):
        x = fblock(name=f'layers_{i}')(x)
      return x

  linen_vars = Unscanned().init(KEY, X)
  stacked = {'params': lnn.stack_layers(dict(linen_vars['params']))}
  for cfg in (dict(), dict(mode='unrolled'), dict(policy='nested')):
    y = _stack(cfg).apply(stacked, X)
    np.testing.assert_allclose(y, Unscanned().apply(linen_vars, X),
                               rtol=1e-5, atol=1e-6)
  back = lnn.unstack_layers(stacked['params'])
  assert_identical(back, dict(linen_vars['params']))


class Sharded(lnn.Module):

  @lnn.compact
  def __call__(self, x):
    init = lnn.with_partitioning(lnn.initializers.lecun_normal(),
                                 ('embed', 'mlp'))
    return x @ self.param('w', init, (x.shape[-1], x.shape[-1]))


@pytest.mark.parametrize('cfg,name', [(dict(), 'layers'),
                                      (dict(policy='nested'), 'layers'),
                                      (dict(metadata_params={
                                          lnn.PARTITION_NAME: 'stage'}),
                                       'stage')])
def test_partition_metadata(cfg, name):
  model = lnn.Stack(Sharded, length=L, **cfg)(name='blocks')
  variables = model.init(KEY, X)
  box = variables['params']['w']
  assert isinstance(box, lnn.Partitioned)
  assert box.names == (name, 'embed', 'mlp') and box.value.shape == (L, H, H)
  y = model.apply(variables, X)
  np.testing.assert_allclose(y, model.apply(lnn.unbox(variables), X))
  layers = lnn.unstack_layers(variables['params'],
                              metadata_params={lnn.PARTITION_NAME: name})
  assert layers['layers_0']['w'].names == ('embed', 'mlp')
  again = lnn.stack_layers(layers, metadata_params={lnn.PARTITION_NAME: name})
  assert again['w'].names == box.names


def test_policy_shorthands():
  of = lnn.StackPolicy.of
  assert of(None) is None and of(False) is None
  assert of(True) == of('full') == lnn.StackPolicy()
  assert of('save_all').save_block_internals is True
  assert of('nested').nested is True
  assert of('offload').save_carries == 'offload'
  with pytest.raises(ValueError, match="'full'"):
    of('fast')
  with pytest.raises(ValueError, match='save_carries'):
    lnn.StackPolicy(save_carries='host')
  with pytest.raises(ValueError, match='nested'):
    lnn.StackPolicy(nested=0)


def test_error_fold_with_scan_block():
  stack = Holder(lambda: lnn.Stack(ScanBlock, length=3)(name='blocks'))
  with pytest.raises(errors.StackError, match=r'/blocks.*use stack.scan'):
    stack.init(KEY, X, 1.0, 0.0)


def test_error_scan_with_fold_block():
  model = lnn.Stack(Block, length=3)(name='blocks')
  with pytest.raises(errors.StackError, match='pair .carry, output.'):
    model.init(KEY, X, method='scan')


def test_error_bad_signature():
  stack = Holder(lambda: lnn.Stack(Block, length=3)(name='blocks'))
  with pytest.raises(errors.StackError,
                     match=r'Stack at /blocks: Block.__call__.*cannot be '
                     'called'):
    stack.init(KEY, X, True, 1.0)


def test_error_per_layer_leading_axis():
  stack = Holder(lambda: lnn.Stack(ScanBlock, length=L, in_axes=(
      0, lnn.broadcast))(name='blocks'), use_scan=True)
  with pytest.raises(errors.StackError,
                     match=r'/blocks: argument 1 is declared per-layer.*'
                     rf'layers {L}; got shape \(4,\)'):
    stack.init(KEY, X, jnp.ones(4), 0.0)
  with pytest.raises(errors.StackError, match='in_axes has 2 entries'):
    stack.init(KEY, X, jnp.ones(L))


def test_error_bad_target():
  with pytest.raises(errors.TransformTargetError):
    lnn.Stack(Block(), length=2)
  with pytest.raises(ValueError, match='mode'):
    lnn.Stack(Block, length=2, mode='loop')


@pytest.mark.skipif(jax.default_backend() != 'cpu',
                    reason='the warning is for backends without host memory')
def test_offload_on_cpu_warns_and_keeps_gradients():
  def holder(policy):
    return Holder(lambda: lnn.Stack(Tiny, length=L, policy=policy)(
        name='blocks'))

  variables = holder(None).init(KEY, X)
  offload = lnn.StackPolicy(save_carries='offload',
                            offload_block_internals=['mlp_up'])

  def grad(policy):
    loss = lambda v: jnp.sum(holder(policy).apply(v, X) ** 2)
    return jax.jit(jax.grad(loss))(variables)

  with pytest.warns(StackOffloadWarning, match=r'Stack at /blocks.*'
                    r"'mlp_up', 'stack_carry'.*device memory instead"):
    g = grad(offload)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    g_plain = grad('full')
  assert_close(g, g_plain, rtol=1e-5, atol=1e-5)


class _CountingBlock(lnn.Module):
  """Draws ``DRAWS[0]`` dropout keys per layer (module-global, so a test can
  change what a repeated trace does); counts its traces in ``CALLS``."""

  @lnn.compact
  def __call__(self, x):
    CALLS[0] += 1
    for _ in range(DRAWS[0]):
      x = x + jax.random.uniform(self.make_rng('dropout'), x.shape)
    return x + lnn.Dense(x.shape[-1])(x)


CALLS, DRAWS = [0], [1]


def _counting_apply(draws):
  """A fresh jit trace of a stack apply with ``draws`` keys per layer;
  returns (output, block traces)."""
  DRAWS[0], CALLS[0] = draws, 0
  model = lnn.Stack(_CountingBlock, length=3, policy='full')(name='blocks')
  variables = model.init({'params': KEY, 'dropout': KEY}, X)
  CALLS[0] = 0
  y = jax.jit(lambda v: model.apply(v, X, rngs=RNGS))(variables)
  return y, CALLS[0]


def test_repeated_trace_traces_each_layer_once_with_the_same_keys():
  RngReplay.cache.clear()
  first, calls_first = _counting_apply(1)
  again, calls_again = _counting_apply(1)
  assert (calls_first, calls_again) == (2, 1)  # abstract + loop, then loop
  np.testing.assert_array_equal(first, again)
  # The block now draws differently: the recorded counters no longer fit,
  # so the trace starts over and gives what a fresh trace gives.
  changed, calls_changed = _counting_apply(2)
  RngReplay.cache.clear()
  fresh, _ = _counting_apply(2)
  assert calls_changed >= 2
  np.testing.assert_array_equal(changed, fresh)
  assert not np.array_equal(changed, first)


def test_nested_policy_init_is_the_plain_scans_program():
  """Under jit a nested policy's groups rounded a truncated-normal kernel a
  few ulp away from the plain scan's (stack fuzz seed 41002); init is not
  differentiated, so it runs the plain scan's program, bit for bit."""
  class Block(lnn.Module):
    def setup(self):
      self.v1 = self.variable('state', 'v1', jnp.zeros, (4,), jnp.float32)
      self.norm = lnn.LayerNorm()
      self.dense = lnn.Dense(4)

    def __call__(self, x):
      if self.is_mutable_collection('state'):
        self.v1.value = self.v1.value + jnp.mean(x.reshape(-1, 4), axis=0)
      return self.dense(self.norm(x + self.v1.value))

  class Layer(lnn.Module):
    @lnn.compact
    def __call__(self, x, s):
      return Block(name='block')(x + s)

  def init(policy):
    class Model(lnn.Module):
      @lnn.compact
      def __call__(self, x):
        s = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
        return lnn.Stack(Layer, length=2, policy=policy, mode='scan',
                         in_axes=0, unroll=2)(name='stack')(x, s)

    before = jax.config.read('jax_disable_most_optimizations')
    jax.config.update('jax_disable_most_optimizations', True)  # the fuzzer's
    try:
      return jax.jit(Model().init)(jax.random.key(0), jnp.full((2, 3, 4), 0.3))
    finally:
      jax.config.update('jax_disable_most_optimizations', before)

  assert_identical(init(lnn.StackPolicy(nested=2)), init(None))
