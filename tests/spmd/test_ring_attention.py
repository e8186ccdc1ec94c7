"""Runs the ring attention cases (tests/spmd/ring_attention_cases.py: the
example's ring under ``nn.shard_map`` against full attention) in a fresh
process with 8 simulated CPU devices (see tests/multidevice.py); about 20 to 25
CPU-seconds, so it stays in make test."""
import pathlib

from multidevice import assert_cases_pass


def test_ring_attention_cases_pass_on_eight_devices():
  assert_cases_pass(pathlib.Path(__file__).with_name('ring_attention_cases.py'))
