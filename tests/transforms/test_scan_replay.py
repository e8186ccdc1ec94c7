"""Scan traces its body once on repeated traces (rng-counter replay) while
keeping Linen's keys: every init/apply here must match flax.linen bit for bit,
including when the body's rng use changes between traces of one site."""
import functools

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
import treecheck
from liftmods.core.rng_counters import RngReplay


def build(nn):

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x, train):
      h = nn.Dense(4)(x)
      if train:
        h = nn.Dropout(0.5, deterministic=False)(h)
        h = h + jax.random.normal(self.make_rng('noise'), h.shape)
      return x + h, None

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x, train=False):
      stack = nn.scan(Block, variable_axes={'params': 0},
                      split_rngs={'params': True, 'dropout': True},
                      in_axes=(nn.broadcast,), length=3)
      return stack(name='stack')(x, train)[0]

  return Net


RNGS = {'params': jax.random.key(0), 'dropout': jax.random.key(1),
        'noise': jax.random.key(2)}
X = jnp.ones((2, 4))


# Container types must match too.
assert_identical = functools.partial(treecheck.assert_identical,
                                     same_containers=True)


def run(nn, train_flags):
  net = build(nn)()
  return [net.init_with_output(RNGS, X, train) for train in train_flags]


@pytest.mark.parametrize('flags', [(True, True, True), (False, True, False),
                                   (True, False, True)])
def test_repeated_inits_match_flax(flags):
  RngReplay.cache.clear()
  for ours, theirs in zip(run(lnn, flags), run(fnn, flags)):
    assert_identical(ours, theirs)


def test_replay_is_used_and_verified(monkeypatch):
  RngReplay.cache.clear()
  traces = []
  real = RngReplay.verify

  def counting_verify(self):
    traces.append(self.key)
    return real(self)

  monkeypatch.setattr(RngReplay, 'verify', counting_verify)
  run(lnn, (True,))
  assert not traces  # first trace of the site: two traces, no replay
  run(lnn, (True,))
  assert len(traces) == 1  # replayed: one verified trace


def test_mismatch_falls_back_to_two_traces(monkeypatch):
  RngReplay.cache.clear()
  net = build(lnn)()
  net.init(RNGS, X, True)
  key = next(iter(RngReplay.cache))
  first, final = RngReplay.cache[key]
  RngReplay.cache[key] = (first, ())  # a recorded effect that lies
  ours = net.init_with_output(RNGS, X, True)
  assert_identical(ours, build(fnn)().init_with_output(RNGS, X, True))
  assert RngReplay.cache[key][1] == final  # re-recorded truthfully
