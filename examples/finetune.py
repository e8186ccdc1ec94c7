"""Fine-tuning with liftmods.state: load, insert a layer, freeze, train.

1. Pretrain a small MLP regressor (``Dense_0 -> Dense_1 -> Dense_2``).
2. Build a new model for a 3-class task: the same trunk with a residual
   adapter layer *inserted* after the first layer (so the old ``Dense_1`` is
   now ``Dense_2``) and a new ``head``.
3. Initialize the new model and ``state.load`` the pretrained variables into
   it, moving ``Dense_1`` to ``Dense_2``; the report says what was loaded,
   what is new, and what was left over (the old regression head).
4. Freeze every loaded leaf with optax masks built from the report and train
   the adapter and the head.
5. Check that every frozen leaf is bit-identical to the pretrained value.

  python -m examples.finetune --pretrain_steps=200 --finetune_steps=200
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import liftmods as nn
from liftmods import state

HIDDEN = 32


class Pretrained(nn.Module):
  """The pretrained regressor."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(HIDDEN)(x))
    x = nn.relu(nn.Dense(HIDDEN)(x))
    return nn.Dense(1)(x)[..., 0]


class Finetuned(nn.Module):
  """The trunk with an adapter inserted after its first layer, and a new
  classification head."""
  n_classes: int = 3

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(HIDDEN)(x))
    x = x + nn.Dense(HIDDEN, kernel_init=nn.initializers.zeros)(x)  # new
    x = nn.relu(nn.Dense(HIDDEN)(x))
    return nn.Dense(self.n_classes, name='head')(x)


def make_data(key, n: int):
  """Inputs, a regression target and a 3-class label from the same signal."""
  x = jax.random.normal(key, (n, 4))
  signal = jnp.sin(x[:, 0] * 2) + x[:, 1] * x[:, 2]
  label = jnp.digitize(signal, jnp.array([-0.5, 0.5]))
  return x, signal, label


def train(loss_fn, params, tx, steps: int, batches):
  """``steps`` steps of ``tx`` on ``loss_fn(params, *batch)``; returns the
  final params and the first and last losses."""
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, *batches(i))
    losses.append(float(loss))
  return params, losses[0], losses[-1]


def same_bits(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--pretrain_steps', type=int, default=200)
  parser.add_argument('--finetune_steps', type=int, default=200)
  parser.add_argument('--batch', type=int, default=128)
  args = parser.parse_args(argv)

  data_key, k_pre, k_new = jax.random.split(jax.random.key(0), 3)
  x, target, label = make_data(data_key, 2048)

  def batches(i):
    idx = jax.random.randint(jax.random.fold_in(data_key, i), (args.batch,),
                             0, x.shape[0])
    return x[idx], target[idx], label[idx]

  # 1. Pretrain.
  old_model = Pretrained()
  old_vars = old_model.init(k_pre, x[:1])

  def mse(params, xb, yb, _):
    return jnp.mean((old_model.apply({'params': params}, xb) - yb) ** 2)

  old_params, first, last = train(mse, old_vars['params'], optax.adam(1e-2),
                                  args.pretrain_steps, batches)
  old_vars = {'params': old_params}
  print(f'pretrain: mse {first:.4f} -> {last:.4f}')

  # 2-3. New model: init it, then load the pretrained trunk into it.
  model = Finetuned()
  fresh = model.init(k_new, x[:1])
  variables, report = state.load(fresh, old_vars,
                                 {'params/Dense_1': 'params/Dense_2'})
  print(report)

  # 4. Freeze what was loaded, train the rest.
  frozen = state.Any(*report.loaded)
  params = variables['params']
  frozen_mask = state.mask(variables, frozen)['params']
  train_mask = state.mask(variables, state.Not(frozen))['params']
  tx = optax.chain(optax.masked(optax.adam(1e-2), train_mask),
                   optax.masked(optax.set_to_zero(), frozen_mask))

  def xent(params, xb, _, yb):
    logits = model.apply({'params': params}, xb)
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  new_params, first, last = train(xent, params, tx, args.finetune_steps,
                                  batches)
  print(f'finetune: cross-entropy {first:.4f} -> {last:.4f}')

  # 5. Frozen leaves did not move by a single bit; the trained ones moved.
  before = state.flatten({'params': params})
  after = state.flatten({'params': new_params})
  frozen_paths = [p for p, leaf in before.items() if frozen(p, leaf)]
  moved = [p for p in before if not same_bits(before[p], after[p])]
  assert frozen_paths and all(same_bits(before[p], after[p])
                              for p in frozen_paths)
  if args.finetune_steps:
    assert set(moved) == set(before) - set(frozen_paths), moved
  print(f'{len(frozen_paths)} frozen leaves bit-identical, '
        f'{len(moved)} trained leaves updated')
  return {'report': report, 'frozen': frozen_paths, 'moved': moved,
          'finetune_loss': (first, last)}


if __name__ == '__main__':
  main()
