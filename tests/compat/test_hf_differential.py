"""Hugging Face transformers' Flax models, unmodified, on liftmods.

Each library side runs in its own process (``tests/compat/hf_side.py``): one
with the real ``flax.linen``, one with :mod:`liftmods.compat` installed before
transformers is imported. Both build BERT (with
``enable_gradient_checkpointing()``, which goes through
``nn_partitioning.remat``), GPT-2, BART and ViT from tiny configs with the
same seed, and save initial parameters, eval and train outputs (dropout key
fixed), gradients and greedy generations with the cache. Every array must be
equal bit for bit.

The flax side runs first and the liftmods side after it, sharing one
persistent XLA compilation cache: where the two libraries lower to the same
program (the cache key leaves out source locations) the liftmods side loads
the executable the flax side compiled, which is the executable it would have
built itself. That cuts the liftmods side's CPU time by about three quarters
without changing what is compared; ``LIFTMODS_TEST_XLA_CACHE=0`` turns it off.

Both sides apply the same ``jnp.clip`` shim (``hf_side.shim_jnp_clip``):
transformers 4.46 passes ``a_min=`` / ``a_max=``, which current JAX rejects.
"""
import numpy as np
import pytest

from tests.compat import differential

pytest.importorskip('transformers')
pytestmark = pytest.mark.integration

# BERT runs once, with gradient checkpointing on, which exercises both the
# model and nn_partitioning.remat (a plain BERT run added ~20% to the time).
MODELS = ('bert_remat', 'gpt2', 'bart', 'vit')
PARTS = {'bert_remat': ('params', 'eval', 'train', 'grads'),
         'gpt2': ('params', 'eval', 'train', 'grads', 'generate'),
         'bart': ('params', 'eval', 'train', 'grads', 'generate'),
         'vit': ('params', 'eval', 'train', 'grads')}


@pytest.fixture(scope='module')
def sides(tmp_path_factory):
  return differential.run_sides(tmp_path_factory.mktemp('hf'),
                                'tests.compat.hf_side', MODELS)


def test_each_side_used_its_library(sides):
  assert str(sides['flax']['meta/linen']) == 'flax.linen.linear'
  assert str(sides['liftmods']['meta/linen']) == 'liftmods.layers.linear'


@pytest.mark.parametrize('model', MODELS)
def test_bit_identical(sides, model):
  assert differential.parts_of(sides, model) == set(PARTS[model])
  differential.assert_identical(sides, model)


def test_generation_is_not_trivial(sides):
  """The compared generations produce new tokens (not only padding)."""
  for model in ('gpt2', 'bart'):
    seq = sides['flax'][f'{model}/generate']
    assert len(np.unique(seq[:, -4:])) > 1, (model, seq)
