"""One side of the qwix / AQT differential test, run in its own process.

``python -m tests.compat.quant_side {flax,liftmods} OUT.npz [CASE ...]``
quantizes small models with qwix and AQT and saves every array it compares.
With ``liftmods`` the switch :mod:`liftmods.compat` is installed before qwix
and aqt are imported, so their unmodified ``import flax.linen`` gets
liftmods; both libraries reach into Linen's internals (the module stack,
``wrap_method_once``, ``Module.param`` patched by bytecode, boxes written
against ``flax.core.meta``).

Cases (the parts each saves are listed in ``PARTS``):

- ``qwix_qat_dynamic`` / ``qwix_qat_static``: ``qwix.QtProvider`` with int8
  weights and activations (activation scales computed per call, or static
  ones kept in ``quant_stats``) on a model with ``nn.Conv``, ``nn.Dense``,
  ``nn.Einsum`` and a bare ``jnp.einsum`` over a parameter;
- ``qwix_ptq``: ``qwix.PtqProvider``: ``quantize_params`` of the float
  model's parameters and the quantized forward, with dynamic activation
  scales and with static ones from the QAT statistics;
- ``qwix_lora`` / ``qwix_qlora``: ``qwix.LoraProvider`` over float or int8
  base weights: init, forward, gradient of the LoRA parameters and three
  Adam steps;
- ``aqt_mnist``: AQT's MNIST example (``flax_e2e_model``) end to end on
  tiny synthetic MNIST-shaped batches: ``create_train_state`` with int8
  ``AqtDotGeneral`` / ``AqtEinsum`` / ``AqtConvGeneralDilated``,
  ``train_epoch``, ``serving_conversion`` (int8 weights, and int8 weights
  and activations) and the served forward;
- ``aqt_block``: a Transformer block (attention + MLP) whose projections
  use ``AqtDotGeneral`` and whose attention einsums are ``AqtEinsum``:
  init, forward, gradient.

AQT's example module imports ``tensorflow_datasets`` and
``flax.metrics.tensorboard`` (TensorFlow) for its dataset download and
summaries, which these cases do not use; both sides install
``tools/no_tensorflow.py``'s stand-ins for them.
"""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tests.compat.differential import flat, run_side

X = np.random.RandomState(0).randn(2, 6, 6, 3).astype(np.float32)
Y = np.random.RandomState(1).randn(2, 4, 3).astype(np.float32)


def no_tensorflow():
  from tools import no_tensorflow as stand_ins  # pylint: disable=import-outside-toplevel
  stand_ins.install()


# -- qwix ---------------------------------------------------------------------


def _net():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class Net(nn.Module):
    """Conv, Dense, nn.Einsum and jnp.einsum over a parameter."""

    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(4, (3, 3), name='conv')(x))
      x = x.reshape(x.shape[0], -1)
      x = nn.relu(nn.Dense(16, name='dense')(x))
      x = nn.Einsum((16, 4, 5), 'bc,cnd->bnd', name='einsum')(x)
      w = self.param('proj', nn.initializers.lecun_normal(), (5, 3))
      return jnp.einsum('bnd,de->bne', nn.relu(x), w)

  return Net()


def _mse(out):
  return jnp.mean(jnp.square(out - Y))


def _qt_rules(static):
  """int8 weights and activations. qwix's conv updates static-scale
  statistics inside its custom_vjp forward, which leaks a tracer (under
  flax.linen too), so the conv keeps dynamic activation scales."""
  import qwix  # pylint: disable=import-outside-toplevel
  return [qwix.QtRule(module_path=path, weight_qtype='int8', act_qtype='int8',
                      act_static_scale=static and path != 'conv')
          for path in ('conv', '.*')]


def _qat_forward(static):
  import qwix  # pylint: disable=import-outside-toplevel
  model = qwix.quantize_model(_net(), qwix.QtProvider(_qt_rules(static)))
  variables = jax.jit(model.init)(jax.random.key(0), X)
  y, updated = jax.jit(lambda v, x: model.apply(
      v, x, mutable=['quant_stats']))(variables, X)
  return model, variables, y, updated


def _qat(name, static, out):
  model, variables, y, updated = _qat_forward(static)
  flat(f'{name}/init', variables, out)
  flat(f'{name}/forward', (y, updated), out)

  def loss(params):  # a QAT training step's: the statistics update too
    y, updated = model.apply({**variables, 'params': params}, X,
                             mutable=['quant_stats'])
    return _mse(y), updated

  flat(f'{name}/grads',
       jax.jit(jax.grad(loss, has_aux=True))(variables['params']), out)


def qwix_ptq(out):
  """Dynamic activation scales from the float model's parameters; static
  ones (SRQ) from the QAT model's parameters and statistics."""
  import qwix  # pylint: disable=import-outside-toplevel
  for part, static in (('', False), ('srq_', True)):
    model = qwix.quantize_model(_net(), qwix.PtqProvider(_qt_rules(static)))
    abstract = jax.eval_shape(model.init, jax.random.key(0), X)['params']
    if static:
      _, variables, _, updated = _qat_forward(True)
      qparams = qwix.quantize_params(variables['params'], abstract,
                                     updated['quant_stats'])
    else:
      float_params = jax.jit(_net().init)(jax.random.key(0), X)['params']
      qparams = qwix.quantize_params(float_params, abstract)
    flat(f'qwix_ptq/{part}qparams', qparams, out)
    flat(f'qwix_ptq/{part}forward',
         jax.jit(model.apply)({'params': qparams}, X), out)


def _lora(name, weight_qtype, out):
  import flax.traverse_util as traverse  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import qwix  # pylint: disable=import-outside-toplevel
  # LoRA on the Conv and Dense layers. qwix's LoRA einsum records its
  # equation with setattr on the module, which a Linen module refuses
  # outside setup (under flax.linen too), so the einsums get no adapters;
  # under QLoRA their weights are quantized all the same. qwix's int8 conv
  # needs int8 activations too.
  act_qtype = weight_qtype
  rules = [qwix.LoraRule(module_path='conv|dense', rank=2, alpha=4.0,
                         weight_qtype=weight_qtype, act_qtype=act_qtype),
           qwix.QuantizationRule(module_path='.*', weight_qtype=weight_qtype,
                                 act_qtype=act_qtype)]
  model = qwix.apply_lora_to_model(_net(), qwix.LoraProvider(rules))
  variables = jax.jit(model.init)(jax.random.key(0), X)
  flat(f'{name}/init', variables, out)
  every = traverse.flatten_dict(variables['params'])
  is_lora = lambda path: '_lora_' in path[-1]
  lora = traverse.unflatten_dict({p: v for p, v in every.items()
                                  if is_lora(p)})
  frozen = {p: v for p, v in every.items() if not is_lora(p)}

  def loss(lora_params):
    params = {**frozen, **traverse.flatten_dict(lora_params)}
    return _mse(model.apply({'params': traverse.unflatten_dict(params)}, X))

  flat(f'{name}/forward', jax.jit(model.apply)(variables, X), out)
  flat(f'{name}/grads', jax.jit(jax.grad(loss))(lora), out)
  opt = optax.adam(1e-2)

  @jax.jit
  def step(lora_params, opt_state):
    value, grads = jax.value_and_grad(loss)(lora_params)
    updates, opt_state = opt.update(grads, opt_state, lora_params)
    return optax.apply_updates(lora_params, updates), opt_state, value

  opt_state = opt.init(lora)
  losses = []
  for _ in range(3):
    lora, opt_state, value = step(lora, opt_state)
    losses.append(value)
  flat(f'{name}/steps', (lora, opt_state, losses), out)


# -- AQT ----------------------------------------------------------------------


def aqt_mnist(out):
  # pylint: disable=import-outside-toplevel
  from aqt.jax.v2 import aqt_conv_general
  from aqt.jax.v2 import config as aqt_config
  from aqt.jax.v2.examples import flax_e2e_model as e2e
  # pylint: enable=import-outside-toplevel
  rng = np.random.RandomState(2)
  data = {'image': rng.rand(24, 28, 28, 1).astype(np.float32),
          'label': rng.randint(0, 10, 24).astype(np.int32)}
  cfg = aqt_config.fully_quantized(fwd_bits=8, bwd_bits=8)
  conv = aqt_conv_general.conv_general_dilated_make(2, lhs_bits=8,
                                                    rhs_bits=8)
  # The example's init and conversion run eagerly; under jit they compile
  # one program each instead of hundreds of small ones.
  state = jax.jit(functools.partial(
      e2e.create_train_state, aqt_cfg_dg=cfg, aqt_cfg_conv=conv))(
          jax.random.key(0))
  flat('aqt_mnist/init', state.model, out)
  state, loss, accuracy = e2e.train_epoch(state, data, 8, jax.random.key(1))
  flat('aqt_mnist/train', (state.model, state.opt_state, loss, accuracy),
       out)
  for part, weight_only in (('', True), ('w8a8_', False)):
    # weight_only=False also freezes activation scales (from the
    # conversion's input).
    serve_fns = []

    def convert(state, weight_only=weight_only, serve_fns=serve_fns):
      serve, serving = e2e.serving_conversion(state, weight_only=weight_only)
      serve_fns.append(serve)
      return serving

    serving = jax.jit(convert)(state)
    flat(f'aqt_mnist/{part}serving', serving, out)
    logits = jax.jit(serve_fns[0])(serving, data['image'][:8],
                                   rngs={'params': jax.random.key(3)})
    flat(f'aqt_mnist/{part}served', logits, out)


def _block(cfg):
  # pylint: disable=import-outside-toplevel
  import flax.linen as nn
  from aqt.jax.v2.flax import aqt_flax
  # pylint: enable=import-outside-toplevel
  dot_general = functools.partial(aqt_flax.AqtDotGeneral, cfg)

  class Block(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP, all quantized."""
    heads: int = 2
    head_dim: int = 8

    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(x)
      qkv = nn.DenseGeneral((3, self.heads, self.head_dim), name='qkv',
                            dot_general_cls=dot_general)(h)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
      scores = aqt_flax.AqtEinsum(cfg, name='scores')('bqhd,bkhd->bhqk', q,
                                                      k)
      causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
      weights = jax.nn.softmax(
          jnp.where(causal, scores / np.sqrt(self.head_dim), -1e9))
      mixed = aqt_flax.AqtEinsum(cfg, name='mix')('bhqk,bkhd->bqhd',
                                                  weights, v)
      x = x + nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name='out',
                              dot_general_cls=dot_general)(mixed)
      h = nn.LayerNorm()(x)
      h = nn.gelu(nn.Dense(32, dot_general_cls=dot_general)(h))
      return x + nn.Dense(x.shape[-1], dot_general_cls=dot_general)(h)

  return Block()


def aqt_block(out):
  from aqt.jax.v2 import config as aqt_config  # pylint: disable=import-outside-toplevel
  model = _block(aqt_config.fully_quantized(fwd_bits=8, bwd_bits=8))
  x = np.random.RandomState(3).randn(2, 5, 16).astype(np.float32)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  flat('aqt_block/init', variables, out)
  rngs = {'params': jax.random.key(4)}
  y = jax.jit(lambda v, x: model.apply(v, x, rngs=rngs))(variables, x)
  flat('aqt_block/forward', y, out)

  def loss(params, x):
    y = model.apply({**variables, 'params': params}, x, rngs=rngs)
    return jnp.mean(jnp.square(y))

  flat('aqt_block/grads',
       jax.jit(jax.grad(loss, argnums=(0, 1)))(variables['params'], x), out)


CASES = {
    'qwix_qat_dynamic': lambda out: _qat('qwix_qat_dynamic', False, out),
    'qwix_qat_static': lambda out: _qat('qwix_qat_static', True, out),
    'qwix_ptq': qwix_ptq,
    'qwix_lora': lambda out: _lora('qwix_lora', None, out),
    'qwix_qlora': lambda out: _lora('qwix_qlora', 'int8', out),
    'aqt_mnist': aqt_mnist,
    'aqt_block': aqt_block,
}
PARTS = {
    'qwix_qat_dynamic': ('init', 'forward', 'grads'),
    'qwix_qat_static': ('init', 'forward', 'grads'),
    'qwix_ptq': ('qparams', 'forward', 'srq_qparams', 'srq_forward'),
    'qwix_lora': ('init', 'forward', 'grads', 'steps'),
    'qwix_qlora': ('init', 'forward', 'grads', 'steps'),
    'aqt_mnist': ('init', 'train', 'serving', 'served', 'w8a8_serving',
                  'w8a8_served'),
    'aqt_block': ('init', 'forward', 'grads'),
}

if __name__ == '__main__':
  run_side(sys.argv[1:], CASES, no_tensorflow)
