"""nn.precision_policy against flax.linen with dtype/param_dtype threaded by
hand through every layer (the oracle), plus the policy's own rules and
errors.

The model is written once against a Linen-style namespace; ``dt`` is the
keyword arguments each layer gets: ``{}`` for the liftmods model run under
the policy, ``{'dtype': bf16, 'param_dtype': f32}`` for the hand-threaded
models. Variables, outputs and gradients are compared bit for bit.
"""
import types
import warnings

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as nn
from liftmods.module import active_interceptors

pytestmark = pytest.mark.usefixtures('fast_compiles')

BF16, F32 = jnp.bfloat16, jnp.float32
MIXED = nn.Precision(compute_dtype=BF16, param_dtype=F32, output_dtype=F32)
THREADED = {'dtype': BF16, 'param_dtype': F32}


def build(lib, dt):
  """An LM-like model using Embed, LayerNorm, RMSNorm, attention, Dense,
  DenseGeneral and Conv; ``dt`` goes to every layer."""

  class Block(lib.Module):

    @lib.compact
    def __call__(self, x):
      h = lib.LayerNorm(**dt)(x)
      h = lib.MultiHeadDotProductAttention(num_heads=2, **dt)(h, h)
      x = x + h
      h = lib.RMSNorm(**dt)(x)
      h = lib.Conv(8, kernel_size=(3,), **dt)(h)
      h = lib.DenseGeneral((2, 8), **dt)(lib.gelu(h))
      return x + lib.Dense(8, **dt)(h.reshape(h.shape[:-2] + (-1,)))

  class Model(lib.Module):

    @lib.compact
    def __call__(self, tokens):
      x = lib.Embed(11, 8, **dt)(tokens)
      x = Block()(x)
      return lib.Dense(11, **dt)(lib.LayerNorm(**dt)(x))

  return Model()


TOKENS = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])


def bits(x):
  x = np.asarray(x)
  return x.view(f'u{x.dtype.itemsize}')


def assert_same_bits(expected, actual):
  e = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_map(
      np.asarray, fnn.meta.unbox(expected)))[0]
  a = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_map(
      np.asarray, actual))[0]
  assert [p for p, _ in e] == [p for p, _ in a]
  for (path, x), (_, y) in zip(e, a):
    assert x.dtype == y.dtype and x.shape == y.shape, (path, x.dtype, y.dtype)
    np.testing.assert_array_equal(bits(x), bits(y), err_msg=str(path))


def loss_fn(apply):
  """The loss (and the logits) in f32. The hand-threaded model returns
  bf16 logits: the cast is part of both programs, so that XLA (which may
  keep excess precision across a bf16 -> f32 convert) sees the same ops."""
  def loss(params):
    logits = apply({'params': params}, TOKENS).astype(F32)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
  return loss


def deterministic_params():
  """Parameters of the model's shapes and f32 dtype, without compiling an
  init (random initializers make the program several times larger)."""
  shapes = jax.eval_shape(build(nn, {}).init, jax.random.key(0), TOKENS)
  leaves, tree = jax.tree_util.tree_flatten(shapes['params'])
  values = [np.sin(np.arange(leaf.size, dtype=np.float32) * (0.37 + i))
            .reshape(leaf.shape) / 2 for i, leaf in enumerate(leaves)]
  return jax.tree_util.tree_unflatten(tree, values)


def run_model(model, params):
  """Output, loss and gradients, compiled as one program (eager execution
  would compile every op on its own, which takes far longer)."""
  step = jax.jit(jax.value_and_grad(loss_fn(model.apply), has_aux=True))
  (loss, y), grads = step(params)
  return types.SimpleNamespace(y=y, loss=loss, grads=grads)


@pytest.fixture(scope='module')
def params():
  return deterministic_params()


@pytest.fixture(scope='module')
def oracle(params):
  return run_model(build(fnn, THREADED), params)


@pytest.fixture(scope='module')
def policied(params):
  with nn.precision_policy(MIXED):
    return run_model(build(nn, {}), params)


def test_init_gives_the_variables_linen_gives_with_dtypes_threaded():
  key = jax.random.key(0)
  expected = jax.eval_shape(build(fnn, THREADED).init, key, TOKENS)
  threaded = build(nn, THREADED)
  with nn.precision_policy(MIXED):
    got = jax.eval_shape(build(nn, {}).init, key, TOKENS)
    # The same program as liftmods with the fields threaded by hand (whose
    # values equal Linen's bit for bit: tests/test_layers_*.py).
    model = build(nn, {})
    init_jaxpr = str(jax.make_jaxpr(
        lambda k: model.init_with_output(k, TOKENS))(key))
  assert (jax.tree_util.tree_structure(fnn.meta.unbox(expected))
          == jax.tree_util.tree_structure(got))
  assert (jax.tree_util.tree_map(lambda s: (s.shape, s.dtype),
                                 fnn.meta.unbox(expected))
          == jax.tree_util.tree_map(lambda s: (s.shape, s.dtype), got))

  def threaded_init(key):
    y, variables = threaded.init_with_output(key, TOKENS)
    return y.astype(F32), variables

  assert init_jaxpr == str(jax.make_jaxpr(threaded_init)(key))


def test_apply_equals_linen_with_dtypes_threaded(oracle, policied):
  assert_same_bits(oracle.y, policied.y)


def test_loss_f32_and_gradients_in_param_dtype(oracle, policied):
  assert policied.loss.dtype == F32
  np.testing.assert_array_equal(bits(oracle.loss), bits(policied.loss))
  assert {g.dtype for g in jax.tree_util.tree_leaves(policied.grads)} == {
      np.dtype(F32)}
  assert_same_bits(oracle.grads, policied.grads)


def test_same_program_as_liftmods_threaded_by_hand(params):
  """Up to the final cast to output_dtype, the jaxpr is the one written
  with dtype/param_dtype on every layer."""
  variables = {'params': params}
  threaded, model = build(nn, THREADED), build(nn, {})
  expected = jax.make_jaxpr(
      lambda v: threaded.apply(v, TOKENS).astype(F32))(variables)

  def run(v):
    with nn.precision_policy(MIXED):
      return model.apply(v, TOKENS)

  assert str(jax.make_jaxpr(run)(variables)) == str(expected)


def test_no_policy_registers_nothing_and_leaves_the_program(params):
  model, variables = build(nn, {}), {'params': params}
  before = str(jax.make_jaxpr(model.apply)(variables, TOKENS))
  assert active_interceptors() == ()
  with nn.precision_policy(MIXED):
    assert len(active_interceptors()) == 1
    inside = str(jax.make_jaxpr(model.apply)(variables, TOKENS))
  assert active_interceptors() == ()
  assert inside != before
  assert str(jax.make_jaxpr(model.apply)(variables, TOKENS)) == before


def test_batchnorm_statistics_stay_f32():
  x = jnp.linspace(-2, 3, 24).reshape(4, 6)

  def run(lib, dt):
    layer = lib.BatchNorm(use_running_average=False, **dt)
    v = layer.init(jax.random.key(0), x)
    return layer.apply(v, x, mutable=['batch_stats'])

  y, stats = jax.jit(lambda: run(fnn, THREADED))()
  with nn.precision_policy(MIXED):
    y2, stats2 = jax.jit(lambda: run(nn, {}))()
  assert {s.dtype for s in jax.tree_util.tree_leaves(stats2)} == {
      np.dtype(F32)}
  assert_same_bits(stats, stats2)
  assert_same_bits(y.astype(F32), y2)


def test_fields_restored_after_the_call():
  """A bound module keeps its own fields: the policy sets them for its
  calls inside the block only."""
  dense = nn.Dense(2).bind(
      {'params': {'kernel': jnp.ones((8, 2)), 'bias': jnp.zeros(2)}})
  x = jnp.ones((1, 8))
  with nn.precision_policy(MIXED):
    inside = jax.make_jaxpr(dense)(x)
  assert _dot_dtypes(inside.jaxpr, []) == [BF16]
  assert inside.out_avals[0].dtype == F32
  assert dense.dtype is None and dense.param_dtype is F32
  assert _dot_dtypes(jax.make_jaxpr(dense)(x).jaxpr, []) == [F32]


class Head(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name='out')(x)


class Net(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name='body')(x)
    return Head(name='head')(x)


def run_net(policy, x=jnp.ones((1, 2))):
  """Under ``policy``: the dtype each Dense computes in (its dot_general),
  the kernels' dtypes and the output dtype; traced, not run."""
  with nn.precision_policy(policy):
    v = jax.eval_shape(Net().init, jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(lambda v: Net().apply(v, x))(v)
  body, out = _dot_dtypes(jaxpr.jaxpr, [])
  return {'body': body, 'head/out': out, 'y': jaxpr.out_avals[0].dtype,
          'params': {'body': v['params']['body']['kernel'].dtype,
                     'head/out': v['params']['head']['out']['kernel'].dtype}}


def test_class_entry_and_output_cast_at_region_boundaries():
  got = run_net({nn.Dense: nn.Precision(compute_dtype=BF16,
                                        output_dtype=F32)})
  assert got['body'] == got['head/out'] == BF16
  # Each Dense is its own region (its caller has no entry): its output is
  # cast on exit, so Head hands back f32 too.
  assert got['y'] == F32
  with nn.precision_policy({nn.Dense: nn.Precision(output_dtype=BF16)}):
    x = jnp.ones((1, 2))
    jaxpr = jax.make_jaxpr(lambda v: Net().apply(v, x))(
        jax.eval_shape(Net().init, jax.random.key(0), x))
  casts = [e.params['new_dtype'] for e in jaxpr.jaxpr.eqns
           if e.primitive.name == 'convert_element_type']
  # body's output to bf16, back to f32 where head/out (dtype=None) promotes
  # it with its f32 kernel, head/out's output to bf16; none for Net or Head.
  assert casts == [BF16, F32, BF16]
  assert jaxpr.out_avals[0].dtype == BF16
  assert got['params'] == {'body': F32, 'head/out': F32}


def test_path_glob_beats_class_and_longer_glob_beats_shorter():
  f16 = nn.Precision(compute_dtype=jnp.float16)
  got = run_net({nn.Dense: nn.Precision(compute_dtype=BF16),
                 'head*': nn.Precision(compute_dtype=F32),
                 'head/out': f16})
  assert got['body'] == BF16 and got['head/out'] == jnp.float16
  got = run_net({nn.Module: nn.Precision(compute_dtype=BF16),
                 'head*': nn.Precision(compute_dtype=F32)})
  assert got['body'] == BF16 and got['head/out'] == F32


def test_subclass_entry_beats_base_class():
  class Wide(nn.Dense):
    pass

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(x), Wide(2)(x)

  with nn.precision_policy({nn.Dense: nn.Precision(compute_dtype=BF16),
                            Wide: nn.Precision(compute_dtype=jnp.float16)}):
    (a, b), _ = jax.eval_shape(Two().init_with_output, jax.random.key(0),
                               jnp.ones((1, 2)))
  assert a.dtype == BF16 and b.dtype == jnp.float16


def test_inner_policy_wins_and_outer_fills_in():
  outer = {'body': nn.Precision(compute_dtype=BF16),
           'head/out': nn.Precision(compute_dtype=BF16)}
  with nn.precision_policy(outer):
    got = run_net({'head/*': nn.Precision(compute_dtype=jnp.float16)})
  assert got['body'] == BF16 and got['head/out'] == jnp.float16


def test_param_dtype_only():
  got = run_net(nn.Precision(param_dtype=BF16))
  assert got['params'] == {'body': BF16, 'head/out': BF16}
  assert got['y'] == F32  # dtype=None: f32 inputs and bf16 params give f32


def test_lifted_jit_cache_keys_on_the_policy():
  JitNet = nn.jit(Net)
  x = jnp.ones((1, 2))
  v = JitNet().init(jax.random.key(0), x)
  assert JitNet().apply(v, x).dtype == F32
  with nn.precision_policy(nn.Precision(compute_dtype=BF16)):
    assert JitNet().apply(v, x).dtype == BF16
  with nn.precision_policy(nn.Precision(compute_dtype=BF16)):
    assert JitNet().apply(v, x).dtype == BF16
  assert JitNet().apply(v, x).dtype == F32


def test_scan_under_policy_equals_linen_scan_threaded():
  def build_scan(lib, dt):
    class Cell(lib.Module):
      @lib.compact
      def __call__(self, c, _):
        return lib.Dense(4, **dt)(lib.LayerNorm(**dt)(c)), None

    class Loop(lib.Module):
      @lib.compact
      def __call__(self, x):
        scan = lib.scan(Cell, variable_axes={'params': 0},
                        split_rngs={'params': True}, length=3)
        return scan()(x, None)[0]
    return Loop()

  x = jnp.linspace(0, 1, 8, dtype=BF16).reshape(2, 4)  # a bf16 carry
  oracle, model = build_scan(fnn, THREADED), build_scan(nn, {})
  shapes = jax.eval_shape(oracle.init, jax.random.key(0), x)
  with nn.precision_policy(MIXED):
    assert jax.eval_shape(model.init, jax.random.key(0), x) == shapes
  params = jax.tree_util.tree_map(
      lambda s: np.cos(np.arange(s.size, dtype=np.float32)).reshape(s.shape),
      shapes)
  y = jax.jit(lambda v: oracle.apply(v, x).astype(F32))(params)
  with nn.precision_policy(MIXED):
    assert_same_bits(y, jax.jit(lambda v: model.apply(v, x))(params))


@pytest.mark.parametrize('value, message', [
    ('bfloat17', "compute_dtype='bfloat17'\\): not a dtype"),
    (jnp.int32, 'expected a floating dtype.*got int32'),
])
def test_bad_dtype(value, message):
  with pytest.raises(nn.PrecisionPolicyError, match=message):
    nn.Precision(compute_dtype=value)


def test_bad_mapping():
  with pytest.raises(nn.PrecisionPolicyError, match='key 3: expected a '
                     'Module subclass or a path glob'):
    with nn.precision_policy({3: MIXED}):
      pass
  with pytest.raises(nn.PrecisionPolicyError,
                     match="entry 'a/b': expected a Precision, got dict"):
    with nn.precision_policy({'a/b': {}}):
      pass
  with pytest.raises(nn.PrecisionPolicyError, match='got str'):
    with nn.precision_policy('bf16'):
      pass


def test_entering_inside_a_module_method_raises():
  class Late(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(2)(x)
      with nn.precision_policy(MIXED):
        return nn.Dense(2)(x)

  with pytest.raises(nn.PrecisionPolicyError,
                     match='entered inside a method of Late at /'):
    Late().init(jax.random.key(0), jnp.ones((1, 2)))
  assert active_interceptors() == ()


def test_glob_that_matches_nothing_warns_once():
  policy = {'decoder_unmatched/*': MIXED, 'head/*': MIXED}
  with pytest.warns(nn.PrecisionPolicyWarning,
                    match="'decoder_unmatched/\\*' matched no module") as rec:
    run_net(policy)
  assert len(rec) == 1
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    run_net(policy)


def _dot_dtypes(jaxpr, found):
  """The output dtypes of every dot_general in ``jaxpr`` and its
  sub-jaxprs (scan and remat bodies)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      found.append(eqn.outvars[0].aval.dtype)
    for param in eqn.params.values():
      inner = getattr(param, 'jaxpr', param)
      if hasattr(inner, 'eqns'):
        _dot_dtypes(inner, found)
  return found


def test_lm_demo_with_stack_computes_in_bf16():
  """The policy reaches inside nn.Stack (scan + remat), SelfAttention and
  Embed.attend of the demo LM, with no change to its code."""
  from examples.lm import model as lm
  config = lm.Config(num_layers=2, d_model=16, num_heads=2, max_len=8)
  model = lm.TransformerLM(config)
  tokens = jnp.zeros((2, 8), jnp.int32)
  with nn.precision_policy(MIXED):
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, tokens))(variables)
  assert {v.dtype for v in jax.tree_util.tree_leaves(variables)} == {
      np.dtype(F32)}
  # qkv and out projections, the two attention products, two MLP layers,
  # and the tied output projection.
  assert _dot_dtypes(jaxpr.jaxpr, []) == [BF16] * 9
  assert jaxpr.out_avals[0].dtype == F32


def test_entry_overrides_a_dtype_the_code_gave():
  class Fixed(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2, dtype=F32, name='head')(x)

  x = jnp.ones((1, 2))
  v = jax.eval_shape(Fixed().init, jax.random.key(0), x)

  def dots(policy):
    with nn.precision_policy(policy):
      jaxpr = jax.make_jaxpr(lambda v: Fixed().apply(v, x))(v)
    return _dot_dtypes(jaxpr.jaxpr, [])

  assert dots({}) == [F32]
  assert dots(nn.Precision(compute_dtype=BF16)) == [BF16]
  assert dots({nn.Module: nn.Precision(compute_dtype=BF16),
               'head': nn.Precision(compute_dtype=F32)}) == [F32]


def test_jax_jit_traces_again_when_the_policy_changes():
  x = jnp.ones((1, 2))
  v = jax.eval_shape(Net().init, jax.random.key(0), x)
  v = jax.tree_util.tree_map(lambda s: jnp.ones(s.shape, s.dtype), v)
  apply = jax.jit(Net().apply)
  bf16 = nn.Precision(compute_dtype=BF16)
  assert apply(v, x).dtype == F32
  with nn.precision_policy(bf16):
    assert apply(v, x).dtype == BF16
    lowered = apply.lower(v, x)
  assert apply(v, x).dtype == F32
  assert lowered.compile()(v, x).dtype == BF16


def test_equal_policies_share_jit_cache_entries():
  traces = []

  def apply(v, x):
    traces.append(None)
    return nn.Dense(2).apply(v, x)

  apply = jax.jit(apply)
  x = jnp.ones((1, 2))
  v = {'params': {'kernel': jnp.ones((2, 2)), 'bias': jnp.zeros(2)}}
  for _ in range(3):
    with nn.precision_policy(nn.Precision(compute_dtype=BF16)):
      assert apply(v, x).dtype == BF16
  assert len(traces) == 1
  with nn.precision_policy(nn.Precision(compute_dtype=jnp.float16)):
    assert apply(v, x).dtype == jnp.float16
  assert len(traces) == 2
