"""Int8 training and serving of the LM demo with qwix, on liftmods.

  python -m examples.quantize              # about 2 minutes on 2 CPU cores
  python -m examples.quantize --steps=600 --batch_size=32   # the demo's run

From one initialisation, ``examples/lm``'s TransformerLM is trained twice on
the same batches: in float32, and with int8 quantization-aware training
(QAT: ``qwix.QtProvider`` fake-quantizes weights and activations to int8 in
the forward pass; gradients pass straight through). The float32-trained
parameters are then converted to int8 for serving (post-training
quantization, PTQ: ``qwix.PtqProvider`` and ``qwix.quantize_params``), and so
are the QAT-trained ones. The held-out loss of each model and the bytes of
each parameter tree are printed as a markdown table.

qwix is Linen code: its modules say ``from flax import linen as nn`` when
they are imported. ``liftmods.compat.install()``, run before qwix is
imported, makes that import give liftmods, so qwix quantizes liftmods models
unmodified. The optimizer, data, loss and evaluation are the demo's own
(``examples/lm/train.py``).

Two things the conversion to int8 has to work around (flax.linen hits both
the same way; see docs/quantization.md):

- The output projection is the token embedding (``Embed.attend``), which
  qwix's PTQ cannot serve quantized, so the PTQ rule covers the blocks only.
- ``qwix.quantize_params`` quantizes each parameter as the layer computing
  with it sees it. The blocks' parameters are stacked ``(layers, ...)``
  (``nn.Stack``), one layer per slice, so :func:`quantize_for_serving` maps
  the quantization over the layer axis.
"""
# The switch goes first, before anything imports qwix (or flax.linen).
from liftmods import compat

compat.install()

# pylint: disable=wrong-import-position
import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import qwix

import liftmods as nn
from examples.lm import data, train
from examples.lm.model import Config, TransformerLM

# Every matmul in training, the blocks' matmuls in serving (see the
# docstring). The same rule with ``module_path='blocks/.*'`` trains exactly
# the model that is served.
QAT_RULES = (qwix.QtRule(module_path='.*', weight_qtype='int8',
                         act_qtype='int8'),)
PTQ_RULES = (qwix.QuantizationRule(module_path='blocks/.*',
                                   weight_qtype='int8', act_qtype='int8'),)
# Parameter subtrees stacked on a leading layer axis (the nn.Stack).
LAYER_STACKS = ('blocks',)


def qat_model(model: nn.Module, rules=QAT_RULES) -> nn.Module:
  """``model`` with int8 fake quantization in its forward pass; its
  parameters are the float ones, the same tree as ``model``'s."""
  return qwix.quantize_model(model, qwix.QtProvider(list(rules)))


def ptq_model(model: nn.Module, rules=PTQ_RULES) -> nn.Module:
  """``model`` computing with int8 parameters (from
  :func:`quantize_for_serving`)."""
  return qwix.quantize_model(model, qwix.PtqProvider(list(rules)))


def quantize_for_serving(served: nn.Module, params, stacks=LAYER_STACKS):
  """``params`` (float, unboxed) converted for the PTQ model ``served``.

  qwix learns how to quantize each parameter (its contraction axes) by
  running ``served.init`` abstractly. For a stacked subtree that ``how``
  is one layer's, so the subtree is quantized slice by slice with
  ``jax.vmap``: each layer gets its own per-channel scales, the result
  keeps the ``(layers, ...)`` layout.
  """
  tokens = jnp.zeros((1, served.config.max_len), jnp.int32)
  abstract = nn.unbox(jax.eval_shape(served.init, jax.random.key(0),
                                     tokens)['params'])
  quantized = qwix.quantize_params(
      {k: v for k, v in params.items() if k not in stacks}, abstract)
  for name in stacks:
    one_layer = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), abstract[name])
    quantized[name] = jax.vmap(
        lambda p, layer=one_layer: qwix.quantize_params(p, layer))(
            params[name])
  return quantized


def _is_quantized(x) -> bool:
  return isinstance(x, qwix.QArray)


def param_bytes(params) -> dict:
  """Bytes of a parameter tree: ``total``; of its int8 leaves
  (``int8``: values, ``scales``: their float scales); and ``float`` of the
  rest."""
  out = {'int8': 0, 'scales': 0, 'float': 0}
  for leaf in jax.tree_util.tree_leaves(params, is_leaf=_is_quantized):
    if _is_quantized(leaf):
      out['int8'] += leaf.qvalue.nbytes
      out['scales'] += sum(x.nbytes for x in jax.tree_util.tree_leaves(
          (leaf.scale, leaf.zero_point)))
    else:
      out['float'] += leaf.nbytes
  out['total'] = out['int8'] + out['scales'] + out['float']
  return out


def quantized_leaves_bytes(float_params, served_params) -> int:
  """Float32 bytes of the parameters that ``served_params`` holds in int8."""
  flat_served = dict(jax.tree_util.tree_flatten_with_path(
      served_params, is_leaf=_is_quantized)[0])
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(float_params)[0]:
    # A quantized leaf keeps the float leaf's path (qwix's WithAux adds
    # '.array' below it).
    if any(_is_quantized(v) and k[:len(path)] == path
           for k, v in flat_served.items()):
      total += leaf.nbytes
  return total


def fit(model: nn.Module, cfg: train.TrainConfig, state, train_data):
  """``cfg.steps`` steps of the demo's train step from ``state`` (which is
  consumed); the batch of step ``i`` is the demo's. Returns
  ``(params, losses, median seconds per step after the first)``."""
  step = train.make_train_step(model, train.make_optimizer(cfg), cfg.seed)
  losses, times = [], []
  for i in range(cfg.steps):
    batch = data.batch(train_data, np.random.default_rng([cfg.seed, i]),
                       cfg.batch_size, cfg.seq_len)
    start = time.perf_counter()
    state, loss = step(state, batch)
    losses.append(float(loss))  # waits for the step
    times.append(time.perf_counter() - start)
  return state['params'], losses, statistics.median(times[1:] or times)


def held_out_loss(model: nn.Module, params, batches) -> float:
  return train.evaluate(train.make_eval_step(model), params, batches)


def run(cfg: train.TrainConfig, log=print) -> dict:
  """Trains in float32 and with QAT, converts both to int8 for serving and
  evaluates all four; returns the losses and byte counts."""
  model = TransformerLM(cfg.model)
  train_data, held_data = data.load(max_bytes=cfg.max_bytes)
  held = data.eval_batches(held_data, cfg.eval_batches, cfg.batch_size,
                           cfg.seq_len)
  optimizer = train.make_optimizer(cfg)
  # One initialisation for both runs (each run consumes its copy).
  state, _ = train.init_state(model, optimizer, cfg.seed)
  copy = jax.tree_util.tree_map(jnp.copy, state)
  results = {'config': cfg}
  for name, trained, start in (('f32', model, state),
                               ('qat', qat_model(model), copy)):
    began = time.perf_counter()
    params, losses, step_s = fit(trained, cfg, start, train_data)
    results[name] = {'params': params, 'train_loss': losses,
                     'step_s': step_s,
                     'eval': held_out_loss(trained, params, held)}
    log(f'{name}: {cfg.steps} steps in {time.perf_counter() - began:.1f}s, '
        f'held-out loss {results[name]["eval"]:.4f}')
  served = ptq_model(model)
  for name in ('f32', 'qat'):
    params = quantize_for_serving(served, results[name]['params'])
    results[f'{name}_ptq'] = {
        'params': params, 'eval': held_out_loss(served, params, held),
        'bytes': param_bytes(params)}
  results['f32']['bytes'] = param_bytes(results['f32']['params'])
  results['quantized_f32_bytes'] = quantized_leaves_bytes(
      results['f32']['params'], results['f32_ptq']['params'])
  return results


def table(results: dict) -> str:
  """The results as a markdown table."""
  f32 = results['f32']['eval']
  full = results['f32']['bytes']['total']
  quantized_f32 = results['quantized_f32_bytes']
  served = results['f32_ptq']['bytes']

  def loss(r):
    delta = r['eval'] - f32
    return f'{r["eval"]:.4f} | {delta:+.5f} ({delta / f32:+.3%})'

  served_bytes = (f'{served["total"]:,} ({served["total"] / full:.2f}×): '
                  f'{served["int8"]:,} int8 + {served["scales"]:,} scales + '
                  f'{served["float"]:,} float32')
  rows = [
      '| model | held-out loss | vs float32 | parameter bytes |',
      '|---|---|---|---|',
      f'| float32 | {loss(results["f32"])} | {full:,} |',
      f'| int8 QAT (fake-quantized forward) | {loss(results["qat"])} | '
      f'{full:,} (trains float32 parameters) |',
      f'| int8 PTQ of the float32 run, served | {loss(results["f32_ptq"])} '
      f'| {served_bytes} |',
      f'| int8 PTQ of the QAT run, served | {loss(results["qat_ptq"])} | '
      'same |',
  ]
  quantized = served['int8'] + served['scales']
  rows.append(
      f'\nThe quantized parameters (the blocks\' kernels) take '
      f'{quantized:,} bytes served against {quantized_f32:,} in float32 '
      f'({quantized / quantized_f32:.3f}×; int8 values alone '
      f'{served["int8"] / quantized_f32:.2f}×). Train step, median: float32 '
      f'{results["f32"]["step_s"] * 1e3:.0f} ms, QAT '
      f'{results["qat"]["step_s"] * 1e3:.0f} ms.')
  return '\n'.join(rows)


def parse(argv=None) -> train.TrainConfig:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add = p.add_argument
  add('--steps', type=int, default=150)
  add('--batch_size', type=int, default=16)
  add('--seq_len', type=int, default=128)
  add('--layers', type=int, default=4)
  add('--heads', type=int, default=4)
  add('--d_model', type=int, default=128)
  add('--learning_rate', type=float, default=3e-3)
  add('--warmup_steps', type=int, default=15)
  add('--eval_batches', type=int, default=8)
  add('--max_bytes', type=int, default=None,
      help='use only this many bytes of text')
  add('--seed', type=int, default=0)
  a = p.parse_args(argv)
  model = Config(max_len=a.seq_len, num_layers=a.layers, num_heads=a.heads,
                 d_model=a.d_model)
  return dataclasses.replace(
      train.TrainConfig(), model=model, steps=a.steps,
      batch_size=a.batch_size, learning_rate=a.learning_rate,
      warmup_steps=a.warmup_steps, eval_batches=a.eval_batches,
      max_bytes=a.max_bytes, seed=a.seed)


def main(argv=None):
  began = time.perf_counter()
  cfg = parse(argv)
  results = run(cfg)
  print()
  print(table(results))
  print(f'\n{cfg.steps} steps, batch {cfg.batch_size} x {cfg.seq_len}, '
        f'{cfg.model.num_layers} layers of d={cfg.model.d_model}; '
        f'jax {jax.__version__}, {jax.devices()[0].device_kind}; total '
        f'{time.perf_counter() - began:.0f}s')


if __name__ == '__main__':
  main()
