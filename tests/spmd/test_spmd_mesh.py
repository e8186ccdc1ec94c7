"""Runs the 8-device cases (tests/spmd/spmd_mesh_cases.py) in a fresh process
with 8 simulated CPU devices (see tests/multidevice.py), with the
integration tests (the process costs about 45 CPU-seconds, too much for
make test's budget); the second test holds the two longest cases."""
import pathlib

import pytest
from multidevice import assert_cases_pass

CASES = pathlib.Path(__file__).with_name('spmd_mesh_cases.py')


@pytest.mark.integration
def test_spmd_cases_pass_on_eight_devices():
  assert_cases_pass(CASES, marks='not integration')


@pytest.mark.integration
def test_spmd_integration_cases_pass_on_eight_devices():
  assert_cases_pass(CASES, marks='integration')
