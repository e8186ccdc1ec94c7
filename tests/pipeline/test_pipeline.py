"""Runs the pipeline cases (pipeline_cases.py) in a fresh process with 8
simulated CPU devices (see tests/multidevice.py)."""
import pathlib

from multidevice import assert_cases_pass


def test_pipeline_cases_pass_on_eight_devices():
  assert_cases_pass(pathlib.Path(__file__).with_name('pipeline_cases.py'))
