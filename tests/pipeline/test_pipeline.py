"""Runs the pipeline cases (pipeline_cases.py) in a fresh process with 8
simulated CPU devices (see tests/multidevice.py): the core cases in
``make test``, the rest of the matrix and the LM step with the integration
tests."""
import pathlib

import pytest
from multidevice import assert_cases_pass

CASES = pathlib.Path(__file__).with_name('pipeline_cases.py')


@pytest.mark.long
def test_pipeline_cases_pass_on_eight_devices():
  assert_cases_pass(CASES, marks='not integration')


@pytest.mark.integration
def test_pipeline_integration_cases_pass_on_eight_devices():
  assert_cases_pass(CASES, marks='integration')
