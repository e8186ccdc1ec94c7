"""The 8-device fuzz families' CI slice, and the failures the soak found in
them that are not fixed yet (strict xfails named after what they are, with
the program the shrinker printed). Not collected by the main run:
``test_fuzz_families.py`` runs this file in a fresh process with 8
simulated devices. By hand: ``python -m pytest
tests/differential/fuzz_spmd_cases.py``.
"""
import multidevice

multidevice.simulate(8)

import jax  # pylint: disable=g-import-not-at-top
import pytest

import liftmods as nn
from fuzz import families, harness, pipeline_family, spmd_family

multidevice.require(8)

CI_SEEDS = {'sharded_init': (100, 2), 'shard_map': (101, 1),
            'pipeline': (100, 1), 'explicit': (100, 1)}


@pytest.mark.parametrize('name', sorted(CI_SEEDS))
def test_family_slice(name):
  harness.assert_seeds_pass(families.get(name), *CI_SEEDS[name])


def test_init_sharded_on_an_explicit_mesh_names_the_indivisible_variable():
  """Found by the sharded_init family (seed 14): under jax.set_mesh of an
  Explicit mesh, the constraint a box applies let JAX raise its own
  ValueError; meta.constrain now checks the division first."""
  prog = spmd_family.InitProgram(
      layers=(('dense', 4, ('embed', None)),), rules=(('embed', 'data'),),
      mesh=0, explicit=True, in_features=4)
  verdict, detail = spmd_family.check_init(prog)
  assert verdict == 'both_raise', detail
  assert detail == 'ShardingDivisibilityError', detail


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    'found by the pipeline family (seed 13, shrunk): GPipe on an Auto mesh '
    'with a batch sharded over data whose microbatches have fewer rows than '
    'data devices fails in XLA (spmd_partitioner RET_CHECK "Cross-partition '
    'allreduce must be in (partial) manual partitioning mode") instead of a '
    'PipelineError'))
def test_gpipe_uneven_microbatch_on_an_auto_mesh_is_refused_clearly():
  prog = pipeline_family.Program(
      src='class Block(nn.Module):\n  @nn.compact\n  def __call__(self, x):\n'
          '    return nn.Dense(4)(x)\n',
      stages=1, microbatches=2, repeats=1, per_chunk=1, mode='gpipe',
      remat_iterations=False, policy='None', rows=4, sharded=True)
  try:
    verdict, detail = pipeline_family.check(prog)
  except jax.errors.JaxRuntimeError as e:
    raise AssertionError(f'XLA failed instead of a PipelineError: {e}')
  assert verdict == 'both_raise' and 'PipelineError' in detail, detail
  assert nn.pipeline.PipelineError
