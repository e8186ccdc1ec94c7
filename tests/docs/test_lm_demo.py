"""The language-model demo (examples/lm) at a tiny size: it learns, a resumed
run is bit-identical to an uninterrupted one, and cached sampling agrees with
the full forward pass."""
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods
from examples.lm import data
from examples.lm.model import Config, TransformerLM
from examples.lm.train import (TrainConfig, generate, key_bias_mask,
                               make_optimizer, train)

pytestmark = pytest.mark.usefixtures('fast_compiles')

TINY = TrainConfig(
    model=Config(max_len=32, num_layers=2, num_heads=2, d_model=32),
    steps=16, batch_size=8, learning_rate=1e-2, warmup_steps=4,
    eval_every=8, eval_batches=2, checkpoint_every=8, max_bytes=100_000,
    sample_length=24, plot=None, progress=False)


def _quiet(*_):
  pass


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  cfg = dataclasses.replace(TINY, workdir=str(tmp_path_factory.mktemp('a')))
  return train(cfg, log=_quiet)


def test_data_split_is_disjoint_and_bytes():
  files = data.stdlib_files()
  held = [f for f in files if data.is_held_out(f, 5)]
  assert 0 < len(held) < len(files) // 5
  train_data, held_data = data.load(max_bytes=1000)
  assert train_data.dtype == np.uint8 and len(train_data) == 1000
  assert len(held_data) == 1000
  rng = np.random.default_rng(0)
  b = data.batch(train_data, rng, 3, 16)
  assert b.shape == (3, 17) and b.dtype == np.int32


@pytest.mark.integration  # trains the demo (the runs below reuse `straight`)
def test_loss_decreases(straight):
  train_losses = [loss for _, loss in straight['history']['train']]
  eval_steps, eval_losses = zip(*straight['history']['eval'])
  assert eval_steps == (8, 16)
  assert train_losses[0] > np.log(256) - 0.5  # starts near uniform
  assert train_losses[-1] < train_losses[0] - 1.0
  assert eval_losses[-1] < eval_losses[0]
  assert int(straight['state']['step']) == TINY.steps


@pytest.mark.integration  # with the other LM runs that need `straight`
def test_resume_is_bit_identical(straight, tmp_path):
  cfg = dataclasses.replace(TINY, workdir=str(tmp_path), stop_at=8)
  half = train(cfg, log=_quiet)
  assert int(half['state']['step']) == 8
  resumed = train(dataclasses.replace(cfg, stop_at=None, resume=True),
                  log=_quiet)
  assert int(resumed['state']['step']) == TINY.steps
  for name in ('params', 'opt_state'):
    a = jax.tree_util.tree_leaves_with_path(straight['state'][name])
    b = jax.tree_util.tree_leaves_with_path(resumed['state'][name])
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
      np.testing.assert_array_equal(x, y, err_msg=f'{name}{path}')
  # The held-out history (saved with the checkpoint) continues too.
  assert resumed['history']['eval'] == straight['history']['eval']
  assert resumed['sample'] == straight['sample']


@pytest.mark.integration
def test_sampling(straight):
  sample = straight['sample']
  assert sample.startswith(TINY.prompt)
  assert len(sample.encode('utf-8', errors='replace')) >= TINY.sample_length


def test_optimizer_never_moves_the_attention_key_bias():
  """The key bias's true gradient is zero (softmax ignores a per-query
  shift), so make_optimizer zeroes its update: given gradients everywhere,
  every other parameter moves and the key bias alone stays put."""
  cfg = Config(max_len=8, num_layers=2, num_heads=2, d_model=16)
  init = jax.jit(TransformerLM(cfg).init)  # eager, each op compiles alone
  params = liftmods.unbox(init(
      jax.random.key(0), jnp.zeros((1, cfg.max_len), jnp.int32))['params'])
  paths = [jax.tree_util.keystr(p) for p, masked in
           jax.tree_util.tree_leaves_with_path(key_bias_mask(params)) if masked]
  assert paths == ["['blocks']['attn']['key']['bias']"]
  optimizer = make_optimizer(dataclasses.replace(TINY, warmup_steps=0))
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    moved = bool(jnp.any(u != 0))
    assert moved == (jax.tree_util.keystr(path) not in paths), path


def test_cached_decode_matches_full_forward():
  cfg = Config(max_len=12, num_layers=2, num_heads=2, d_model=16)
  model = TransformerLM(cfg)
  tokens = jax.random.randint(jax.random.key(1), (2, cfg.max_len), 0, 256)
  params = model.init(jax.random.key(0), tokens)['params']
  full = model.apply({'params': params}, tokens)
  decoder = model.clone(decode=True)
  cache = decoder.init(jax.random.key(0), tokens)['cache']
  assert int(cache['index']) == 0
  assert cache['blocks']['attn']['cached_key'].shape == (
      cfg.num_layers, 2, cfg.max_len, cfg.num_heads,
      cfg.d_model // cfg.num_heads)
  # One compiled step (each eager step would compile its own scan).
  step = jax.jit(lambda cache, token: decoder.apply(
      {'params': params, 'cache': cache}, token, mutable=['cache']))
  steps = []
  for t in range(cfg.max_len):
    logits, updated = step(cache, tokens[:, t:t + 1])
    cache = updated['cache']
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=2e-5,
                             rtol=2e-5)


def test_generate_is_deterministic_and_keeps_prompt():
  cfg = Config(max_len=16, num_layers=1, num_heads=2, d_model=16)
  model = TransformerLM(cfg)
  params = model.init(jax.random.key(0),
                      jnp.zeros((1, cfg.max_len), jnp.int32))['params']
  prompt = data.encode('ab')
  a = generate(model, params, prompt, 16, jax.random.key(3), 1.0)
  b = generate(model, params, prompt, 16, jax.random.key(3), 1.0)
  assert a.shape == (16,) and (a >= 0).all() and (a < 256).all()
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a[:2], prompt)
  with pytest.raises(ValueError, match='prompt'):
    generate(model, params, data.encode('x' * 16), 16, jax.random.key(3))


@pytest.mark.integration
def test_eight_devices_train_like_one(straight, tmp_path):
  """``python -m examples.lm --devices=8`` (sharded init, sharded step on a
  4x2 mesh of simulated CPU devices) follows the one-device run."""
  root = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(root))
  env.pop('XLA_FLAGS', None)  # the demo sets the device count itself
  m = TINY.model
  flags = ['--devices=8', f'--seq_len={m.max_len}', f'--layers={m.num_layers}',
           f'--heads={m.num_heads}', f'--d_model={m.d_model}',
           f'--steps={TINY.steps}', f'--batch_size={TINY.batch_size}',
           f'--learning_rate={TINY.learning_rate}',
           f'--warmup_steps={TINY.warmup_steps}',
           f'--eval_every={TINY.eval_every}',
           f'--eval_batches={TINY.eval_batches}',
           f'--checkpoint_every={TINY.checkpoint_every}',
           f'--max_bytes={TINY.max_bytes}',
           f'--sample_length={TINY.sample_length}', '--no_progress',
           f'--workdir={tmp_path}']
  proc = subprocess.run([sys.executable, '-m', 'examples.lm', *flags],
                        cwd=root, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "mesh: {'data': 4, 'model': 2} over 8 cpu devices" in proc.stdout
  local, total = (int(n.replace(',', '')) for n in re.search(
      r'([\d,]+) of ([\d,]+) bytes on each device', proc.stdout).groups())
  assert local < total  # the sharded parameters are not whole anywhere
  history = json.loads((tmp_path / 'summary.json').read_text())['history']
  for kind in ('train', 'eval'):
    steps, losses = zip(*history[kind])
    want_steps, want = zip(*straight['history'][kind])
    assert steps == want_steps
    np.testing.assert_allclose(losses, want, rtol=2e-4, err_msg=kind)
