"""Runs the 8-device cases (tests/spmd/spmd_mesh_cases.py) in a fresh process
with 8 simulated CPU devices (see tests/multidevice.py), with the integration
tests: the process costs about 50 CPU-seconds, too much for make test's
budget."""
import pathlib

import pytest
from multidevice import assert_cases_pass


@pytest.mark.integration
def test_spmd_cases_pass_on_eight_devices():
  assert_cases_pass(pathlib.Path(__file__).with_name('spmd_mesh_cases.py'))
