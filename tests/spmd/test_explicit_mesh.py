"""Runs the Explicit-mesh cases (tests/spmd/explicit_mesh_cases.py) in a
fresh process with 8 simulated CPU devices (see tests/multidevice.py); about
15 CPU-seconds, so it stays in make test."""
import pathlib

from multidevice import assert_cases_pass


def test_explicit_mesh_cases_pass_on_eight_devices():
  assert_cases_pass(pathlib.Path(__file__).with_name('explicit_mesh_cases.py'))
