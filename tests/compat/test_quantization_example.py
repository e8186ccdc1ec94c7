"""examples/quantize.py at a tiny size: int8 QAT and PTQ of the LM demo
with qwix on liftmods.

The example installs ``liftmods.compat``'s switch for its whole process
(before qwix is imported, as it must be), so it runs in a child process;
the child writes what is checked here to a JSON file.
"""
import json
import os
import subprocess
import sys

import pytest

# About 45 CPU-s of compiles (float32 and QAT train steps, three evals).
pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

CHILD = r'''
import json, sys
from examples import quantize as q  # installs the switch, then imports qwix
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from examples.lm import data
from examples.lm.model import TransformerLM

cfg = q.parse(['--steps=4', '--layers=2', '--heads=2', '--d_model=32',
               '--seq_len=16', '--batch_size=4', '--warmup_steps=1',
               '--eval_batches=2', '--max_bytes=100000'])
res = q.run(cfg, log=lambda *_: None)
model = TransformerLM(cfg.model)
served = q.ptq_model(model)
tokens = data.eval_batches(data.load(max_bytes=cfg.max_bytes)[1], 1, 4,
                           cfg.seq_len)[0][:, :-1]
f32 = model.apply({'params': res['f32']['params']}, tokens)
ptq = served.apply({'params': res['f32_ptq']['params']}, tokens)

# Each layer's int8 kernel, dequantized, against that layer's float kernel.
float_fc = res['f32']['params']['blocks']['mlp']['fc']['kernel']
int8_fc = res['f32_ptq']['params']['blocks']['mlp']['fc']['kernel'].array
error = jnp.abs(qwix.dequantize(int8_fc) - float_fc)
out = {
    'qat_train': res['qat']['train_loss'],
    'f32_train': res['f32']['train_loss'],
    'eval': {k: res[k]['eval'] for k in ('f32', 'qat', 'f32_ptq', 'qat_ptq')},
    'logits_max': float(jnp.abs(f32).max()),
    'logits_diff': float(jnp.abs(ptq - f32).max()),
    'argmax_agree': float((ptq.argmax(-1) == f32.argmax(-1)).mean()),
    'fc_shape': list(float_fc.shape),
    'fc_qvalue': [list(int8_fc.qvalue.shape), str(int8_fc.qvalue.dtype)],
    'fc_scale_shape': list(int8_fc.scale.shape),
    'fc_error_over_half_step': float(
        (error / (int8_fc.scale / 2)).max()),
    # qwix's int8 bound is 127.5 (the outer buckets are whole).
    'fc_scale_vs_absmax': float((jnp.abs(
        int8_fc.scale * 127.5 / jnp.abs(float_fc).max(1, keepdims=True) - 1
    )).max()),
    'bytes': {'f32': res['f32']['bytes'], 'served': res['f32_ptq']['bytes'],
              'quantized_f32': res['quantized_f32_bytes']},
}
json.dump(out, open(sys.argv[1], 'w'))
'''


@pytest.fixture(scope='module')
def result(tmp_path_factory):
  path = tmp_path_factory.mktemp('quantize') / 'out.json'
  run = subprocess.run([sys.executable, '-c', CHILD, str(path)], cwd=ROOT,
                       env={**os.environ, 'PYTHONPATH': ROOT},
                       capture_output=True, text=True, timeout=600,
                       check=False)
  assert run.returncode == 0, run.stderr[-4000:]
  return json.loads(path.read_text())


def test_qat_trains_and_stays_near_float32(result):
  qat, f32 = result['qat_train'], result['f32_train']
  assert len(qat) == len(f32) == 4
  # Same init and batches: the first step's loss differs only by the
  # int8 rounding of the forward pass.
  assert abs(qat[0] - f32[0]) < 0.01 * f32[0]
  assert qat[-1] < qat[0]  # it learns
  ev = result['eval']
  assert all(v == v and v < 10 for v in ev.values()), ev  # finite, sane
  assert abs(ev['qat'] - ev['f32']) < 0.05 * ev['f32'], ev


def test_ptq_serves_the_float_model(result):
  ev = result['eval']
  assert abs(ev['f32_ptq'] - ev['f32']) < 0.02 * ev['f32'], ev
  assert abs(ev['qat_ptq'] - ev['qat']) < 0.02 * ev['qat'], ev
  # Logits within 5% of their largest magnitude (about 2% measured), and
  # the same next byte predicted almost everywhere.
  assert result['logits_diff'] < 0.05 * result['logits_max'], result
  assert result['argmax_agree'] > 0.9, result


def test_stacked_kernels_quantized_per_layer(result):
  """Each layer of the (layers, in, out) kernel gets its own per-output-
  channel scale (the per-layer map of quantize_for_serving): the scale is
  that layer's absmax / 127.5 and every value is within half a step."""
  layers, fan_in, fan_out = result['fc_shape']
  assert result['fc_qvalue'] == [[layers, fan_in, fan_out], 'int8']
  assert result['fc_scale_shape'] == [layers, 1, fan_out]
  assert result['fc_scale_vs_absmax'] < 1e-5
  assert result['fc_error_over_half_step'] <= 1 + 1e-4


def test_served_bytes(result):
  b = result['bytes']
  served, quantized_f32 = b['served'], b['quantized_f32']
  # int8 values: exactly a quarter of the float32 bytes they replace.
  assert served['int8'] * 4 == quantized_f32
  # One float32 scale per output channel per layer: a few percent more.
  assert 0 < served['scales'] < 0.1 * served['int8']
  # What is not quantized (embedding, positions, norms, biases) is kept.
  assert served['float'] == b['f32']['total'] - quantized_f32
  assert served['total'] < b['f32']['total']
