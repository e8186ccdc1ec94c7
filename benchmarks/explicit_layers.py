r"""Every built-in layer on a mesh with Explicit axes against the same layer
on an Auto mesh, per parallelism pattern, in one process.

Each case is a layer written the Linen way: logical names on its variables
(``nn.with_logical_partitioning``) and on its input (one
``nn.with_logical_constraint``), nothing else. Each pattern is a set of
logical rules over a ``(data, model)`` mesh of 8 simulated CPU devices:

- ``dp``: data parallel (the batch over ``data``);
- ``fsdp``: the batch and the weights' ``embed`` dimension over ``data``;
- ``tp``: Megatron tensor parallel (``mlp``, ``heads``, ``vocab`` over
  ``model``; column-parallel layers have them as output features,
  row-parallel ones as contracted input features);
- ``sp``: sequence parallel (the sequence over ``model``);
- ``fsdp_tp``: ``fsdp`` and ``tp`` together.

For each (case, pattern) the binary creates the variables with
``nn.init_sharded`` and compiles one training step (the loss, its gradients
with respect to the variables and the input, and any updated collections)
on both meshes, and prints the largest difference of the outputs and
gradients, the bytes the compiled program's collectives produce per device
(the summed result sizes of its all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute ops) and its temp memory per device
(``memory_analysis``), Explicit against Auto.

  python -m benchmarks.explicit_layers --patterns=fsdp_tp,tp --cases=dense_row
"""
import os

if __name__ == '__main__':
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8')

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import liftmods as nn

NAMES = ('batch', 'length', 'embed', 'mlp', 'heads', 'kv', 'vocab', 'window',
         'hidden', 'layers')
_SET = {
    'dp': {'batch': 'data'},
    'fsdp': {'batch': 'data', 'embed': 'data'},
    'tp': {'batch': 'data', 'mlp': 'model', 'heads': 'model',
           'vocab': 'model'},
    'sp': {'batch': 'data', 'length': 'model'},
    'fsdp_tp': {'batch': 'data', 'embed': 'data', 'mlp': 'model',
                'heads': 'model', 'vocab': 'model'},
}
#: The logical rules of each pattern (every other name unsharded).
PATTERNS = {p: tuple((n, m.get(n)) for n in NAMES) for p, m in _SET.items()}
MESH_SHAPE = (2, 4)
MESH_AXES = ('data', 'model')
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
               'collective-permute')


def part(*names, init=None):
  """An initializer boxed with logical ``names``."""
  init = init or nn.initializers.lecun_normal()
  return nn.with_logical_partitioning(init, names)


def zeros(*names):
  return part(*names, init=nn.initializers.zeros_init())


def ones(*names):
  return part(*names, init=nn.initializers.ones_init())


@dataclasses.dataclass(frozen=True)
class Case:
  """A layer (``make()``) applied to one input of ``shape`` whose
  dimensions have logical ``names``; ``ints``: integer input (token ids)
  below ``ints``; ``method``: the layer's method to call."""
  make: Callable[[], nn.Module]
  shape: tuple
  names: tuple
  ints: int = 0
  method: str = '__call__'
  mutable: tuple = ()
  dropout: bool = False


class Wrapped(nn.Module):
  """``case``'s layer behind a constraint of its input to its names."""
  case: Case

  @nn.compact
  def __call__(self, x):
    x = nn.with_logical_constraint(x, self.case.names)
    layer = self.case.make()
    return getattr(layer, self.case.method)(x)


class MlpBlock(nn.Module):
  """A Megatron MLP block with a residual, the body of the stacked cases."""

  @nn.compact
  def __call__(self, x, *unused):
    h = nn.Dense(32, kernel_init=part('embed', 'mlp'),
                 bias_init=zeros('mlp'))(nn.LayerNorm(
                     scale_init=ones('embed'), bias_init=zeros('embed'))(x))
    h = nn.with_logical_constraint(nn.gelu(h), ('batch', 'length', 'mlp'))
    y = nn.Dense(16, kernel_init=part('mlp', 'embed'),
                 bias_init=zeros('embed'))(h)
    y = nn.with_logical_constraint(x + y, ('batch', 'length', 'embed'))
    return (y, None) if unused else y


def _attention(attention_fn=nn.dot_product_attention):
  return nn.MultiHeadDotProductAttention(
      num_heads=4, qkv_features=16, kernel_init=part('embed', 'heads', 'kv'),
      out_kernel_init=part('heads', 'kv', 'embed'),
      bias_init=zeros('heads', 'kv'), out_bias_init=zeros('embed'),
      attention_fn=attention_fn)


class _AttentionFn(nn.Module):
  """``nn.dot_product_attention`` on q = k = v = the input, as heads."""

  @nn.compact
  def __call__(self, x):
    q = x.reshape(x.shape[:2] + (4, 4))
    q = nn.with_logical_constraint(q, ('batch', 'length', 'heads', 'kv'))
    return nn.dot_product_attention(q, q, q)


class _Pool(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.avg_pool(x, (2,), strides=(2,))


class _Remat(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.remat(MlpBlock)()(x)


class _Scan(nn.Module):

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(MlpBlock, variable_axes={'params': 0},
                   split_rngs={'params': True}, length=3,
                   metadata_params={nn.PARTITION_NAME: 'layers'})
    return scan()(x, None)[0]


class _Vmap(nn.Module):
  """An ensemble of two MLP blocks over two copies of the input."""

  @nn.compact
  def __call__(self, x):
    vmap = nn.vmap(MlpBlock, variable_axes={'params': 0},
                   split_rngs={'params': True},
                   metadata_params={nn.PARTITION_NAME: None})
    return vmap()(jnp.stack([x, 2 * x]))


class _Rnn(nn.Module):

  @nn.compact
  def __call__(self, x):
    cell = nn.LSTMCell(16, kernel_init=part('embed', 'mlp'),
                       recurrent_kernel_init=part('hidden', 'mlp'),
                       bias_init=zeros('mlp'))
    return nn.RNN(cell)(x)


SEQ = (8, 4, 16)
SEQ_NAMES = ('batch', 'length', 'embed')
#: The layers, each with an input and its logical names.
CASES = {
    'dense_col': Case(lambda: nn.Dense(32, kernel_init=part('embed', 'mlp'),
                                       bias_init=zeros('mlp')),
                      SEQ, SEQ_NAMES),
    'dense_row': Case(lambda: nn.Dense(16, kernel_init=part('mlp', 'embed'),
                                       bias_init=zeros('embed')),
                      (8, 4, 32), ('batch', 'length', 'mlp')),
    'dense_general': Case(
        lambda: nn.DenseGeneral((4, 4), kernel_init=part('embed', 'heads',
                                                         'kv'),
                                bias_init=zeros('heads', 'kv')),
        SEQ, SEQ_NAMES),
    'dense_general_in': Case(
        lambda: nn.DenseGeneral(16, axis=(-2, -1),
                                kernel_init=part('heads', 'kv', 'embed'),
                                bias_init=zeros('embed')),
        (8, 4, 4, 4), ('batch', 'length', 'heads', 'kv')),
    'einsum': Case(lambda: nn.Einsum((16, 32), 'ble,em->blm',
                                     kernel_init=part('embed', 'mlp'),
                                     bias_init=zeros('mlp')),
                   SEQ, SEQ_NAMES),
    'conv': Case(lambda: nn.Conv(32, (3,), kernel_init=part('window', 'embed',
                                                            'mlp'),
                                 bias_init=zeros('mlp')),
                 SEQ, SEQ_NAMES),
    'conv_strided': Case(
        lambda: nn.Conv(32, (2,), strides=2,
                        kernel_init=part('window', 'embed', 'mlp'),
                        bias_init=zeros('mlp')),
        SEQ, SEQ_NAMES),
    'conv_transpose': Case(
        lambda: nn.ConvTranspose(32, (3,), kernel_init=part('window', 'embed',
                                                            'mlp'),
                                 bias_init=zeros('mlp')),
        SEQ, SEQ_NAMES),
    'conv_local': Case(
        lambda: nn.ConvLocal(32, (3,), kernel_init=part('length', 'embed',
                                                        'mlp'),
                             bias_init=zeros('length', 'mlp')),
        SEQ, SEQ_NAMES),
    'embed': Case(lambda: nn.Embed(64, 16, embedding_init=part('vocab',
                                                               'embed')),
                  (8, 4), ('batch', 'length'), ints=64),
    'embed_attend': Case(
        lambda: nn.Embed(64, 16, embedding_init=part('vocab', 'embed')),
        SEQ, SEQ_NAMES, method='attend'),
    'attention': Case(_attention, SEQ, SEQ_NAMES),
    'attention_fused': Case(
        lambda: _attention(nn.fused_dot_product_attention), SEQ, SEQ_NAMES),
    'attention_fn': Case(_AttentionFn, SEQ, SEQ_NAMES),
    'layer_norm': Case(lambda: nn.LayerNorm(scale_init=ones('embed'),
                                            bias_init=zeros('embed')),
                       SEQ, SEQ_NAMES),
    'rms_norm': Case(lambda: nn.RMSNorm(scale_init=ones('embed')),
                     SEQ, SEQ_NAMES),
    'group_norm': Case(lambda: nn.GroupNorm(4, scale_init=ones('embed'),
                                            bias_init=zeros('embed')),
                       SEQ, SEQ_NAMES),
    'batch_norm': Case(lambda: nn.BatchNorm(use_running_average=False,
                                            scale_init=ones('embed'),
                                            bias_init=zeros('embed')),
                       SEQ, SEQ_NAMES, mutable=('batch_stats',)),
    'dropout': Case(lambda: nn.Dropout(0.5, deterministic=False), SEQ,
                    SEQ_NAMES, dropout=True),
    'lstm': Case(_Rnn, SEQ, SEQ_NAMES),
    'pool': Case(_Pool, SEQ, SEQ_NAMES),
    'remat': Case(_Remat, SEQ, SEQ_NAMES),
    'scan': Case(_Scan, SEQ, SEQ_NAMES),
    'vmap': Case(_Vmap, SEQ, SEQ_NAMES),
    'stack': Case(lambda: nn.Stack(MlpBlock, length=3, policy='full')(),
                  SEQ, SEQ_NAMES),
    'stack_nested': Case(
        lambda: nn.Stack(MlpBlock, length=4, policy='nested')(),
        SEQ, SEQ_NAMES),
}


def make_mesh(kind):
  return jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(kind,) * 2)


def _input(case: Case):
  rng = np.random.RandomState(0)
  if case.ints:
    return jnp.asarray(rng.randint(0, case.ints, case.shape), jnp.int32)
  return jnp.asarray(rng.normal(size=case.shape), jnp.float32)


def _step(model, case: Case):
  """The loss, the gradients (variables, float input) and the updated
  collections, as one function of (variables, input)."""
  argnums = (0,) if case.ints else (0, 1)

  rngs = {'dropout': jax.random.key(1)} if case.dropout else None

  def loss(variables, x):
    y, updates = model.apply(variables, x, mutable=list(case.mutable),
                             rngs=rngs)
    return jnp.sum(y.astype(jnp.float32) ** 2), (y, updates)

  def step(variables, x):
    (value, (y, updates)), grads = jax.value_and_grad(
        loss, argnums=argnums, has_aux=True)(variables, x)
    return value, y, updates, grads

  return step


def collective_bytes(hlo: str) -> int:
  """The summed result bytes of the collectives in optimized HLO text."""
  total = 0
  op = '|'.join(COLLECTIVES)
  for line in hlo.splitlines():
    m = re.search(rf'=\s*(.*?)\s+(?:{op})(?:-start)?\(', line)
    if not m:
      continue
    for dtype, dims in re.findall(r'([a-z]+[0-9]*)\[([0-9,]*)\]', m.group(1)):
      size = int(np.prod([int(d) for d in dims.split(',') if d]))
      total += size * _itemsize(dtype)
  return total


def _itemsize(dtype: str) -> int:
  if dtype == 'pred':
    return 1
  bits = re.search(r'[0-9]+', dtype)
  return max(1, int(bits.group()) // 8) if bits else 4


def run(case_name: str, pattern: str, kind) -> dict:
  """Compiles and runs ``case_name``'s training step under ``pattern`` on
  a mesh of ``kind`` axes."""
  case = CASES[case_name]
  rules = PATTERNS[pattern]
  mesh = make_mesh(kind)
  model = Wrapped(case)
  x = _input(case)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    batch = nn.logical_to_mesh_axes(case.names, rules)
    x = jax.device_put(x, NamedSharding(mesh, batch))
    variables, _ = nn.init_sharded(model, mesh, rules,
                                   warn_unmapped=False)(jax.random.key(0), x)
    compiled = jax.jit(_step(model, case)).lower(variables, x).compile()
    out = compiled(variables, x)
  return dict(out=jax.device_get(out), hlo=compiled.as_text(),
              out_spec=out[1].sharding.spec,
              temp=compiled.memory_analysis().temp_size_in_bytes)


def max_difference(a, b) -> float:
  diffs = jax.tree.map(
      lambda u, v: float(np.max(np.abs(np.asarray(u, np.float64) -
                                       np.asarray(v, np.float64)),
                                initial=0.0)), a, b)
  return max(jax.tree.leaves(diffs), default=0.0)


def compare(case_name: str, pattern: str) -> dict:
  """Explicit against Auto for one case and pattern."""
  auto = run(case_name, pattern, AxisType.Auto)
  expl = run(case_name, pattern, AxisType.Explicit)
  return dict(
      difference=max_difference(auto['out'], expl['out']),
      scale=max(float(np.max(np.abs(np.asarray(v)), initial=0.0))
                for v in jax.tree.leaves(auto['out'])),
      auto_bytes=collective_bytes(auto['hlo']),
      explicit_bytes=collective_bytes(expl['hlo']),
      auto_temp=auto['temp'], explicit_temp=expl['temp'],
      auto=auto, explicit=expl)


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  cases = flags.FLAGS.cases.split(',') if flags.FLAGS.cases else list(CASES)
  patterns = (flags.FLAGS.patterns.split(',') if flags.FLAGS.patterns
              else list(PATTERNS))
  print('| layer | pattern | max diff | collective KiB auto / explicit | '
        'temp KiB auto / explicit |')
  print('|---|---|---|---|---|')
  for case in cases:
    for pattern in patterns:
      r = compare(case, pattern)
      print(f"| {case} | {pattern} | {r['difference']:.1e} | "
            f"{r['auto_bytes'] / 1024:.1f} / {r['explicit_bytes'] / 1024:.1f}"
            f" | {r['auto_temp'] / 1024:.1f} / "
            f"{r['explicit_temp'] / 1024:.1f} |", flush=True)


if __name__ == '__main__':
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string('cases', '', 'comma-separated cases (default: all)')
  flags.DEFINE_string('patterns', '', 'comma-separated patterns (default: '
                      'all)')
  app.run(main)
