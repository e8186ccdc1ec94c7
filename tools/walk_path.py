"""Walks a model's init and grad through liftmods and reports the call path.

At the first ``Scope.param`` call of a trace, the Python stack is read and
its liftmods frames kept (JAX's own frames in between are skipped). The
report gives, for ``init`` and for ``jax.grad`` of ``apply``, the files
crossed (distinct liftmods files on the stack), the file switches (adjacent
liftmods frames in different files) and the path itself, file by file:

  .venv/bin/python tools/walk_path.py --model=nested_stack

The models: ``nested_stack`` (``nn.Stack(Block, policy='nested')``),
``scan`` (``nn.scan`` over the same block) and ``pipelined_stack`` (a
one-stage ``nn.Pipeline`` on a one-device mesh: its ``init`` runs the plain
loop, its ``grad`` the pipeline's).
"""
import argparse
import pathlib
import traceback

import jax
import jax.numpy as jnp

import liftmods as nn
from liftmods.core import scope as scope_module

PACKAGE = pathlib.Path(nn.__file__).resolve().parent


class Block(nn.Module):
  """A residual dense layer with dropout."""

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(x.shape[-1])(x)
    return x + nn.Dropout(0.1, deterministic=False)(y)


def build(model: str) -> nn.Module:
  if model == 'nested_stack':
    return nn.Stack(Block, length=9, policy='nested')(name='blocks')
  if model == 'pipelined_stack':
    pipeline = nn.Pipeline(stages=1, microbatches=2)
    return nn.Stack(Block, length=9, pipeline=pipeline)(name='blocks')

  class Scanned(nn.Module):

    @nn.compact
    def __call__(self, x):
      layers = nn.scan(lambda mdl, c, _: (mdl(c), None),
                       variable_axes={'params': 0},
                       split_rngs={'params': True, 'dropout': True},
                       length=9)
      return layers(Block(name='blocks'), x, None)[0]

  return Scanned()


def liftmods_frames():
  """(file relative to the package, function) of each liftmods frame,
  outermost first."""
  out = []
  for frame in traceback.extract_stack()[:-2]:
    path = pathlib.Path(frame.filename).resolve()
    if PACKAGE in path.parents:
      out.append((str(path.relative_to(PACKAGE)), frame.name))
  return out


def walk(fn, at: str = 'first') -> list:
  """The liftmods frames at the first (or ``at='last'``) Scope.param call
  under ``fn()``."""
  seen = []
  original = scope_module.Scope.param

  def param(self, *args, **kwargs):
    if not seen or at == 'last':
      seen[:] = [liftmods_frames()]
    return original(self, *args, **kwargs)

  scope_module.Scope.param = param
  try:
    fn()
  finally:
    scope_module.Scope.param = original
  return seen[0]


def summarize(frames) -> dict:
  files = [f for f, _ in frames]
  runs = [files[0]] + [b for a, b in zip(files, files[1:]) if a != b]
  return {'files': len(set(files)), 'switches': len(runs) - 1,
          'frames': len(frames), 'path': runs}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='nested_stack',
                      choices=('nested_stack', 'scan', 'pipelined_stack'))
  parser.add_argument('--at', default='first', choices=('first', 'last'),
                      help="which Scope.param call to walk ('last': the "
                      "pipeline's loop, after the rng-replay trace)")
  parser.add_argument('--verbose', action='store_true')
  flags = parser.parse_args()
  jax.set_mesh(jax.make_mesh((1,), ('stage',),
                             axis_types=(jax.sharding.AxisType.Auto,)))
  model = build(flags.model)
  x = jnp.ones((2, 8))
  rngs = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}
  variables = model.init(rngs, x)

  def loss(params):
    y = model.apply({'params': params}, x,
                    rngs={'dropout': jax.random.key(2)})
    return jnp.sum(y)

  for name, fn in (('init', lambda: model.init(rngs, x)),
                   ('grad', lambda: jax.grad(loss)(variables['params']))):
    report = summarize(walk(fn, flags.at))
    print(f"{name}: {report['files']} files, {report['switches']} switches, "
          f"{report['frames']} frames")
    print('  ' + ' -> '.join(report['path']))
    if flags.verbose:
      for f, fn_name in walk(fn, flags.at):
        print(f'    {f}:{fn_name}')


if __name__ == '__main__':
  main()
