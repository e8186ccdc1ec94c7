"""The LM demo (examples/lm) on 8 simulated devices trains alike on the mesh
``jax.make_mesh`` makes by default (Explicit axes) and on an Auto mesh, and
a run on the Explicit mesh stopped at a checkpoint and resumed ends where
the uninterrupted run does."""
import numpy as np
import pytest

from tests.multihost.test_multiprocess_lm import assert_same_run, lm, outcome

STEPS = ['--steps=30', '--eval_every=10', '--checkpoint_every=10']


@pytest.fixture(scope='module')
def explicit_run(tmp_path_factory):
  """30 steps on the Explicit mesh: ``(workdir, process 0's stdout)``."""
  workdir = tmp_path_factory.mktemp('explicit')
  out = lm(workdir, 1, *STEPS, '--mesh_axes=explicit')
  return workdir, out[0].stdout


@pytest.mark.integration
def test_explicit_and_auto_meshes_train_alike(explicit_run, tmp_path):
  workdir, stdout = explicit_run
  assert "mesh: {'data': 4, 'model': 2} over 8 cpu devices" in stdout
  lm(tmp_path, 1, *STEPS, '--mesh_axes=auto')
  (history, params), (want_history, want_params) = (outcome(workdir),
                                                    outcome(tmp_path))
  for kind in ('train', 'eval'):
    steps, losses = zip(*history[kind])
    want_steps, want = zip(*want_history[kind])
    assert steps == want_steps, kind
    # The two meshes compile to different programs (the Explicit one has
    # the layers' chosen output shardings), so sums may round in another
    # order: the final parameters differed by 2.5e-7 at most (a few float32
    # ulps of values near 1) in a measured run, and the 30 steps' losses
    # agreed exactly. 1e-5 relative leaves room for that rounding to grow
    # over the steps, far below a real difference (the loss falls by ~1e-1
    # per logged step here).
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=0, err_msg=kind)
  assert sorted(params) == sorted(want_params)
  for k, v in params.items():
    np.testing.assert_allclose(v, want_params[k], rtol=0, atol=1e-6,
                               err_msg=k)


@pytest.mark.integration
def test_explicit_mesh_resumes_from_a_checkpoint(explicit_run, tmp_path):
  workdir, _ = explicit_run
  lm(tmp_path, 1, *STEPS, '--stop_at=20')
  assert (tmp_path / 'checkpoints' / '20').exists()
  assert not (tmp_path / 'checkpoints' / '30').exists()
  out = lm(tmp_path, 1, *STEPS, '--resume')
  assert 'resumed from step 20' in out[0].stdout
  assert_same_run(outcome(tmp_path), outcome(workdir))
