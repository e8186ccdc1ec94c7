"""Runs the per-layer Explicit-mesh cases (tests/spmd/explicit_layers_cases.py)
in a fresh process with 8 simulated CPU devices (see tests/multidevice.py):
eleven cases under FSDP + TP in make test, the rest in make test-integration."""
import pathlib

import pytest

from multidevice import assert_cases_pass

CASES = pathlib.Path(__file__).with_name('explicit_layers_cases.py')


def test_every_layer_on_explicit_axes_under_fsdp_and_tp():
  assert_cases_pass(CASES, marks='not integration')


@pytest.mark.integration
def test_every_layer_on_explicit_axes_under_every_pattern():
  assert_cases_pass(CASES, marks='integration')
