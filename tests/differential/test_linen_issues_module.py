"""Open flax issues outside the lifted transforms: Module dataclasses,
partitioning boxes, ``tabulate``, the layers, rngs and serialization.

Each test states the flax issue and either shows what flax.linen does with
the program (raises, or computes the wrong thing) and checks liftmods'
result against a reference Linen does compute, or -- where Linen now runs
the program -- checks that liftmods gives Linen's result. The rows are in
docs/coming-from-linen.md ("Linen issues that work in liftmods").
"""
import re

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization as fser

import liftmods as lnn
from liftmods import serialization as lser
from liftmods import summary as lsummary
from flax.linen import summary as fsummary
from treecheck import assert_identical, normal

pytestmark = pytest.mark.usefixtures('fast_compiles')

KEY = jax.random.key(0)


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
