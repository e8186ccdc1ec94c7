"""One side of the sbx differential test, run in its own process.

``python -m tests.compat.sbx_side {flax,liftmods} OUT.npz [CASE ...]``
builds sbx (Stable Baselines Jax) agents and saves every array it compares.
With ``liftmods`` the switch is installed before sbx is imported; sbx's
BatchRenorm (CrossQ's critic) imports ``_canonicalize_axes``,
``_compute_stats`` and ``_normalize`` from ``flax.linen.normalization`` when
``sbx`` is imported.

Each case (``ppo``, ``dqn``, ``sac``, ``tqc``, ``crossq``) creates the
algorithm with ``seed=0`` on a gymnasium environment and saves the parts in
``PARTS``: the initial train states of the policy and the algorithm (every
parameter, target parameter, batch statistic and optimizer state) and its
key, the deterministic ``predict`` on fixed observations, then after
``learn(64)`` the train states, the key and ``predict`` again.
"""
import sys
import warnings

import numpy as np

from tests.compat.differential import flat, run_side

STEPS = 64


def _states(algo):
  """``{name: train state}`` of the policy and the algorithm (entropy
  coefficient), and the algorithm's key."""
  found = {'key': algo.key}
  for owner, prefix in ((algo.policy, 'policy.'), (algo, '')):
    for name, value in vars(owner).items():
      if type(value).__name__.endswith('TrainState'):
        found[prefix + name] = value
  return found


def _observations(algo):
  space = algo.observation_space
  space.seed(5)
  return np.stack([space.sample() for _ in range(8)])


def _case(name, cls, env, **kwargs):

  def run(out):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      algo = cls('MlpPolicy', env, seed=0, verbose=0, **kwargs)
    obs = _observations(algo)
    flat(f'{name}/init', _states(algo), out)
    flat(f'{name}/predict', algo.predict(obs, deterministic=True)[0], out)
    algo.learn(STEPS)
    flat(f'{name}/learn', _states(algo), out)
    flat(f'{name}/predict_after_learn',
         algo.predict(obs, deterministic=True)[0], out)

  return run


def _cases():
  import sbx  # pylint: disable=import-outside-toplevel
  off_policy = {'learning_starts': 16, 'batch_size': 16}
  return {
      'ppo': _case('ppo', sbx.PPO, 'CartPole-v1', n_steps=32, batch_size=32),
      'dqn': _case('dqn', sbx.DQN, 'CartPole-v1', **off_policy),
      'sac': _case('sac', sbx.SAC, 'Pendulum-v1', **off_policy),
      'tqc': _case('tqc', sbx.TQC, 'Pendulum-v1', **off_policy),
      'crossq': _case('crossq', sbx.CrossQ, 'Pendulum-v1', **off_policy),
  }


PARTS = {name: ['init', 'predict', 'learn', 'predict_after_learn']
         for name in ('ppo', 'dqn', 'sac', 'tqc', 'crossq')}


class _Cases(dict):
  """The cases, built once sbx may be imported (after the switch)."""

  def __missing__(self, name):
    self.update(_cases())
    return self[name]

  def __iter__(self):
    return iter(PARTS)


if __name__ == '__main__':
  run_side(sys.argv[1:], _Cases())
