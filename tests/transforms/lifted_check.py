"""What the differential tests of the lifted transforms share.

``check(build, ...)`` runs a model written once as ``build(nn)`` under
``flax.linen`` (the oracle) and ``liftmods`` and asserts

* identical variable trees (tree structure, shapes, dtypes),
* BIT-IDENTICAL init values for at least two seeds,
* equal outputs (``rtol=1e-5, atol=1e-6``), at init and perturbed params,
* equal gradients of a scalar loss w.r.t. ``params``.

Init runs eagerly (as user code does); the apply/gradient comparisons run
under ``jax.jit`` (compiled once per library and input case); a few tests
also compare eager applies and jitted inits. The ``fast_compiles`` fixture
(``tests/conftest.py``) turns off most XLA optimizations for speed (same
settings for both libraries; nothing compared depends on them).

The test files next to this one hold one transform family each.
"""
import functools

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np

import liftmods as lnn
from treecheck import assert_close, assert_identical, normal

SEEDS = (0, 1)
BACKENDS = (fnn, lnn)


RTOL, ATOL = 1e-5, 1e-6


def scalar_loss(tree):
  """A scalar depending on every floating leaf with distinct weights."""
  total = jnp.zeros((), jnp.float32)
  for leaf in jax.tree_util.tree_leaves(tree):
    leaf = jnp.asarray(leaf)
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      continue
    w = 1.0 + 0.1 * jnp.arange(leaf.size, dtype=jnp.float32).reshape(
        leaf.shape)
    total = total + jnp.sum(jnp.tanh(leaf) * w)
  return total


def unbox(tree):
  is_box = lambda x: isinstance(x, (fnn.Partitioned, lnn.Partitioned))
  return jax.tree_util.tree_map(lambda x: x.value if is_box(x) else x, tree,
                                is_leaf=is_box)


def perturb(variables, amount=0.2):
  """Moves every float param away from its init value deterministically."""
  def f(path, x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return x
    h = (sum(len(str(p)) for p in path) % 5) + 1
    return x + amount * h * jnp.cos(
        jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape)
  out = dict(variables)
  out['params'] = jax.tree_util.tree_map_with_path(f, variables['params'])
  return out


def rng_dict(seed, names):
  key = jax.random.key(seed)
  if not names:
    return key
  keys = jax.random.split(key, len(names) + 1)
  out = {'params': keys[0]}
  out.update({n: k for n, k in zip(names, keys[1:])})
  return out


def check(build, init_args, apply_cases=None, *, mutable=False,
          rng_names=(), seeds=SEEDS, method=None, grads=True,
          perturbed=True, init_kwargs=None, apply_kwargs=None,
          eager_apply=False, jit_later_seeds=False):
  """Runs ``build(nn)`` with both backends and compares init, apply, grads.

  Init runs eagerly (with ``jit_later_seeds``, seeds after the first run
  under ``jax.jit``); apply outputs and gradients are computed under ``jax.jit`` (plus one eager
  apply with ``eager_apply=True``). Returns ``{'vars': {nn: variables},
  'out': {nn: apply output of the first case}, 'init_out': {nn: init
  output}}`` (first seed) for extra checks.
  """
  if apply_cases is None:
    apply_cases = [init_args]
  init_kwargs = dict(init_kwargs or {})
  apply_kwargs = dict(apply_kwargs or {})
  if method is not None:
    init_kwargs.setdefault('method', method)
    apply_kwargs.setdefault('method', method)
  mods = {nn: build(nn) for nn in BACKENDS}
  result = {}
  jit_inits = {nn: jax.jit(functools.partial(
      lambda rngs, nn: mods[nn].init_with_output(rngs, *init_args,
                                                 **init_kwargs), nn=nn))
               for nn in BACKENDS}
  for i, seed in enumerate(seeds):
    # eagerly, as user code would (jit_later_seeds: seeds after the first
    # under jax.jit)
    if i == 0 or not jit_later_seeds:
      res = {nn: mods[nn].init_with_output(rng_dict(seed, rng_names), *init_args,
                                           **init_kwargs)
             for nn in BACKENDS}
    else:
      res = {nn: jit_inits[nn](rng_dict(seed, rng_names)) for nn in BACKENDS}
    (fo, fv), (lo, lv) = res[fnn], res[lnn]
    assert_identical(lv, fv, f'init variables (seed {seed})')
    assert_close(lo, fo, rtol=RTOL, atol=ATOL,
                 what=f'init output (seed {seed})')
    if not result:
      result = {'vars': {fnn: fv, lnn: lv}, 'init_out': {fnn: fo, lnn: lo}}
  variables = result['vars']
  apply_rngs = ({n: jax.random.key(100 + i) for i, n in enumerate(rng_names)}
                if rng_names else None)

  tags = [('init', variables)]
  if perturbed and 'params' in variables[fnn]:
    tags.append(('perturbed', {nn: perturb(v) for nn, v in variables.items()}))
  for ci, case in enumerate(apply_cases):

    def run(vs, nn, case=case):
      """Output and param gradients; jitted once per backend and case (the
      case is closed over so that Python scalars in it stay concrete)."""
      def apply(params):
        v = dict(vs)
        if params is not None:
          v['params'] = params
        return mods[nn].apply(v, *case, mutable=mutable, rngs=apply_rngs,
                              **apply_kwargs)
      out = apply(None)
      if not grads or 'params' not in vs:
        return out, None

      def loss(params):
        y = apply(params)
        return scalar_loss(y[0] if mutable else y)
      return out, jax.grad(loss)(vs['params'])

    runs = {nn: jax.jit(functools.partial(run, nn=nn)) for nn in BACKENDS}
    if ci == 0 and eager_apply:
      outs = {nn: mods[nn].apply(variables[nn], *case, mutable=mutable,
                                 rngs=apply_rngs, **apply_kwargs)
              for nn in BACKENDS}
      assert_close(outs[lnn], outs[fnn], rtol=RTOL, atol=ATOL,
                   what='eager apply output (init)')
    for tag, vs in tags:
      res = {nn: runs[nn](vs[nn]) for nn in BACKENDS}
      assert_close(res[lnn][0], res[fnn][0], rtol=RTOL, atol=ATOL,
                   what=f'apply output ({tag}, case {ci})')
      assert_close(res[lnn][1], res[fnn][1], rtol=RTOL, atol=ATOL,
                   what=f'param grads ({tag}, case {ci})')
      if ci == 0 and tag == 'init':
        result['out'] = {nn: r[0] for nn, r in res.items()}
  return result


def shapes(tree):
  return jax.tree_util.tree_map(lambda x: tuple(np.shape(x)), unbox(tree))


X4 = normal(7, (4, 3))


def mlp(nn):
  class MLP(nn.Module):
    features: int = 3

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(4)(x)
      x = nn.tanh(x)
      return nn.Dense(self.features, name='out')(x)
  return MLP


def autoencoder(nn):
  class AE(nn.Module):
    def setup(self):
      self.enc = nn.Dense(2)
      self.dec = nn.Dense(3)

    def encode(self, x):
      return self.enc(x)

    def decode(self, z):
      return self.dec(z)

    def __call__(self, x):
      return self.decode(self.encode(x))
  return AE


def block(nn, features=3):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      h = nn.Dense(features)(jnp.concatenate([c, x], -1))
      c = nn.tanh(h) + c
      return c, h * 2
  return Block
C0 = normal(21, (2, 3))
XS = normal(22, (4, 2, 2))


def dropout_block(nn):
  class DBlock(nn.Module):
    @nn.compact
    def __call__(self, c, x):
      h = nn.Dense(3)(x) + c
      h = nn.Dropout(0.5, deterministic=False)(h)
      return nn.tanh(h), h
  return DBlock
