"""One side of the NNX bridge differential test, run in its own process.

``python -m tests.compat.nnx_bridge_side {flax,liftmods} OUT.npz [CASE ...]``
runs ``flax.nnx.bridge`` both ways and saves every array it compares. With
``liftmods`` the switch :mod:`liftmods.compat` is installed before
``flax.nnx`` is imported, so the bridge's own ``from flax import linen``
gets liftmods: ``ToLinen`` is then a liftmods Module, and ``ToNNX`` wraps
liftmods models.

Cases (the parts each saves are listed in ``PARTS``):

- ``to_linen``: an NNX layer with a parameter and a ``BatchStat`` counter,
  reached through ``ToLinen``, ``to_linen`` and a ``to_linen_class`` class,
  next to a Linen ``Dense``: init, apply with ``batch_stats`` mutable, and
  the gradient of a loss;
- ``rngs``: an NNX layer that draws from its ``dropout`` stream at call
  time, inside a Linen model applied with a ``dropout`` key;
- ``scan``: the NNX layer inside ``nn.scan`` (parameters stacked, one key
  per layer) and inside ``nn.remat``: init, outputs and gradients;
- ``stack``: the NNX layer as the block of ``nn.Stack(..., policy='full')``
  on liftmods, and of the same stack written out for Linen
  (``nn.scan(nn.remat(...))``, the layout ``nn.Stack`` keeps): init,
  outputs, gradients;
- ``partitioning``: NNX parameters made with ``nnx.with_partitioning``
  reach Linen as boxes whose partition spec is kept; the specs are saved as
  strings. Those made with ``bridge.with_partitioning`` become Linen
  ``Partitioned`` boxes, and under ``nn.scan`` with ``metadata_params`` the
  layer axis joins their spec;
- ``to_nnx``: a Linen model inside an NNX module through ``ToNNX`` and
  ``lazy_init``; ``nnx.split`` of the result, its output, and ``nnx.grad``
  of a loss.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tests.compat.differential import flat, run_side

X = np.random.RandomState(0).randn(2, 3).astype(np.float32)
PARTS = {
    'to_linen': ['init', 'y', 'state', 'grads', 'fn_init', 'class_init'],
    'rngs': ['init', 'y'],
    'scan': ['init', 'y', 'grads', 'remat_init', 'remat_y'],
    'stack': ['init', 'y', 'grads'],
    'partitioning': ['specs', 'init', 'scan_specs', 'scan_init'],
    'to_nnx': ['split', 'y', 'state', 'grads', 'linen_init'],
}


def _layers():
  """The NNX layers the cases wrap (built after the switch is in place)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class Counted(nnx.Module):
    """A linear map that counts its calls in a BatchStat."""

    def __init__(self, din, dout, *, rngs):
      init = nnx.initializers.lecun_normal()
      self.w = nnx.Param(init(rngs.params(), (din, dout)))
      self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
      self.calls[...] = self.calls[...] + 1
      return jnp.tanh(x @ self.w[...])

  class Noisy(nnx.Module):
    """Adds noise from the ``dropout`` stream at call time."""

    def __init__(self, din, *, rngs):
      self.linear = nnx.Linear(din, din, rngs=rngs)
      self.rngs = rngs

    def __call__(self, x):
      noise = jax.random.normal(self.rngs.dropout(), x.shape)
      return self.linear(x) + noise

  class Sharded(nnx.Module):
    """Parameters with logical partitioning metadata."""

    def __init__(self, din, dout, *, rngs):
      kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                     ('embed', 'mlp'))
      self.linear = nnx.Linear(din, dout, kernel_init=kernel, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  return nnx, Counted, Noisy, Sharded


def _loss_grads(model, variables, *args, **kwargs):
  def loss(params):
    y = model.apply({**variables, 'params': params}, *args, **kwargs)
    y = y[0] if isinstance(y, tuple) else y
    return jnp.sum(y ** 2)
  return jax.grad(loss)(variables['params'])


def to_linen(out):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel
  from flax.nnx.bridge import wrappers  # pylint: disable=import-outside-toplevel
  _, counted, _, _ = _layers()

  # to_linen_class is not re-exported by flax.nnx.bridge, and its class is
  # used through a subclass (its own __init__ is only given to subclasses).
  class CountedLinen(wrappers.to_linen_class(counted)):
    pass

  class Model(nn.Module):
    how: str = 'class'

    @nn.compact
    def __call__(self, x):
      if self.how == 'ToLinen':
        layer = bridge.ToLinen(counted, args=(3, 4), name='nnx')
      elif self.how == 'to_linen':
        return nn.Dense(2)(bridge.to_linen(counted, 3, 4, name='nnx')(x))
      else:
        layer = CountedLinen(args=(3, 4), name='nnx')
      return nn.Dense(2)(layer(x))

  model = Model(how='ToLinen')
  variables = model.init(jax.random.key(0), X)
  y, state = model.apply(variables, X, mutable=['batch_stats'])
  flat('to_linen/init', variables, out)
  flat('to_linen/y', y, out)
  flat('to_linen/state', state, out)
  flat('to_linen/grads',
       _loss_grads(model, variables, X, mutable=['batch_stats']), out)
  flat('to_linen/fn_init', Model(how='to_linen').init(jax.random.key(0), X),
       out)
  flat('to_linen/class_init', Model().init(jax.random.key(0), X), out)


def rngs(out):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel
  _, _, noisy, _ = _layers()

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return bridge.ToLinen(noisy, args=(3,), name='noisy')(x)

  keys = {'params': jax.random.key(1), 'dropout': jax.random.key(2)}
  variables = Model().init(keys, X)
  flat('rngs/init', variables, out)
  flat('rngs/y', Model().apply(variables, X,
                               rngs={'dropout': jax.random.key(3)}), out)


def scan(out):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel
  _, counted, _, _ = _layers()

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return bridge.ToLinen(counted, args=(3, 3), name='nnx')(x), None

  class Stacked(nn.Module):
    @nn.compact
    def __call__(self, x):
      layers = nn.scan(Block, variable_axes={'params': 0, 'batch_stats': 0},
                       split_rngs={'params': True}, length=3)
      return layers(name='layers')(x, None)[0]

  class Rematted(nn.Module):
    @nn.compact
    def __call__(self, x):
      block = nn.remat(Block)(name='block')
      return block(block(x, None)[0], None)[0]

  variables = Stacked().init(jax.random.key(0), X)
  flat('scan/init', variables, out)
  flat('scan/y', Stacked().apply(variables, X, mutable=['batch_stats']), out)
  flat('scan/grads',
       _loss_grads(Stacked(), variables, X, mutable=['batch_stats']), out)
  variables = Rematted().init(jax.random.key(0), X)
  flat('scan/remat_init', variables, out)
  flat('scan/remat_y',
       Rematted().apply(variables, X, mutable=['batch_stats']), out)


def stack(out):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel
  _, counted, _, _ = _layers()

  class Block(nn.Module):
    pair: bool = False  # what nn.scan's body returns

    @nn.compact
    def __call__(self, x):
      y = bridge.ToLinen(counted, args=(3, 3), name='nnx')(x)
      return (y, None) if self.pair else y

  class Stacked(nn.Module):
    @nn.compact
    def __call__(self, x):
      if hasattr(nn, 'Stack'):  # liftmods
        return nn.Stack(Block, 3, policy='full')(name='layers')(x)
      layers = nn.scan(nn.remat(Block),
                       variable_axes={'params': 0, 'batch_stats': 0},
                       split_rngs={'params': True}, length=3,
                       metadata_params={nn.PARTITION_NAME: 'layers'})
      return layers(pair=True, name='layers')(x)[0]

  variables = Stacked().init(jax.random.key(0), X)
  flat('stack/init', variables, out)
  flat('stack/y', Stacked().apply(variables, X, mutable=['batch_stats']), out)
  flat('stack/grads',
       _loss_grads(Stacked(), variables, X, mutable=['batch_stats']), out)


def _save_specs(prefix, variables, out):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  specs = nn.get_partition_spec(variables)
  for path, spec in jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))[0]:
    out[prefix + jax.tree_util.keystr(path)] = np.asarray(str(spec))


def partitioning(out):
  # NNX would place annotated variables on a mesh when it creates them (and
  # flax 0.12.12 recreates them to read an NNXMeta box's spec); there is no
  # mesh here, so the annotations stay metadata only.
  import flax  # pylint: disable=import-outside-toplevel
  shard_eagerly = flax.config.flax_always_shard_variable
  flax.config.update('flax_always_shard_variable', False)
  try:
    _partitioned_specs(out)
  finally:
    flax.config.update('flax_always_shard_variable', shard_eagerly)


def _partitioned_specs(out):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel
  nnx, _, _, sharded = _layers()

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return bridge.ToLinen(sharded, args=(3, 4), name='nnx')(x)

  variables = Model().init(jax.random.key(0), X)
  _save_specs('partitioning/specs', variables, out)
  flat('partitioning/init', nn.meta.unbox(variables), out)

  class LinenBoxed(nnx.Module):
    def __init__(self, din, dout, *, rngs):
      kernel = bridge.with_partitioning(nnx.initializers.lecun_normal(),
                                        ('embed', 'mlp'))
      self.linear = nnx.Linear(din, dout, kernel_init=kernel, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return bridge.ToLinen(LinenBoxed, args=(3, 3), name='nnx')(x), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      layers = nn.scan(Block, variable_axes={'params': 0},
                       split_rngs={'params': True}, length=2,
                       metadata_params={nn.PARTITION_NAME: 'layers'})
      return layers(name='layers')(x)[0]

  variables = Scanned().init(jax.random.key(0), X)
  _save_specs('partitioning/scan_specs', variables, out)
  flat('partitioning/scan_init', nn.meta.unbox(variables), out)


def to_nnx_model(nn):
  """``(NNX module holding a Linen MLP through bridge.ToNNX, lazily
  initialized on X; the MLP class)``, the MLP written with ``nn``."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel

  class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False, name='bn')(x)
      return nn.Dense(2, name='out')(jnp.tanh(nn.Dense(4, name='hid')(x)))

  class Outer(nnx.Module):
    def __init__(self, *, rngs):
      self.mlp = bridge.ToNNX(LinenMLP(), rngs=rngs)
      self.head = nnx.Linear(2, 1, rngs=rngs)

    def __call__(self, x):
      return self.head(self.mlp(x, mutable=['batch_stats']))

  return bridge.lazy_init(Outer(rngs=nnx.Rngs(0)), X), LinenMLP


def to_nnx(out):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  model, LinenMLP = to_nnx_model(nn)  # pylint: disable=invalid-name
  _, state = nnx.split(model)
  flat('to_nnx/split', nnx.to_pure_dict(state), out)
  flat('to_nnx/y', model(X), out)
  flat('to_nnx/state', nnx.to_pure_dict(nnx.state(model)), out)
  grads = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(model)
  flat('to_nnx/grads', nnx.to_pure_dict(grads), out)
  flat('to_nnx/linen_init', LinenMLP().init(jax.random.key(0), X), out)


CASES = {'to_linen': to_linen, 'rngs': rngs, 'scan': scan, 'stack': stack,
         'partitioning': partitioning, 'to_nnx': to_nnx}


if __name__ == '__main__':
  run_side(sys.argv[1:], CASES)
