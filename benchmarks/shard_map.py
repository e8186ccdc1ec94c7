r"""``nn.shard_map`` against ``jax.shard_map`` written by hand, in one process.

The layer: a tensor-parallel MLP block (``--depth`` of them, each a
column-sharded up projection, tanh, a row-sharded down projection and a
``psum`` over the ``model`` axis, on a batch sharded over ``data``), on a
(data, model) mesh of simulated CPU devices. Three implementations of the
same program with the same parameters:

- ``liftmods``: the blocks are a module under one ``nn.shard_map``, their
  parameters annotated with logical names mapped by the rules;
- ``linen+jax.shard_map``: flax.linen has no lifted shard_map, so the
  Linen user's way: the block's ``apply`` inside ``jax.shard_map`` with the
  parameter specs written out by hand;
- ``jax``: the same arithmetic as plain functions under ``jax.shard_map``.

Figures: trace time of the forward and of the gradient (``jax.make_jaxpr``
of a fresh wrapper, median and best over ``--repeats``), the compiled step
time of the gradient, and the largest difference of outputs and gradients
against the hand-written version.

  python -m benchmarks.shard_map --mesh=data:4,model:2 --depth=4
"""
import os
import sys

if __name__ == '__main__':
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8')

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools

from absl import app, flags
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import liftmods as lnn
from benchmarks.common import print_table, ratio, time_calls

flags.DEFINE_string('mesh', 'data:4,model:2', 'the (data, model) mesh')
flags.DEFINE_integer('depth', 4, 'blocks')
flags.DEFINE_integer('hidden', 64, 'width of the carry')
flags.DEFINE_integer('mlp', 256, 'width of the up projection (all shards)')
flags.DEFINE_integer('batch', 64, 'rows')
flags.DEFINE_integer('repeats', 9, 'timing rounds')
F = flags.FLAGS
RULES = (('batch', 'data'), ('embed', None), ('mlp', 'model'))


def _block(lib, mlp_local, logical):
  """One tensor-parallel block of library ``lib``, written for one shard."""
  def part(*names):
    init = lib.initializers.lecun_normal()
    return lnn.with_logical_partitioning(init, names) if logical else init

  class Block(lib.Module):
    @lib.compact
    def __call__(self, x):
      h = jnp.tanh(lib.Dense(mlp_local, use_bias=False,
                             kernel_init=part('embed', 'mlp'))(x))
      y = lib.Dense(x.shape[-1], use_bias=False,
                    kernel_init=part('mlp', 'embed'))(h)
      return x + jax.lax.psum(y, 'model')

  return Block


def liftmods_model(mlp_local):
  """The blocks as one module under one ``nn.shard_map``, as the
  hand-written versions put them under one ``jax.shard_map``."""
  block = _block(lnn, mlp_local, True)

  class Blocks(lnn.Module):
    @lnn.compact
    def __call__(self, x):
      for i in range(F.depth):
        x = block(name=f'block_{i}')(x)
      return x

  return lnn.shard_map(Blocks, in_specs=P('data'), out_specs=P('data'),
                       split_rngs={'params': 'model'})()


def _param_specs():
  return {f'block_{i}': {'Dense_0': {'kernel': P(None, 'model')},
                         'Dense_1': {'kernel': P('model', None)}}
          for i in range(F.depth)}


def linen_apply(mlp_local, mesh):
  block = _block(fnn, mlp_local, False)()

  def local(params, x):
    for i in range(F.depth):
      x = block.apply({'params': params[f'block_{i}']}, x)
    return x

  return jax.shard_map(local, mesh=mesh, in_specs=(_param_specs(), P('data')),
                       out_specs=P('data'))


def jax_apply(mesh):
  def local(params, x):
    for i in range(F.depth):
      p = params[f'block_{i}']
      h = jnp.tanh(x @ p['Dense_0']['kernel'])
      x = x + jax.lax.psum(h @ p['Dense_1']['kernel'], 'model')
    return x

  return jax.shard_map(local, mesh=mesh, in_specs=(_param_specs(), P('data')),
                       out_specs=P('data'))


def _trace_time(make, args):
  """Median/best seconds of ``jax.make_jaxpr`` of a fresh function."""
  return time_calls(lambda: jax.make_jaxpr(make())(*args), F.repeats)


def main(argv):
  del argv
  names, sizes = zip(*(a.split(':') for a in F.mesh.split(',')))
  mesh = jax.make_mesh(tuple(map(int, sizes)), names,
                       axis_types=(AxisType.Auto,) * len(names))
  mlp_local = F.mlp // mesh.shape['model']
  x = jax.random.normal(jax.random.key(1), (F.batch, F.hidden))
  model = liftmods_model(mlp_local)
  with jax.set_mesh(mesh), lnn.logical_axis_rules(RULES):
    variables = jax.jit(model.init)(jax.random.key(0), x)
    params = lnn.unbox(variables)['params']
    fns = {
        'liftmods': lambda: model.apply,
        'linen+jax.shard_map': lambda: (
            lambda v, x: linen_apply(mlp_local, mesh)(v['params'], x)),
        'jax': lambda: lambda v, x: jax_apply(mesh)(v['params'], x),
    }
    plain = {'params': params}
    args = {'liftmods': (variables, x)}
    loss = lambda f: (lambda v, x: (f()(v, x) ** 2).mean())
    forward, backward, steps, diffs = [], [], [], {}
    reference = jax.jit(fns['jax']())(plain, x)
    ref_grad = jax.jit(jax.grad(loss(fns['jax'])))(plain, x)['params']
    for label, make in fns.items():
      a = args.get(label, (plain, x))
      forward.append((label, _trace_time(lambda m=make: (lambda v, x: m()(
          v, x)), a)))
      backward.append((label, _trace_time(
          lambda m=make: jax.grad(loss(m)), a)))
      grad = jax.jit(jax.grad(loss(make)))
      steps.append((label, time_calls(lambda g=grad, a=a: g(*a), F.repeats)))
      out = jax.jit(make())(*a)
      g = lnn.unbox(grad(*a))['params']
      diffs[label] = (float(jnp.max(jnp.abs(out - reference))),
                      max(float(jnp.max(jnp.abs(u - w))) for u, w in zip(
                          jax.tree_util.tree_leaves(g),
                          jax.tree_util.tree_leaves(ref_grad))))
  print(f'mesh {dict(mesh.shape)}, depth {F.depth}, hidden {F.hidden}, '
        f'mlp {F.mlp}, batch {F.batch}; jax {jax.__version__}')
  print_table('trace, forward (make_jaxpr of a fresh function)', forward,
              'jax')
  print_table('trace, gradient', backward, 'jax')
  print_table('compiled gradient step', steps, 'jax')
  print('\nlargest difference from the hand-written jax version '
        '(output, gradient):')
  for label, (d_out, d_grad) in diffs.items():
    print(f'  {label:<22}{d_out:>12.3g}{d_grad:>12.3g}')
  for table, name in ((forward, 'forward trace'), (backward, 'gradient trace'),
                      (steps, 'step')):
    print(f'{name}: liftmods / jax.shard_map by hand '
          f'{ratio(table, "liftmods", "jax"):.2f}x, liftmods / linen+'
          f'jax.shard_map {ratio(table, "liftmods", "linen+jax.shard_map"):.2f}x')


if __name__ == '__main__':
  app.run(main)
