"""One side of the brax differential test, run in its own process.

``python -m tests.compat.brax_side {flax,liftmods} OUT.npz [CASE ...]``
builds brax's training networks and saves every array it compares. With
``liftmods`` the switch :mod:`liftmods.compat` is installed before brax is
imported, so brax's unmodified ``from flax import linen`` gets liftmods;
``brax.training.networks`` builds a table at import time from
``nn.activation.*``, ``nn.activation.compact`` included.

Cases (the parts each saves are listed in ``PARTS``):

- ``ppo``: ``make_ppo_networks`` (tanh-normal policy, MLP value network)
  over observations normalized by brax's running statistics: init, the
  policy and value outputs, actions sampled by ``make_inference_fn`` with a
  fixed key (and their log-probabilities), and the gradient of a PPO-style
  loss;
- ``ppo_std``: the same with a normal policy whose standard deviation is a
  learned log-scale parameter (``PolicyModuleWithStd``, ``LogParam``) and a
  distributional critic;
- ``sac``: ``make_sac_networks``: init, policy and twin-Q outputs, and the
  gradient of a Q loss;
- ``vision``: ``make_policy_network_vision`` (CNN + MLP over two pixel
  observations and a normalized state vector, spatial-softmax pooling),
  the normal-policy variant with per-channel LayerNorm
  (``VisionPolicyWithStd``) and ``make_value_network_vision``: init,
  outputs and gradients;
- ``spectral_norm``: the spectral-norm MLP (``make_model(spectral_norm=True)``,
  brax's ``SNDense``), initialized with a ``params`` and a ``sing_vec`` key,
  applied three times with a ``sing_vec`` rng and the ``sing_vec``
  collection mutable (the power iteration's vector carried from one call to
  the next), and the gradient through it.
"""
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from tests.compat.differential import flat, run_side

OBS, ACT = 8, 3
STATE = np.random.RandomState(0).randn(4, OBS).astype(np.float32)
PIXELS = np.random.RandomState(1).rand(2, 16, 16, 3).astype(np.float32)


def _normalizer(batch):
  from brax.training.acme import running_statistics  # pylint: disable=import-outside-toplevel
  from brax.training.acme import specs  # pylint: disable=import-outside-toplevel
  shapes = jax.tree_util.tree_map(
      lambda x: specs.Array(x.shape[1:], jnp.float32), batch)
  state = running_statistics.init_state(shapes)
  return running_statistics.update(state, batch)


def _ppo(name, out, **kwargs):
  from brax.training.acme import running_statistics  # pylint: disable=import-outside-toplevel
  from brax.training.agents.ppo import networks as ppo_networks  # pylint: disable=import-outside-toplevel
  nets = ppo_networks.make_ppo_networks(
      OBS, ACT, preprocess_observations_fn=running_statistics.normalize,
      policy_hidden_layer_sizes=(16, 16), value_hidden_layer_sizes=(16, 16),
      **kwargs)
  distributional = kwargs.get('use_distributional_critic', False)
  normalizer = _normalizer(STATE)
  key_policy, key_value, key_act = jax.random.split(jax.random.key(0), 3)
  params = (nets.policy_network.init(key_policy),
            nets.value_network.init(key_value))
  flat(f'{name}/init', params, out)
  flat(f'{name}/forward', (
      nets.policy_network.apply(normalizer, params[0], STATE),
      nets.value_network.apply(normalizer, params[1], STATE)), out)
  policy = ppo_networks.make_inference_fn(
      nets, compute_value=True, use_distributional_critic=distributional)(
          (normalizer, *params))
  actions, extras = jax.jit(policy)(STATE, key_act)
  flat(f'{name}/act', (actions, extras), out)
  dist = nets.parametric_action_distribution

  def loss(params):
    logits = nets.policy_network.apply(normalizer, params[0], STATE)
    log_prob = dist.log_prob(logits, extras['raw_action'])
    value = nets.value_network.apply(normalizer, params[1], STATE)
    if distributional:
      value = value[0]
    return -jnp.mean(log_prob * jax.lax.stop_gradient(value)) + jnp.mean(
        jnp.square(value - 1.0))

  flat(f'{name}/grads', jax.jit(jax.grad(loss))(params), out)


def sac(out):
  from brax.training.agents.sac import networks as sac_networks  # pylint: disable=import-outside-toplevel
  nets = sac_networks.make_sac_networks(OBS, ACT, hidden_layer_sizes=(16, 16),
                                        q_network_layer_norm=True)
  key_policy, key_q = jax.random.split(jax.random.key(1))
  params = (nets.policy_network.init(key_policy), nets.q_network.init(key_q))
  flat('sac/init', params, out)
  actions = jnp.tanh(STATE[:, :ACT])
  flat('sac/forward', (nets.policy_network.apply(None, params[0], STATE),
                       nets.q_network.apply(None, params[1], STATE, actions)),
       out)

  def q_loss(q_params):
    q = nets.q_network.apply(None, q_params, STATE, actions)
    return jnp.mean(jnp.square(q - 0.5))

  flat('sac/grads', jax.jit(jax.grad(q_loss))(params[1]), out)


def vision(out):
  from brax.training import networks  # pylint: disable=import-outside-toplevel
  from brax.training.acme import running_statistics  # pylint: disable=import-outside-toplevel
  obs = {'pixels/view_0': PIXELS, 'pixels/view_1': PIXELS[:, ::-1],
         'state': STATE[:2, :5]}
  sizes = {k: v.shape[1:] for k, v in obs.items()}
  normalizer = _normalizer({'state': obs['state']})
  cnn = dict(cnn_output_channels=(4, 8), cnn_kernel_size=(3, 3),
             cnn_stride=(2, 1))
  built = {
      'policy': networks.make_policy_network_vision(
          sizes, 2 * ACT,
          preprocess_observations_fn=running_statistics.normalize,
          hidden_layer_sizes=[16], state_obs_key='state',
          cnn_global_pool='spatial_softmax', **cnn),
      'policy_std': networks.make_policy_network_vision(
          sizes, ACT, preprocess_observations_fn=running_statistics.normalize,
          hidden_layer_sizes=[16], state_obs_key='state',
          normalise_channels=True, distribution_type='normal',
          noise_std_type='log', **cnn),
      'value': networks.make_value_network_vision(
          sizes, preprocess_observations_fn=running_statistics.normalize,
          hidden_layer_sizes=[16], state_obs_key='state', **cnn),
  }
  keys = jax.random.split(jax.random.key(2), len(built))
  params = {n: net.init(k) for (n, net), k in zip(built.items(), keys)}
  flat('vision/init', params, out)

  def outputs(params):
    return {n: net.apply(normalizer, params[n], obs)
            for n, net in built.items()}

  flat('vision/forward', jax.jit(outputs)(params), out)

  def loss(params):
    return sum(jnp.sum(jnp.square(leaf))
               for leaf in jax.tree_util.tree_leaves(outputs(params)))

  flat('vision/grads', jax.jit(jax.grad(loss))(params), out)


def spectral_norm(out):
  from brax.training import networks  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # make_model is deprecated in brax
    model = networks.make_model([16, 16, ACT], OBS, spectral_norm=True)
  key_params, key_vec, key_apply = jax.random.split(jax.random.key(3), 3)
  variables = model.init(key_params, key_vec)
  flat('spectral_norm/init', variables, out)

  @jax.jit
  def step(variables, key):
    y, state = model.apply(variables, STATE, rngs={'sing_vec': key},
                           mutable=['sing_vec'])
    return y, {**variables, **state}

  steps = []
  for key in jax.random.split(key_apply, 3):
    y, variables = step(variables, key)
    steps.append((y, variables['sing_vec']))
  flat('spectral_norm/steps', steps, out)

  def loss(params):
    y, _ = model.apply({**variables, 'params': params}, STATE,
                       rngs={'sing_vec': key_apply}, mutable=['sing_vec'])
    return jnp.mean(jnp.square(y))

  flat('spectral_norm/grads', jax.jit(jax.grad(loss))(variables['params']),
       out)


CASES = {
    'ppo': lambda out: _ppo('ppo', out),
    'ppo_std': lambda out: _ppo('ppo_std', out, distribution_type='normal',
                                noise_std_type='log', init_noise_std=0.5,
                                use_distributional_critic=True,
                                num_quantiles=8),
    'sac': sac,
    'vision': vision,
    'spectral_norm': spectral_norm,
}
PARTS = {
    'ppo': ('init', 'forward', 'act', 'grads'),
    'ppo_std': ('init', 'forward', 'act', 'grads'),
    'sac': ('init', 'forward', 'grads'),
    'vision': ('init', 'forward', 'grads'),
    'spectral_norm': ('init', 'steps', 'grads'),
}

if __name__ == '__main__':
  run_side(sys.argv[1:], CASES)
