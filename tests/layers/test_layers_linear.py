"""Differential tests: liftmods.layers.linear against flax.linen (the oracle).

Every case builds the same model class twice, once over ``flax.linen`` and
once over liftmods, and checks: the same variable tree (structure, shapes,
dtypes), bit-identical initial values for several seeds, equal outputs and
equal parameter gradients. Both sides run the same lax ops, so outputs and
gradients are compared bit for bit.
"""
import dataclasses
import functools
import inspect
import types

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import treecheck
from liftmods import initializers as linit
from liftmods import module as lmodule
from liftmods.core import meta as lmeta
from liftmods.layers import linear

pytestmark = pytest.mark.usefixtures('fast_compiles')

LAYERS = ('Dense', 'DenseGeneral', 'Einsum', 'Conv', 'ConvLocal',
          'ConvTranspose', 'Embed')

FLAX = types.SimpleNamespace(Module=fnn.Module, compact=fnn.compact,
                             initializers=fnn.initializers,
                             with_partitioning=fnn.with_partitioning,
                             **{n: getattr(fnn, n) for n in LAYERS})
LIFT = types.SimpleNamespace(Module=lmodule.Module, compact=lmodule.compact,
                             initializers=linit,
                             with_partitioning=lmeta.with_partitioning,
                             **{n: getattr(linear, n) for n in LAYERS})
SEEDS = (0, 1, 2)
BF16 = jnp.bfloat16


def make_model(nn, make_layer, call=None):
  """``M`` over namespace ``nn``: builds ``make_layer(nn)`` inline and calls
  it (or ``call(layer, *args)``)."""

  class M(nn.Module):

    @nn.compact
    def __call__(self, *args):
      layer = make_layer(nn)
      return layer(*args) if call is None else call(layer, *args)

  return M()


def rand(seed, shape, dtype=jnp.float32):
  """Normal inputs made with numpy (no XLA compilation needed)."""
  x = np.random.default_rng(100 + seed).standard_normal(shape, np.float32)
  return jnp.asarray(x.astype(dtype))


def ints(seed, shape, high, dtype=jnp.int32):
  x = np.random.default_rng(200 + seed).integers(-high, high, shape)
  return jnp.asarray(x.astype(dtype))


def loss_of(model, *inputs):

  def loss(variables):
    out = model.apply(variables, *inputs)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  return loss


def runner(model, inputs, grad):
  """``key -> (variables, output, grads)`` for one model."""

  def run(key):
    out, variables = model.init_with_output(key, *inputs)
    grads = jax.grad(loss_of(model, *inputs))(variables) if grad else None
    return variables, out, grads

  return run


# Both sides are compiled together with the same options, so a cheap XLA
# optimization level changes nothing in the comparison but saves most of the
# compile time.
_FAST = {'xla_backend_optimization_level': 0,
         'xla_llvm_disable_expensive_passes': True}


def fast_jit(fn):
  try:
    return jax.jit(fn, compiler_options=_FAST)
  except TypeError:  # an older jax without compiler_options
    return jax.jit(fn)


# Container types must match too (both sides give plain dicts).
assert_identical = functools.partial(treecheck.assert_identical,
                                     same_containers=True)


def check(make_layer, *inputs, call=None, seeds=SEEDS, grad=True):
  """The whole differential comparison for one configuration. Both models
  run inside one jitted function, compiled once for all seeds."""
  run_l = runner(make_model(LIFT, make_layer, call), inputs, grad)
  run_f = runner(make_model(FLAX, make_layer, call), inputs, grad)
  both = fast_jit(lambda key: (run_l(key), run_f(key)))
  for seed in seeds:
    (vars_l, out_l, grads_l), (vars_f, out_f, grads_f) = both(
        jax.random.key(seed))
    assert_identical(vars_l, vars_f)
    assert_identical(out_l, out_f)
    if grad:
      assert_identical(grads_l, grads_f)
  return vars_l, out_l


# -- Dense ---------------------------------------------------------------------

DENSE_CASES = {
    'default': (dict(features=3), (2, 4), jnp.float32),
    'no_bias': (dict(features=3, use_bias=False), (2, 4), jnp.float32),
    'rank1': (dict(features=2), (4,), jnp.float32),
    'rank3': (dict(features=2), (2, 3, 4), jnp.float32),
    'dtype_bf16': (dict(features=3, dtype=BF16), (2, 4), jnp.float32),
    'param_bf16': (dict(features=3, param_dtype=BF16), (2, 4), jnp.float32),
    'bf16_inputs': (dict(features=3), (2, 4), BF16),
    'f32_over_bf16': (dict(features=3, dtype=jnp.float32,
                           param_dtype=BF16), (2, 4), BF16),
    'precision': (dict(features=3, precision=lax.Precision.HIGHEST), (2, 4),
                  jnp.float32),
    'dot_general': (dict(features=3, dot_general=functools.partial(
        lax.dot_general, preferred_element_type=jnp.float32)), (2, 4), BF16),
}


@pytest.mark.parametrize('case', sorted(DENSE_CASES))
def test_dense(case):
  kwargs, shape, dtype = DENSE_CASES[case]
  check(lambda nn: nn.Dense(**kwargs), rand(0, shape, dtype))


def test_dense_custom_inits_and_cls():
  make = lambda nn: nn.Dense(
      3, kernel_init=nn.initializers.normal(0.3),
      bias_init=nn.initializers.uniform(),
      dot_general_cls=lambda: lax.dot_general)
  check(make, rand(1, (2, 5)))


# -- DenseGeneral --------------------------------------------------------------

DG_CASES = {
    'int': (dict(features=3), (2, 4)),
    'tuple_features': (dict(features=(2, 3)), (2, 4)),
    'two_axes': (dict(features=(2, 3), axis=(1, -1)), (2, 3, 4, 5)),
    'negative_axes': (dict(features=2, axis=(-2, -1)), (2, 3, 4)),
    'first_axis': (dict(features=2, axis=0), (3, 4)),
    'batch1': (dict(features=(2, 3), axis=-1, batch_dims=(0,)), (2, 3, 4)),
    'batch2': (dict(features=2, axis=(-1,), batch_dims=(0, 1)), (2, 3, 4, 5)),
    'batch_no_bias': (dict(features=3, batch_dims=(0,), use_bias=False),
                      (2, 4)),
    'no_bias': (dict(features=(2, 2), axis=(-2, -1), use_bias=False),
                (2, 3, 4)),
    'bf16': (dict(features=(2, 3), dtype=BF16, param_dtype=BF16), (2, 4)),
    'uniform_bias': (dict(features=(2, 3), batch_dims=(0,),
                          bias_init=jax.nn.initializers.uniform()), (2, 4)),
}


@pytest.mark.parametrize('case', sorted(DG_CASES))
def test_dense_general(case):
  kwargs, shape = DG_CASES[case]
  check(lambda nn: nn.DenseGeneral(**kwargs), rand(2, shape))


def test_dense_general_boxed_kernel_init():
  """A kernel init that returns a Partitioned box is reshaped inside it."""

  def make(nn):
    init = nn.with_partitioning(nn.initializers.lecun_normal(),
                                ('a', 'b', 'c'))
    return nn.DenseGeneral((2, 3), kernel_init=init, use_bias=False)

  x = rand(3, (2, 4))
  for seed in SEEDS:
    vars_l = make_model(LIFT, make).init(jax.random.key(seed), x)
    vars_f = make_model(FLAX, make).init(jax.random.key(seed), x)
    box_l = vars_l['params']['DenseGeneral_0']['kernel']
    box_f = vars_f['params']['DenseGeneral_0']['kernel']
    assert isinstance(box_l, lmeta.Partitioned)
    assert box_l.names == box_f.names == ('a', 'b', 'c')
    assert_identical(box_l.value, box_f.value)


# -- Einsum --------------------------------------------------------------------

EINSUM_CASES = {
    'basic': (dict(shape=(5, 6, 7), einsum_str='abc,cde->abde'), (3, 4, 5)),
    'spaces': (dict(shape=(4, 3), einsum_str='ab , bc -> ac'), (2, 4)),
    'no_bias': (dict(shape=(5, 6), einsum_str='abc,cd->abd',
                     use_bias=False), (3, 4, 5)),
    'kernel_axis_dropped': (dict(shape=(4, 3), einsum_str='ab,bc->a'),
                            (2, 4)),
    'lhs_ellipsis': (dict(shape=(4, 3), einsum_str='...b,bc->...c'),
                     (2, 3, 4)),
    'rhs_ellipsis': (dict(shape=(4, 5, 3), einsum_str='bd,...d->b...'),
                     (2, 3)),
    'both_ellipsis': (dict(shape=(3, 4, 5), einsum_str='...c,...cd->...d'),
                      (2, 3, 4)),
    'bias_order': (dict(shape=(4, 2, 3), einsum_str='nb,bcd->dnc'), (2, 4)),
    'bf16': (dict(shape=(4, 3), einsum_str='ab,bc->ac', dtype=BF16), (2, 4)),
    'param_bf16': (dict(shape=(4, 3), einsum_str='ab,bc->ac',
                        param_dtype=BF16), (2, 4)),
    'preferred': (dict(shape=(4, 3), einsum_str='ab,bc->ac', dtype=BF16,
                       preferred_element_type=jnp.float32), (2, 4)),
}


@pytest.mark.parametrize('case', sorted(EINSUM_CASES))
def test_einsum(case):
  kwargs, shape = EINSUM_CASES[case]
  check(lambda nn: nn.Einsum(**kwargs), rand(4, shape))


def test_einsum_str_at_call_time():
  check(lambda nn: nn.Einsum((4, 3)), rand(5, (2, 4)),
        call=lambda layer, x: layer(x, 'ab,bc->ac'))


# -- Conv ----------------------------------------------------------------------

CONV_CASES = {
    'same_1d': (dict(features=3, kernel_size=(3,)), (2, 7, 2)),
    'int_kernel': (dict(features=3, kernel_size=3), (2, 7, 2)),
    'valid_2d': (dict(features=2, kernel_size=(2, 3), padding='VALID'),
                 (1, 5, 6, 2)),
    'conv_3d': (dict(features=2, kernel_size=(2, 2, 2)), (1, 3, 4, 3, 1)),
    'circular': (dict(features=2, kernel_size=(3, 2), padding='CIRCULAR'),
                 (1, 5, 4, 2)),
    'circular_dilated': (dict(features=2, kernel_size=(3,), padding='CIRCULAR',
                              kernel_dilation=2), (1, 7, 2)),
    'reflect': (dict(features=2, kernel_size=(3,), padding='REFLECT'),
                (2, 6, 2)),
    'causal': (dict(features=2, kernel_size=(3,), padding='CAUSAL',
                    kernel_dilation=2), (2, 8, 2)),
    'int_padding': (dict(features=2, kernel_size=(3, 3), padding=2),
                    (1, 4, 4, 1)),
    'pairs_padding': (dict(features=2, kernel_size=(3,), padding=[(1, 2)]),
                      (1, 5, 2)),
    'mixed_padding': (dict(features=2, kernel_size=(2, 2),
                           padding=[1, (0, 2)]), (1, 4, 4, 1)),
    'strides': (dict(features=2, kernel_size=(3, 3), strides=(1, 2)),
                (1, 5, 6, 2)),
    'strides_int': (dict(features=2, kernel_size=(3,), strides=2),
                    (2, 7, 2)),
    'strides_none': (dict(features=2, kernel_size=(3,), strides=None,
                          kernel_dilation=None, input_dilation=None),
                     (2, 7, 2)),
    'input_dilation': (dict(features=2, kernel_size=(3,), input_dilation=2,
                            padding=[(1, 2)]),
                       (1, 5, 2)),
    'kernel_dilation': (dict(features=2, kernel_size=(2, 2),
                             kernel_dilation=(2, 1)), (1, 5, 5, 1)),
    'groups': (dict(features=4, kernel_size=(3,), feature_group_count=2),
               (2, 6, 4)),
    'depthwise': (dict(features=4, kernel_size=(3,), feature_group_count=4,
                       use_bias=False), (1, 6, 4)),
    'unbatched': (dict(features=2, kernel_size=(3,)), (6, 2)),
    'two_batch_dims': (dict(features=2, kernel_size=(3,)), (2, 3, 5, 2)),
    'no_bias': (dict(features=3, kernel_size=(3,), use_bias=False),
                (2, 5, 2)),
    'bf16': (dict(features=3, kernel_size=(3,), dtype=BF16), (2, 5, 2)),
    'param_bf16': (dict(features=3, kernel_size=(3,), param_dtype=BF16),
                   (2, 5, 2)),
    'precision': (dict(features=3, kernel_size=(3,),
                       precision=lax.Precision.HIGHEST), (2, 5, 2)),
}


@pytest.mark.parametrize('case', sorted(CONV_CASES))
def test_conv(case):
  kwargs, shape = CONV_CASES[case]
  check(lambda nn: nn.Conv(**kwargs), rand(6, shape))


def test_conv_mask_and_injected_conv():
  mask = jnp.tril(jnp.ones((3, 2, 3)))
  conv = functools.partial(lax.conv_general_dilated,
                           preferred_element_type=jnp.float32)
  check(lambda nn: nn.Conv(3, (3,), mask=mask, padding='VALID',
                           conv_general_dilated=conv), rand(7, (2, 6, 2), BF16))
  check(lambda nn: nn.Conv(3, (3,), conv_general_dilated_cls=lambda: conv),
        rand(7, (2, 6, 2)))


class _Wrapped:
  """A kernel that is not a JAX type, as a quantization library's
  post-training path hands one to an injected op (qwix's ``WithAux``)."""

  def __init__(self, array):
    self.array = array


def _wrap_kernel(inputs, kernel, bias, dtype=None):
  return inputs, _Wrapped(kernel), bias


def _unwrapping(op):
  return lambda lhs, rhs, *args, **kwargs: op(lhs, rhs.array, *args, **kwargs)


@pytest.mark.parametrize('layer', ['Dense', 'Conv'])
def test_injected_op_receives_a_kernel_that_is_not_an_array(layer):
  if layer == 'Dense':
    build = lambda nn: nn.Dense(3, promote_dtype=_wrap_kernel,
                                dot_general=_unwrapping(lax.dot_general))
  else:
    build = lambda nn: nn.Conv(
        3, (3,), promote_dtype=_wrap_kernel,
        conv_general_dilated=_unwrapping(lax.conv_general_dilated))
  check(build, rand(8, (2, 6, 2)))


CONV_LOCAL_CASES = {
    'valid': (dict(features=3, kernel_size=(3,), padding='VALID'), (2, 6, 2)),
    'same_2d': (dict(features=2, kernel_size=(2, 2)), (1, 4, 3, 2)),
    'strides': (dict(features=2, kernel_size=(3,), strides=2), (1, 7, 2)),
    'circular': (dict(features=2, kernel_size=3, padding='CIRCULAR'),
                 (1, 5, 2)),
    'dilated': (dict(features=2, kernel_size=(2,), kernel_dilation=2,
                     input_dilation=2, padding=[(1, 1)]), (1, 4, 1)),
    'unbatched_no_bias': (dict(features=2, kernel_size=(3,), use_bias=False),
                          (5, 2)),
    'bf16': (dict(features=2, kernel_size=(3,), dtype=BF16,
                  param_dtype=BF16), (2, 5, 2)),
}


@pytest.mark.parametrize('case', sorted(CONV_LOCAL_CASES))
def test_conv_local(case):
  kwargs, shape = CONV_LOCAL_CASES[case]
  check(lambda nn: nn.ConvLocal(**kwargs), rand(8, shape))


def test_conv_local_mask():
  mask = jnp.tril(jnp.ones((4, 6, 3)))
  check(lambda nn: nn.ConvLocal(3, (3,), mask=mask, padding='VALID'),
        rand(9, (1, 6, 2)))


# -- ConvTranspose -------------------------------------------------------------

CONVT_CASES = {
    'same': (dict(features=3, kernel_size=(3,)), (2, 5, 2)),
    'valid': (dict(features=3, kernel_size=(3,), padding='VALID'), (2, 5, 2)),
    'int_kernel': (dict(features=2, kernel_size=3, strides=(2,)), (1, 4, 2)),
    'strides_2d': (dict(features=2, kernel_size=(3, 2), strides=(2, 1)),
                   (1, 3, 4, 2)),
    'dilation': (dict(features=2, kernel_size=(2,), kernel_dilation=(2,)),
                 (1, 5, 2)),
    'int_padding': (dict(features=2, kernel_size=(3,), padding=1), (1, 5, 2)),
    'pairs_padding': (dict(features=2, kernel_size=(3, 3),
                           padding=[(1, 0), 2]), (1, 3, 4, 1)),
    'circular': (dict(features=2, kernel_size=(3,), strides=(2,),
                      padding='CIRCULAR'), (1, 5, 2)),
    'circular_transposed': (dict(features=2, kernel_size=(4, 4),
                                 strides=(2, 2), padding='CIRCULAR',
                                 transpose_kernel=True), (1, 3, 3, 2)),
    'transpose_kernel': (dict(features=3, kernel_size=(3,), strides=(2,),
                              transpose_kernel=True), (2, 4, 2)),
    'unbatched': (dict(features=2, kernel_size=(3,)), (5, 2)),
    'two_batch_dims': (dict(features=2, kernel_size=(3,)), (2, 2, 5, 2)),
    'no_bias': (dict(features=2, kernel_size=(3,), use_bias=False),
                (2, 5, 2)),
    'bf16': (dict(features=2, kernel_size=(3,), dtype=BF16), (2, 5, 2)),
    'preferred': (dict(features=2, kernel_size=(3,), dtype=BF16,
                       param_dtype=BF16,
                       preferred_element_type=jnp.float32), (2, 5, 2)),
}


@pytest.mark.parametrize('case', sorted(CONVT_CASES))
def test_conv_transpose(case):
  kwargs, shape = CONVT_CASES[case]
  check(lambda nn: nn.ConvTranspose(**kwargs), rand(10, shape))


def test_conv_transpose_mask():
  mask = jnp.tril(jnp.ones((3, 2, 3)))
  check(lambda nn: nn.ConvTranspose(3, (3,), mask=mask), rand(11, (2, 4, 2)))


# -- Embed ---------------------------------------------------------------------

EMBED_CASES = {
    'default': (dict(num_embeddings=7, features=3), jnp.int32),
    'uint8': (dict(num_embeddings=7, features=3), jnp.uint8),
    'single_row': (dict(num_embeddings=1, features=3), jnp.int32),
    'bf16': (dict(num_embeddings=7, features=3, dtype=BF16), jnp.int32),
    'param_bf16': (dict(num_embeddings=7, features=2, param_dtype=BF16),
                   jnp.int32),
}


@pytest.mark.parametrize('case', sorted(EMBED_CASES))
def test_embed(case):
  kwargs, dtype = EMBED_CASES[case]
  idx = ints(0, (2, 3), kwargs['num_embeddings'])
  if dtype == jnp.uint8:
    idx = jnp.abs(idx).astype(dtype)
  check(lambda nn: nn.Embed(**kwargs), idx)


@pytest.mark.parametrize('dtype', [None, BF16])
def test_embed_attend(dtype):
  call = lambda layer, idx, q: layer(idx).sum() + layer.attend(q)
  check(lambda nn: nn.Embed(6, 4, dtype=dtype), ints(1, (3,), 6),
        rand(12, (2, 4)), call=call)


def test_embed_out_of_range_is_nan():
  _, out = check(lambda nn: nn.Embed(3, 2), jnp.array([0, 5]), grad=False)
  assert np.isnan(np.asarray(out[1])).all()


def test_setup_submodule_and_jit():
  """Layers assigned in setup() and used under jit; same tree and values."""

  def build(nn):

    class Net(nn.Module):

      def setup(self):
        self.embed = nn.Embed(5, 4)
        self.proj = nn.DenseGeneral((2, 2), axis=-1)
        self.conv = nn.Conv(4, (3,))

      def __call__(self, idx):
        h = self.conv(self.embed(idx))
        return self.proj(h), self.embed.attend(h)

    return Net()

  idx = ints(2, (2, 5), 5)
  vars_l = fast_jit(build(LIFT).init)(jax.random.key(3), idx)
  vars_f = fast_jit(build(FLAX).init)(jax.random.key(3), idx)
  assert_identical(vars_l, vars_f)
  out_l = fast_jit(build(LIFT).apply)(vars_f, idx)
  out_f = fast_jit(build(FLAX).apply)(vars_f, idx)
  assert_identical(out_l, out_f)


@pytest.mark.parametrize('layer', ['Einsum', 'Conv', 'DenseGeneral'])
def test_capture_all_methods(layer):
  """Capturing every method call sees the same (wrapped) methods; run
  eagerly, unlike check()."""
  make = {
      'Einsum': lambda nn: nn.Einsum((4, 3), '...b,bc->...c'),
      'Conv': lambda nn: nn.ConvLocal(2, (3,)),
      'DenseGeneral': lambda nn: nn.DenseGeneral((2, 3), batch_dims=(0,)),
  }[layer]
  x = rand(14, (2, 3, 4))
  captured = []
  for nn in (LIFT, FLAX):
    model = make_model(nn, make)
    variables = model.init(jax.random.key(0), x)
    _, state = model.apply(variables, x, mutable=['intermediates'],
                           capture_intermediates=lambda m, name: True)
    captured.append((variables, state))  # eager init: also bit-identical
  assert_identical(*captured)


# -- signatures and helpers ----------------------------------------------------


def _same_default(ours, theirs, name):
  if ours is inspect.Parameter.empty or theirs is inspect.Parameter.empty:
    return ours is theirs
  if name == 'promote_dtype':
    return callable(ours) and ours.__name__ == theirs.__name__
  if name.endswith('_init'):
    key = jax.random.key(0)
    return np.array_equal(ours(key, (4, 3), jnp.float32),
                          theirs(key, (4, 3), jnp.float32))
  return ours is theirs or ours == theirs


@pytest.mark.parametrize('name', LAYERS)
def test_signatures_match(name):
  ours, theirs = getattr(linear, name), getattr(fnn, name)
  for attr in ('__init__', '__call__', 'attend'):
    if not hasattr(theirs, attr):
      assert not hasattr(ours, attr) or attr == '__init__'
      continue
    ps = list(inspect.signature(getattr(ours, attr)).parameters.values())
    ts = inspect.signature(getattr(theirs, attr)).parameters.values()
    if attr != '__init__':
      # liftmods' one addition: a keyword-only out_sharding (None), the
      # override of the layer's output sharding on Explicit mesh axes.
      extra = ps.pop()
      assert (extra.name, extra.kind, extra.default) == (
          'out_sharding', inspect.Parameter.KEYWORD_ONLY, None), attr
    assert [p.name for p in ps] == [t.name for t in ts], attr
    for p, t in zip(ps, ts):
      # Linen's parent/name are positional-or-keyword with Linen's own
      # sentinel; liftmods (module.py) makes them keyword-only.
      if p.name in ('parent', 'name'):
        continue
      assert p.kind == t.kind, (attr, p.name)
      assert _same_default(p.default, t.default, p.name), (attr, p.name)
  assert ([f.name for f in dataclasses.fields(ours)] ==
          [f.name for f in dataclasses.fields(theirs)])


@pytest.mark.parametrize('padding', [
    'SAME', 3, [1, 2], [(1, 2), 0], [(0, 1), (2, 3)], ((1, 1), 4),
    [1], [[1, 2], 3], [(1, 2, 3), 1], 2.5])
def test_canonicalize_padding(padding):
  try:
    expected = fnn.linear.canonicalize_padding(padding, 2)
  except ValueError:
    with pytest.raises(ValueError, match='padding'):
      linear.canonicalize_padding(padding, 2)
  else:
    assert linear.canonicalize_padding(padding, 2) == expected


def test_module_defaults_are_linen_defaults():
  key = jax.random.key(4)
  for name in ('default_kernel_init', 'default_embed_init'):
    ours, theirs = getattr(linear, name), getattr(fnn.linear, name)
    assert_identical(ours(key, (5, 3)), theirs(key, (5, 3)))


# -- errors --------------------------------------------------------------------

# (make_layer, inputs, exception liftmods raises, exception flax raises,
#  text expected in liftmods's message)
ERROR_CASES = {
    'dg_axis_out_of_range': (lambda nn: nn.DenseGeneral(2, axis=3),
                             (2, 3, 4), IndexError, IndexError, 'axis'),
    'dg_batch_not_leading': (lambda nn: nn.DenseGeneral(2, batch_dims=(1,)),
                             (2, 3, 4), ValueError, ValueError, 'batch_dims'),
    'dg_repeated_axis': (lambda nn: nn.DenseGeneral(2, axis=(1, -2)),
                         (2, 3, 4), ValueError, Exception, 'distinct'),
    'conv_kernel_size_float': (lambda nn: nn.Conv(2, 3.0), (1, 5, 2),
                               TypeError, TypeError, 'kernel_size'),
    'conv_bad_padding': (lambda nn: nn.Conv(2, (3,), padding=[(1, 2, 3)]),
                         (1, 5, 2), ValueError, ValueError, 'padding'),
    'conv_causal_2d': (lambda nn: nn.Conv(2, (3, 3), padding='CAUSAL'),
                       (1, 5, 5, 2), ValueError, ValueError, 'Causal padding'),
    'conv_mask_shape': (lambda nn: nn.Conv(2, (3,), mask=jnp.ones((3, 3))),
                        (1, 5, 2), ValueError, ValueError, 'Mask'),
    'conv_groups': (lambda nn: nn.Conv(2, (3,), feature_group_count=2),
                    (1, 5, 3), ValueError, AssertionError,
                    'feature_group_count'),
    'conv_rank_too_small': (lambda nn: nn.Conv(2, (3, 3)), (5, 2),
                            ValueError, Exception, 'spatial'),
    'conv_strides_length': (lambda nn: nn.Conv(2, (3,), strides=(1, 1)),
                            (1, 5, 2), ValueError, Exception, 'strides'),
    'local_groups': (lambda nn: nn.ConvLocal(2, (3,), feature_group_count=2),
                     (1, 5, 2), NotImplementedError, NotImplementedError,
                     'feature_group_count'),
    'convt_mask_shape': (lambda nn: nn.ConvTranspose(
        2, (3,), mask=jnp.ones((3, 2, 3))), (1, 5, 2), ValueError,
                         ValueError, 'Mask'),
    'convt_bad_padding': (lambda nn: nn.ConvTranspose(2, (3,), padding=[]),
                          (1, 5, 2), ValueError, ValueError, 'padding'),
    'einsum_implicit': (lambda nn: nn.Einsum((3, 2), 'ab,bc'), (2, 3),
                        ValueError, ValueError, '->'),
    'einsum_three_operands': (lambda nn: nn.Einsum((3, 2), 'ab,bc,cd->ad'),
                              (2, 3), ValueError, ValueError, 'two'),
    'einsum_kernel_rank': (lambda nn: nn.Einsum((3, 2), 'ab,bcd->acd'),
                           (2, 3), ValueError, AssertionError, 'kernel'),
    'einsum_no_equation': (lambda nn: nn.Einsum((3, 2)), (2, 3), ValueError,
                           ValueError, 'einsum_str'),
    'embed_float_input': (lambda nn: nn.Embed(4, 2), (2, 3), ValueError,
                          ValueError, 'integer'),
}


@pytest.mark.parametrize('case', sorted(ERROR_CASES))
def test_errors(case):
  make, shape, ours_exc, flax_exc, text = ERROR_CASES[case]
  x = rand(13, shape)
  with pytest.raises(flax_exc):
    make_model(FLAX, make).init(jax.random.key(0), x)
  with pytest.raises(ours_exc) as info:
    make_model(LIFT, make).init(jax.random.key(0), x)
  message = str(info.value)
  assert text in message, message
  if 'einsum_no_equation' not in case:
    layer = make(LIFT).__class__.__name__
    assert f'{layer} at /{layer}_0' in message, message


def test_einsum_str_given_twice():
  for nn in (FLAX, LIFT):
    model = make_model(nn, lambda nn: nn.Einsum((3, 2), 'ab,bc->ac'),
                       call=lambda layer, x: layer(x, 'ab,bc->ac'))
    with pytest.raises(ValueError, match='einsum_str'):
      model.init(jax.random.key(0), rand(0, (2, 3)))
