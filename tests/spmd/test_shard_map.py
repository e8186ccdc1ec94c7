"""Runs the ``nn.shard_map`` cases (tests/spmd/shard_map_cases.py) in a fresh
process with 8 simulated CPU devices (see tests/multidevice.py); about 25
CPU-seconds, so it stays in make test."""
import pathlib

from multidevice import assert_cases_pass


def test_shard_map_cases_pass_on_eight_devices():
  assert_cases_pass(pathlib.Path(__file__).with_name('shard_map_cases.py'))
