"""Open flax issues outside the lifted transforms: Module dataclasses,
partitioning boxes, ``tabulate``, the layers, rngs and serialization.

Each test states the flax issue and either shows what flax.linen does with
the program (raises, or computes the wrong thing) and checks liftmods'
result against a reference Linen does compute, or -- where Linen now runs
the program -- checks that liftmods gives Linen's result. The rows are in
docs/coming-from-linen.md ("Linen issues that work in liftmods").
"""
import dataclasses
import re

import flax.errors
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization as fser

import liftmods as lnn
from liftmods import errors
from liftmods import serialization as lser
from liftmods import summary as lsummary
from flax.linen import summary as fsummary
from treecheck import assert_identical, normal

pytestmark = pytest.mark.usefixtures('fast_compiles')

KEY = jax.random.key(0)
X3 = normal(3, (2, 3))


def _text(table: str) -> str:
  return re.sub(r'\x1b\[[0-9;]*m', '', table)


# -- flax 4130: typed PRNG keys through msgpack ---------------------------------


def _state_with_keys():
  return {'step': np.int32(3), 'rng': jax.random.key(7),
          'per_device': jax.random.split(jax.random.key(1), 4),
          'rbg': jax.random.key(2, impl='rbg')}


def test_4130_linen_cannot_serialize_typed_keys():
  with pytest.raises(TypeError, match='PRNGKey dtype'):
    fser.to_bytes(_state_with_keys())
  with pytest.raises(TypeError, match='PRNGKey dtype'):
    fser.msgpack_serialize({'rng': jax.random.key(0)})


def test_4130_typed_keys_round_trip_with_their_impl():
  """The restored keys are typed keys of the same implementation with the
  same key data: they draw the same numbers as the originals."""
  state = _state_with_keys()
  restored = lser.from_bytes(state, lser.to_bytes(state))
  for name in ('rng', 'per_device', 'rbg'):
    ours, original = restored[name], state[name]
    assert jax.dtypes.issubdtype(ours.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(ours) == jax.random.key_impl(original)
    assert_identical(jax.random.key_data(ours), jax.random.key_data(original))
  assert_identical(jax.random.normal(restored['rng'], (3,)),
                   jax.random.normal(state['rng'], (3,)))
  assert restored['step'] == 3
  # Linen writes raw key data (jax.random.key_data) byte for byte the same.
  raw = {'rng': jax.random.key_data(state['rng'])}
  assert lser.to_bytes(raw) == fser.to_bytes(raw)


# -- flax 3779: tabulate(compute_flops=True) over WeightNorm / SpectralNorm -----


def _norm_wrapper(nn, kind):
  if kind == 'WeightNorm':
    return nn.WeightNorm(nn.Dense(3)), {}
  return nn.SpectralNorm(nn.Dense(3)), {'update_stats': False}


@pytest.mark.parametrize('kind', ['WeightNorm', 'SpectralNorm'])
def test_3779_flops_of_norm_wrappers_equal_linens(kind):
  """Linen (since 0.12) skips the wrapper's ``layer_forward`` call, a
  function run on the layer, when it counts FLOPs; liftmods does the same,
  so the rows and both FLOP columns are Linen's."""
  x = jnp.ones((1, 2))

  def rows(nn, summary):
    module, kwargs = _norm_wrapper(nn, kind)
    table = summary._get_module_table(
        module, depth=None, show_repeated=False, compute_flops=True,
        compute_vjp_flops=True)(KEY, x, **kwargs)
    return [(r.path, type(r.module_copy).__name__, r.method, r.flops,
             r.vjp_flops) for r in table]

  theirs = rows(fnn, fsummary)
  assert [r[:3] for r in theirs] == [((), kind, '__call__'),
                                     (('layer_instance',), 'Dense',
                                      '__call__')]
  assert rows(lnn, lsummary) == theirs
  module, kwargs = _norm_wrapper(lnn, kind)
  text = module.tabulate(KEY, x, compute_flops=True, compute_vjp_flops=True,
                         **kwargs)
  assert f'│ {theirs[1][3]} ' in text and f'│ {theirs[1][4]} ' in text


def test_3779_show_repeated_names_the_mapped_call_as_linen_does():
  x = jnp.ones((1, 2))

  def module_cells(nn):
    text = _text(nn.WeightNorm(nn.Dense(3)).tabulate(
        KEY, x, show_repeated=True,
        console_kwargs={'width': 200, 'force_terminal': False}))
    return [cell.strip() for line in text.splitlines()
            for cell in line.split('│')[2:3] if '(' in cell or 'Dense' in cell]

  ours = module_cells(lnn)
  assert ours.count('Dense (layer_forward)') == 2
  assert [c for c in module_cells(fnn) if c != 'Dense'] == [
      c for c in ours if c != 'Dense']


# -- flax 1317: decode=True fed a whole prompt in one call -----------------------


def _decoder(nn):
  return nn.SelfAttention(num_heads=2, qkv_features=4, decode=True)


X_SEQ = normal(5, (2, 4, 6))


def _step_by_step(variables, steps):
  """Linen's way: one position per call, the cache carried along."""
  cache, outs = variables['cache'], []
  for t in steps:
    y, state = _decoder(fnn).apply(
        {'params': variables['params'], 'cache': cache}, X_SEQ[:, t:t + 1],
        mutable=['cache'])
    cache = state['cache']
    outs.append(y)
  return jnp.concatenate(outs, axis=1), cache


def test_1317_linen_decode_rejects_a_prompt():
  variables = _decoder(fnn).init(KEY, X_SEQ)
  with pytest.raises(ValueError, match='Autoregressive cache shape error'):
    _decoder(fnn).apply(variables, X_SEQ[:, :3], mutable=['cache'])


def test_1317_prompt_in_one_call_equals_one_position_per_call():
  """A 3-position prompt written in one call gives Linen's step-by-step
  outputs and cache bit for bit, and the next step continues from it."""
  variables = _decoder(lnn).init(KEY, X_SEQ)
  assert_identical(variables, _decoder(fnn).init(KEY, X_SEQ))
  y, state = _decoder(lnn).apply(variables, X_SEQ[:, :3], mutable=['cache'])
  y_ref, cache_ref = _step_by_step(variables, range(3))
  assert_identical((y, state['cache']), (y_ref, cache_ref))
  assert int(state['cache']['cache_index']) == 3

  params = variables['params']
  y4, _ = _decoder(lnn).apply({'params': params, 'cache': state['cache']},
                              X_SEQ[:, 3:4], mutable=['cache'])
  y4_ref, _ = _decoder(fnn).apply({'params': params, 'cache': cache_ref},
                                  X_SEQ[:, 3:4], mutable=['cache'])
  assert_identical(y4, y4_ref)


def test_1317_prompt_longer_than_the_cache_is_rejected():
  variables = _decoder(lnn).init(KEY, X_SEQ[:, :2])
  with pytest.raises(ValueError, match='at most the cache length 2'):
    _decoder(lnn).apply(variables, X_SEQ[:, :3], mutable=['cache'])


# -- flax 2479: attributes derived in __post_init__ after super() ----------------


def _scaled(nn, after_super=True):
  class Scaled(nn.Module):
    features: int

    def __post_init__(self):
      if after_super:
        super().__post_init__()
      self.hidden = 2 * self.features  # derived from a field
      if not after_super:
        super().__post_init__()

    @nn.compact
    def __call__(self, x):
      return nn.Dense(self.features)(nn.Dense(self.hidden)(x))

  class Outer(nn.Module):
    def setup(self):
      self.inner = Scaled(3)

    @nn.compact
    def __call__(self, x):
      return self.inner(x) + Scaled(3, name='compact')(x)
  return Outer()


def test_2479_linen_refuses_attributes_set_after_super_post_init():
  with pytest.raises(flax.errors.SetAttributeFrozenModuleError):
    _scaled(fnn).init(KEY, X3)


def test_2479_post_init_sets_derived_attributes_after_super():
  """Set after ``super().__post_init__()``, the attribute gives Linen's
  values for the same module setting it before (Linen's only order), at top
  level, in setup and in a compact method; clones recompute it."""
  ours = _scaled(lnn)
  variables = ours.init(KEY, X3)
  theirs = _scaled(fnn, after_super=False)
  assert_identical(variables, theirs.init(KEY, X3))
  assert_identical(ours.apply(variables, X3), theirs.apply(variables, X3))
  assert ours.bind(variables).inner.hidden == 6
  assert lnn.Dense(2).clone().features == 2


def test_2479_fields_and_submodules_stay_frozen_after_super():
  class SetsField(lnn.Module):
    features: int = 2

    def __post_init__(self):
      super().__post_init__()
      self.features = 3

  class SetsSubmodule(lnn.Module):
    def __post_init__(self):
      super().__post_init__()
      self.dense = lnn.Dense(2)

  class Later(lnn.Module):
    def __post_init__(self):
      super().__post_init__()
      self.fine = 1

    def __call__(self, x):
      self.anything = 1  # outside __post_init__
      return x

  def outer(cls):
    class Outer(lnn.Module):
      @lnn.compact
      def __call__(self, x):
        cls(name='child')
        return x
    return Outer()

  for cls in (SetsField, SetsSubmodule):
    with pytest.raises(errors.SetAttributeFrozenModuleError):
      outer(cls).init(KEY, X3)
  assert outer(Later).init(KEY, X3) == {}
  with pytest.raises(errors.SetAttributeFrozenModuleError,
                     match='anything'):
    Later().init(KEY, X3)


# -- (no flax issue found) arrays in non-native byte order through msgpack -------


_FOREIGN = {'f32': (np.arange(4) / 3).astype('>f4'),
            'i16': np.arange(-2, 2, dtype='>i2'),
            'c64': np.array([1 + 2j, -3j], dtype='>c8'),
            'scalar': np.array(1.5, dtype='>f8')[()]}


def test_big_endian_arrays_come_back_wrong_from_linen():
  restored = fser.msgpack_restore(fser.msgpack_serialize(_FOREIGN))
  assert not np.array_equal(restored['f32'], _FOREIGN['f32'])
  assert not np.array_equal(restored['i16'], _FOREIGN['i16'])


def test_big_endian_arrays_round_trip_by_value():
  """The values (not the foreign bytes) are written; native arrays are
  written byte for byte as Linen writes them."""
  restored = lser.msgpack_restore(lser.msgpack_serialize(_FOREIGN))
  for name, original in _FOREIGN.items():
    assert restored[name].dtype == original.dtype.newbyteorder('=')
    np.testing.assert_array_equal(restored[name], original)
  native = {k: v.astype(v.dtype.newbyteorder('='))
            for k, v in _FOREIGN.items()}
  assert lser.msgpack_serialize(native) == fser.msgpack_serialize(native)
  assert lser.msgpack_serialize(_FOREIGN) == fser.msgpack_serialize(native)


# -- (no flax issue found) dataclasses.InitVar fields on a Module ----------------


def _widened(nn, init_var):
  if init_var:
    class Widened(nn.Module):
      width: dataclasses.InitVar[int] = 1

      def __post_init__(self, width):
        self.hidden = 2 * width
        super().__post_init__()

      @nn.compact
      def __call__(self, x):
        return nn.Dense(self.hidden)(x)
  else:
    class Widened(nn.Module):
      hidden: int = 2

      @nn.compact
      def __call__(self, x):
        return nn.Dense(self.hidden)(x)

  class Outer(nn.Module):
    def setup(self):
      self.a = Widened(3) if init_var else Widened(6)

    @nn.compact
    def __call__(self, x):
      b = Widened(2, name='b') if init_var else Widened(4, name='b')
      return self.a(x).sum() + b(x).sum()
  return Widened(5) if init_var else Widened(10), Outer()


def test_init_var_linen_cannot_construct():
  with pytest.raises(TypeError):
    _widened(fnn, init_var=True)


def test_init_var_reaches_post_init_through_clones():
  """``init``/``apply`` clone the module (and setup/compact children are
  clones too): the InitVar value passed at construction is passed again,
  so the values equal Linen's for the same module with a plain field."""
  for ours, theirs in zip(_widened(lnn, True), _widened(fnn, False)):
    variables = ours.init(KEY, X3)
    assert_identical(variables, theirs.init(KEY, X3))
    assert_identical(ours.apply(variables, X3), theirs.apply(variables, X3))
  single, _ = _widened(lnn, True)
  assert single.clone().hidden == 10
  assert single.clone(width=1).hidden == 2
