"""Runs the pipeline cases (pipeline_cases.py) in a fresh process with 8
simulated CPU devices (see tests/multidevice.py), with the integration
tests (each process costs about 45 CPU-seconds, too much for make test's
budget): the core cases in one process, the rest of the matrix and the LM
step in another, so that the two xdist workers run them side by side."""
import pathlib

import pytest
from multidevice import assert_cases_pass

CASES = pathlib.Path(__file__).with_name('pipeline_cases.py')


@pytest.mark.integration
def test_pipeline_cases_pass_on_eight_devices():
  assert_cases_pass(CASES, marks='not integration')


@pytest.mark.integration
def test_pipeline_integration_cases_pass_on_eight_devices():
  assert_cases_pass(CASES, marks='integration')
