"""liftmods demo: classify two interleaved spirals with a small residual MLP.

The model is ordinary Linen code written against ``import liftmods as nn``:
a stack of residual blocks run with ``nn.scan`` (one parameter layout for the
whole stack, traced once) and rematerialized with ``nn.remat``, dropout and
layer norm inside. It trains with optax for a few hundred steps on data it
generates, printing loss and accuracy as it goes.

  make demo        # or: python -m examples.demo --steps=300
"""
import argparse
import time

import jax
import jax.numpy as jnp
import optax

import liftmods as nn


def spirals(key, n: int):
  """Two interleaved spirals in 2-D with labels 0/1."""
  k1, k2 = jax.random.split(key)
  t = jnp.sqrt(jax.random.uniform(k1, (n,))) * 3 * jnp.pi
  label = jax.random.bernoulli(k2, 0.5, (n,)).astype(jnp.int32)
  sign = 2 * label - 1
  x = jnp.stack([sign * t * jnp.cos(t), sign * t * jnp.sin(t)], -1) / 10
  return x, label


class Block(nn.Module):
  """Pre-norm residual MLP block; a scan body: ``carry -> (carry, None)``."""
  hidden: int
  dropout: float = 0.1

  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.LayerNorm()(x)
    h = nn.gelu(nn.Dense(4 * self.hidden)(h))
    h = nn.Dropout(self.dropout, deterministic=not train)(h)
    return x + nn.Dense(self.hidden)(h), None


class Classifier(nn.Module):
  depth: int = 6
  hidden: int = 64

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Dense(self.hidden, name='embed')(x)
    Stack = nn.scan(nn.remat(Block, static_argnums=(2,)),
                    variable_axes={'params': 0},
                    split_rngs={'params': True, 'dropout': True},
                    in_axes=(nn.broadcast,), length=self.depth)
    x, _ = Stack(self.hidden, name='blocks')(x, train)
    return nn.Dense(2, name='head')(nn.LayerNorm()(x))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=300)
  parser.add_argument('--batch', type=int, default=256)
  args = parser.parse_args()

  data_key, init_key, drop_key = jax.random.split(jax.random.key(0), 3)
  x_train, y_train = spirals(data_key, 4096)
  x_test, y_test = spirals(jax.random.fold_in(data_key, 1), 1024)
  model = Classifier()
  params = model.init(init_key, x_train[:1])['params']
  n_params = sum(p.size for p in jax.tree_util.tree_leaves(params))
  print(f'Classifier: {n_params} parameters, layout of the scanned stack:')
  for name, leaf in jax.tree_util.tree_flatten_with_path(
      params['blocks'])[0]:
    print(f'  blocks{jax.tree_util.keystr(name)}: {leaf.shape}')

  opt = optax.adam(3e-3)
  opt_state = opt.init(params)

  def loss_fn(params, x, y, key):
    logits = model.apply({'params': params}, x, train=True,
                         rngs={'dropout': key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(params, opt_state, x, y, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key)
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def accuracy(params, x, y):
    logits = model.apply({'params': params}, x)
    return (logits.argmax(-1) == y).mean()

  start = time.perf_counter()
  for i in range(1, args.steps + 1):
    key = jax.random.fold_in(drop_key, i)
    idx = jax.random.randint(key, (args.batch,), 0, x_train.shape[0])
    params, opt_state, loss = step(params, opt_state, x_train[idx],
                                   y_train[idx], key)
    if i % 50 == 0 or i == 1:
      acc = accuracy(params, x_test, y_test)
      print(f'step {i:4d}  loss {float(loss):.4f}  test accuracy '
            f'{float(acc):.3f}')
  acc = float(accuracy(params, x_test, y_test))
  print(f'done in {time.perf_counter() - start:.1f}s: test accuracy {acc:.3f}')


if __name__ == '__main__':
  main()
