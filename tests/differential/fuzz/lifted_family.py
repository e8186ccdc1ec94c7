"""Lifted ``nn.custom_vjp`` and ``nn.jit`` against ``jax.custom_vjp`` and
``jax.jit`` on the unbound block.

A program is a random pure block (``programs.Generator``: layers, params,
submodules, no transforms), a transform, and how the model calls it:

- ``custom_vjp``: ``nn.custom_vjp(f, fwd, bwd)`` with ``fwd`` from
  ``nn.vjp`` and a backward rule that scales the parameter cotangents by
  ``a`` and the input's by ``b``; the reference is ``jax.custom_vjp`` of
  ``Block().apply({'params': p}, x)`` with the same rule (``jax.vjp``).
- ``custom_vjp_nondiff``: the same with a third argument, a Python float
  ``s`` the output is scaled by, listed in ``nondiff_argnums`` (Linen counts
  the module as argument 0, so ``(2,)``); the backward rule receives it
  first. The reference is ``jax.custom_vjp(..., nondiff_argnums=(2,))``.
- ``jit``: ``nn.jit(Block)`` called once or twice in a row (the second
  call reuses the same variables); the reference is ``jax.jit`` of the
  unbound apply, applied as often.

Outputs and the gradients with respect to the block's parameters and the
input must agree (allclose), and the block's parameter tree (paths and
shapes) must be the one its own ``init`` makes.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import compare, programs

BLOCK_FEATURES = {f: False for f in programs.FEATURES}
BLOCK_FEATURES.update({f: True for f in (
    'dense', 'dense_general', 'conv', 'layer_norm', 'rms_norm', 'activation',
    'param', 'submodule', 'embed')})


@dataclasses.dataclass(frozen=True)
class Program:
  """A block's source and how it is lifted."""
  src: str
  transform: str  # 'custom_vjp' or 'jit'
  param_scale: float
  input_scale: float
  calls: int
  nondiff: float = 1.0  # custom_vjp_nondiff: the non-differentiated scale


def draw(c: programs.Chooser) -> Program:
  """A random block and transform configuration."""
  gen = programs.Generator(c, BLOCK_FEATURES, max_depth=3)
  gen.node(c.integer(1, 3), len(programs.INPUT_SHAPE), pure=True,
           name='Block')
  return Program('\n\n'.join(gen.classes) + '\n',
                 c.choice(['custom_vjp', 'jit', 'custom_vjp_nondiff']),
                 c.choice([1.0, 2.0, -0.5, 0.0]), c.choice([1.0, 3.0, 0.0]),
                 c.choice([1, 2]), c.choice([1.0, 0.5, -2.0]))


def _scaled(tree, factor):
  return jax.tree_util.tree_map(lambda t: factor * t, tree)


def _lifted_model(nn, block, prog: Program):
  """The model using the lifted transform on ``block`` (named 'block')."""
  a, b = prog.param_scale, prog.input_scale

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      if prog.transform == 'jit':
        layer = nn.jit(block)(name='block')
        for _ in range(prog.calls):
          x = layer(x)
        return x

      def f(mdl, x):
        return mdl(x)

      def fwd(mdl, x):
        return nn.vjp(f, mdl, x)

      def bwd(vjp_fn, g):
        params_t, x_t = vjp_fn(g)
        return _scaled(params_t, a), b * x_t

      if prog.transform == 'custom_vjp_nondiff':
        return nn.custom_vjp(
            lambda mdl, x, s: s * f(mdl, x),
            lambda mdl, x, s: _scaled_fwd(nn.vjp(f, mdl, x), s),
            lambda s, vjp_fn, g: bwd(vjp_fn, s * g),
            nondiff_argnums=(2,))(block(name='block'), x, prog.nondiff)
      return nn.custom_vjp(f, fwd, bwd)(block(name='block'), x)

  return Model()


def _scaled_fwd(primal_and_vjp, s):
  y, vjp_fn = primal_and_vjp
  return s * y, vjp_fn


def _reference(block, prog: Program):
  """``fn(params, x)``: the same computation with jax's transforms."""
  a, b = prog.param_scale, prog.input_scale

  def apply(p, x):
    return block().apply({'params': p}, x)

  if prog.transform == 'jit':
    jitted = jax.jit(apply)

    def fn(p, x):
      for _ in range(prog.calls):
        x = jitted(p, x)
      return x
    return fn

  def bwd(vjp_fn, g):
    params_t, x_t = vjp_fn(g)
    return _scaled(params_t, a), b * x_t

  if prog.transform == 'custom_vjp_nondiff':
    scaled = jax.custom_vjp(lambda p, x, s: s * apply(p, x),
                            nondiff_argnums=(2,))
    scaled.defvjp(lambda p, x, s: _scaled_fwd(jax.vjp(apply, p, x), s),
                  lambda s, vjp_fn, g: bwd(vjp_fn, s * g))
    return lambda p, x: scaled(p, x, prog.nondiff)

  @jax.custom_vjp
  def fn(p, x):
    return apply(p, x)

  fn.defvjp(lambda p, x: jax.vjp(apply, p, x), bwd)
  return fn


def check(prog: Program) -> tuple:
  """The lifted model against the reference (module docstring)."""
  import liftmods as nn  # pylint: disable=g-import-not-at-top
  block = programs.build(prog.src.replace('class Block', 'class Model'), nn)
  x = jax.random.normal(jax.random.key(42), programs.INPUT_SHAPE)
  model = _lifted_model(nn, block, prog)
  try:
    variables = jax.jit(model.init)(jax.random.key(0), x)
  except Exception as e:  # pylint: disable=broad-except
    return 'mismatch', f'init raised {type(e).__name__}: {e}'
  own = jax.jit(block().init)(jax.random.key(0), x)
  # The block's own init draws from the root key as 'block' would: compare
  # the trees and shapes; the values come from different paths.
  zeros = lambda t: jax.tree_util.tree_map(np.zeros_like, compare._plain(t))  # pylint: disable=protected-access
  params = variables.get('params', {}).get('block', {})
  d = compare.diff_trees(zeros(own.get('params', {})), zeros(params),
                         exact=True)
  if d:
    return 'mismatch', f'init: {d}'
  reference = _reference(block, prog)

  def ours(p, x):
    return model.apply({'params': {'block': p}}, x)

  def value_and_grads(fn):
    loss = lambda p, x: jnp.sum(fn(p, x) ** 2)
    return fn(params, x), jax.grad(loss, (0, 1))(params, x)

  try:
    got = compare._plain(jax.jit(lambda: value_and_grads(ours))())  # pylint: disable=protected-access
  except Exception as e:  # pylint: disable=broad-except
    return 'mismatch', f'apply raised {type(e).__name__}: {e}'
  want = compare._plain(jax.jit(lambda: value_and_grads(reference))())  # pylint: disable=protected-access
  d = compare.diff_trees(want, got, exact=False)
  return ('mismatch', f'apply: {d}') if d else ('ok', '')
