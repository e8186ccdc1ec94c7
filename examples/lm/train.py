"""Training loop for the byte-level Transformer LM: optax, orbax, tqdm.

Everything a step depends on is a function of the saved state: the batch
for step ``i`` comes from ``numpy.random.default_rng([seed, i])`` and the
dropout key is ``fold_in(key(seed), i)``, so resuming from a checkpoint
continues exactly as if training had never stopped.
"""
import dataclasses
import functools
import json
import math
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

import liftmods as nn
from examples.lm import data
from examples.lm.model import LOGICAL_RULES, Config, TransformerLM


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Training hyperparameters and run options (the command-line flags)."""
  model: Config = Config()
  steps: int = 600
  batch_size: int = 32
  learning_rate: float = 3e-3
  warmup_steps: int = 60
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  seed: int = 0
  eval_every: int = 100
  eval_batches: int = 8
  checkpoint_every: int = 200
  workdir: str = 'runs/lm'
  resume: bool = False
  stop_at: int | None = None  # stop (checkpointed) before ``steps``, to resume
  max_bytes: int | None = None
  sample_length: int = 128
  prompt: str = 'def '
  temperature: float = 0.7
  plot: str | None = 'loss.png'
  progress: bool = True
  devices: int = 1  # > 1: a ('data', 'model') mesh over that many devices
  # The mesh's axis types: 'explicit' (jax.make_mesh's default: arrays'
  # shardings are part of their types) or 'auto' (XLA propagates them).
  mesh_axes: str = 'explicit'
  save_params: bool = False  # write the final parameters to params.npz
  step_file: str | None = None  # process 0 writes each finished step here

  @property
  def mesh_shape(self) -> tuple[int, int]:
    """``(data, model)``: two-way model parallelism when it divides the
    heads and the device count, the rest data parallel."""
    model = 2 if self.devices % 2 == 0 and self.model.num_heads % 2 == 0 else 1
    if self.devices > 1 and self.batch_size % (self.devices // model):
      raise ValueError(f'batch_size {self.batch_size} must divide over the '
                       f'{self.devices // model} data-parallel devices')
    return self.devices // model, model

  @property
  def seq_len(self) -> int:
    return self.model.max_len


# --- several processes --------------------------------------------------------

def local_rows(sharding: jax.sharding.Sharding, batch_size: int) -> slice:
  """The rows of a ``[batch_size, ...]`` global batch that this process's
  devices hold under ``sharding`` (all rows in a one-process run)."""
  index = sharding.addressable_devices_indices_map((batch_size, 1))
  starts = [idx[0].indices(batch_size)[0] for idx in index.values()]
  stops = [idx[0].indices(batch_size)[1] for idx in index.values()]
  rows = slice(min(starts), max(stops))
  if (rows.stop - rows.start) * jax.process_count() != batch_size:
    raise ValueError(
        f'process {jax.process_index()} would hold rows {rows.start}:'
        f'{rows.stop} of a batch of {batch_size}: the data axis must split '
        'the batch evenly over processes')
  return rows


def global_batch(local: np.ndarray, sharding, batch_size: int):
  """A global ``jax.Array`` from this process's rows (``local``)."""
  if sharding is None:
    return local
  return jax.make_array_from_process_local_data(
      sharding, local, (batch_size,) + local.shape[1:])


def on_all_processes(params, mesh):
  """``params`` copied whole onto every device (an all-gather): a
  multi-process array can then be read on each host."""
  if mesh is None or jax.process_count() == 1:
    return params
  whole = NamedSharding(mesh, PartitionSpec())
  return jax.jit(lambda p: p, out_shardings=whole)(params)


def is_lead() -> bool:
  """Process 0 logs, plots, samples and writes the summary."""
  return jax.process_index() == 0


def report_step(path: str, step: int, loss) -> None:
  """Writes ``step`` to ``path`` once ``loss`` (that step's result) is
  computed: a progress signal for another program (the fault test kills a
  process when it reads a chosen step). Waiting for the loss makes every
  step synchronous, so it is off unless ``--step_file`` is given. The
  file is replaced whole (write, then rename): a reader never sees half."""
  jax.block_until_ready(loss)
  tmp = pathlib.Path(f'{path}.tmp')
  tmp.write_text(str(step))
  tmp.replace(path)


# --- optimizer and steps ---------------------------------------------------

def key_bias_mask(params):
  """True at the attention's key-projection bias.

  Its true gradient is zero: it adds ``q . b`` to every logit of a query,
  and the softmax over keys ignores a constant shift. The computed gradient
  is rounding noise (about 1e-9), which Adam divides by its own size and
  turns into steps of the learning rate's order, so trained it drifts at
  random, and differently on any other device or process layout (by 2e-3
  after 8 steps of the 2 x 4 vs 1 x 8 test, where every other parameter
  agrees to 1.3e-7). The optimizer zeroes its update; it stays at its init.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, _: [getattr(k, 'key', None) for k in path[-3:]] ==
      ['attn', 'key', 'bias'], params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup, cosine decay and global-norm clipping.

  Weight decay applies to kernels and embeddings only (not to biases,
  norm scales or position tables). The attention's key bias is never
  updated (see :func:`key_bias_mask`)."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, cfg.warmup_steps,
      max(cfg.steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * 0.1)

  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key in ('kernel', 'embedding'), params)

  return optax.chain(
      optax.masked(optax.set_to_zero(), key_bias_mask),
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                  mask=decay_mask))


def cross_entropy(logits, targets):
  """Mean next-token cross-entropy, with one-hot labels: picking each
  target's logit by index is a gather along the vocabulary, which JAX
  refuses on an Explicit mesh where the logits' vocabulary dimension is
  sharded (it would need the whole row); a one-hot sum reads it in place."""
  labels = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
  return optax.softmax_cross_entropy(logits.astype(jnp.float32),
                                     labels).mean()


def make_mesh(cfg: TrainConfig) -> jax.sharding.Mesh | None:
  """The ``('data', 'model')`` mesh for ``cfg.devices`` (None for one)."""
  if cfg.devices <= 1:
    return None
  if jax.device_count() < cfg.devices:
    raise ValueError(
        f'--devices={cfg.devices} but JAX sees {jax.device_count()} device(s); '
        'on CPU set XLA_FLAGS=--xla_force_host_platform_device_count='
        f'{cfg.devices} before JAX is imported (python -m examples.lm does).')
  devices = jax.devices()[:cfg.devices]
  if cfg.mesh_axes == 'explicit':  # JAX's default axis type
    return jax.make_mesh(cfg.mesh_shape, ('data', 'model'), devices=devices)
  auto = jax.sharding.AxisType.Auto  # XLA propagates the rest (GSPMD)
  return jax.make_mesh(cfg.mesh_shape, ('data', 'model'), (auto, auto),
                       devices=devices)


def init_state(model: TransformerLM, optimizer, seed: int,
               mesh: jax.sharding.Mesh | None = None, unbox=nn.unbox):
  """``({'step', 'params', 'opt_state'}, shardings)`` for a fresh run.

  On a mesh the parameters are created in their shards by
  ``nn.init_sharded`` (no parameter is ever whole on one device) and the
  optimizer state follows them; ``shardings`` is then the matching tree of
  ``NamedSharding``s, otherwise None. ``unbox`` strips the partitioning
  boxes (pass ``flax.linen.unbox`` for the model built with flax.linen).
  """
  tokens = jnp.zeros((1, model.config.max_len), jnp.int32)
  key = jax.random.key(seed)
  if mesh is None:
    params = unbox(jax.jit(model.init)(key, tokens)['params'])
    return {'step': jnp.array(0, jnp.int32), 'params': params,
            'opt_state': optimizer.init(params)}, None
  variables, shardings = nn.init_sharded(model, mesh, LOGICAL_RULES)(
      key, tokens)
  params, param_shardings = variables['params'], shardings['params']
  replicated = NamedSharding(mesh, PartitionSpec())
  opt_shardings = optax.tree_map_params(
      optimizer, lambda _, sharding: sharding,
      jax.eval_shape(optimizer.init, params), param_shardings,
      transform_non_params=lambda _: replicated)
  state_shardings = {'step': replicated, 'params': param_shardings,
                     'opt_state': opt_shardings}
  state = {'step': jax.device_put(jnp.array(0, jnp.int32), replicated),
           'params': params,
           'opt_state': jax.jit(optimizer.init,
                                out_shardings=opt_shardings)(params)}
  return state, state_shardings


def make_train_step(model: TransformerLM, optimizer, seed: int, *,
                    state_shardings=None, batch_sharding=None):
  """The jitted ``(state, batch) -> (state, loss)`` update.

  ``state_shardings`` / ``batch_sharding`` (pytrees of
  ``jax.sharding.Sharding`` or None) are handed to ``jax.jit``, so the same
  step runs sharded across devices when they are given.
  """
  dropout_key = jax.random.key(seed + 1)

  def loss_fn(params, batch, key):
    logits = model.apply({'params': params}, batch[:, :-1], train=True,
                         rngs={'dropout': key})
    return cross_entropy(logits, batch[:, 1:])

  # A stack pipelined with a training schedule (1F1B, interleaved 1F1B,
  # zero-bubble) runs its backward pass in its own loop, so the loss and
  # gradients come from nn.pipeline's value_and_grad (the key is a scalar:
  # every microbatch gets it whole).
  pipe = getattr(model.config, 'pipeline', None)
  grad_fn = (nn.pipeline.value_and_grad if getattr(pipe, 'mode', None) in
             nn.pipeline.TRAINED else jax.value_and_grad)(loss_fn)

  def step(state, batch):
    key = jax.random.fold_in(dropout_key, state['step'])
    loss, grads = grad_fn(state['params'], batch, key)
    updates, opt_state = optimizer.update(grads, state['opt_state'],
                                          state['params'])
    params = optax.apply_updates(state['params'], updates)
    return {'step': state['step'] + 1, 'params': params,
            'opt_state': opt_state}, loss

  shardings = {}
  if state_shardings is not None or batch_sharding is not None:
    shardings = dict(in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, None))
  return jax.jit(step, donate_argnums=0, **shardings)


def make_eval_step(model: TransformerLM):
  @jax.jit
  def eval_step(params, batch):
    logits = model.apply({'params': params}, batch[:, :-1])
    return cross_entropy(logits, batch[:, 1:])
  return eval_step


def evaluate(eval_step, params, batches) -> float:
  """Mean held-out loss (each batch a global array when on a mesh)."""
  return float(np.mean([eval_step(params, b) for b in batches]))


# --- sampling with the attention cache --------------------------------------

def generate(model: TransformerLM, params, prompt: np.ndarray, length: int,
             key, temperature: float = 1.0) -> np.ndarray:
  """``length`` tokens starting with ``prompt``, one position per call.

  The model runs with ``decode=True``: each call feeds one token and reads
  and updates the key/value caches in the ``'cache'`` collection.
  """
  length = min(length, model.config.max_len)
  if not 0 < len(prompt) < length:
    raise ValueError(f'prompt of {len(prompt)} tokens must be non-empty and '
                     f'shorter than the sample length {length}')
  decoder = model.clone(decode=True)
  shapes = jax.eval_shape(decoder.init, jax.random.key(0),
                          jnp.zeros((1, model.config.max_len), jnp.int32))
  # On a mesh the cache lives on it too, replicated: with Explicit axes an
  # update is written into it with the cache's own layout.
  mesh = getattr(jax.tree_util.tree_leaves(params)[0].sharding, 'mesh', None)
  place = (NamedSharding(mesh, PartitionSpec())
           if isinstance(mesh, jax.sharding.Mesh) else None)
  cache = jax.tree_util.tree_map(
      lambda s: jnp.zeros(s.shape, s.dtype, device=place), shapes['cache'])
  buf = jnp.zeros((length,), jnp.int32).at[:len(prompt)].set(prompt)
  return np.asarray(_sample(decoder, params, cache, buf, len(prompt), key,
                            temperature))


@functools.partial(jax.jit, static_argnums=(0,))
def _sample(decoder, params, cache, buf, prompt_len, key, temperature):
  def body(carry, t):
    buf, cache = carry
    logits, updated = decoder.apply({'params': params, 'cache': cache},
                                    buf[t][None, None], mutable=['cache'])
    logits = logits[0, -1] / jnp.maximum(temperature, 1e-6)
    sampled = jax.random.categorical(jax.random.fold_in(key, t), logits)
    nxt = jnp.where(t + 1 < prompt_len, buf[t + 1], sampled)
    return (buf.at[t + 1].set(nxt), updated['cache']), None

  (buf, _), _ = jax.lax.scan(body, (buf, cache), jnp.arange(buf.shape[0] - 1))
  return buf


# --- checkpoints -----------------------------------------------------------

def checkpoint_manager(cfg: TrainConfig) -> ocp.CheckpointManager:
  directory = pathlib.Path(cfg.workdir).resolve() / 'checkpoints'
  if not cfg.resume and directory.exists() and is_lead():
    shutil.rmtree(directory)  # a fresh run starts from step 0
  if jax.process_count() > 1:  # all processes see the same directory state
    multihost_utils.sync_global_devices('lm checkpoint directory')
  options = ocp.CheckpointManagerOptions(
      max_to_keep=2, save_interval_steps=cfg.checkpoint_every,
      enable_async_checkpointing=False)
  return ocp.CheckpointManager(directory, options=options)


def restore(manager, state, history):
  """The latest checkpoint's ``(state, history)``, or the given ones."""
  step = manager.latest_step()
  if step is None:
    return state, history
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract),
      history=ocp.args.JsonRestore()))
  history = {k: [tuple(p) for p in v] for k, v in restored['history'].items()}
  return restored['state'], history


def save(manager, step: int, state, history, force: bool = False) -> bool:
  """Saves if ``step`` is on the interval (or ``force``); True if saved."""
  return manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      history=ocp.args.JsonSave(history)), force=force)


# --- the loop --------------------------------------------------------------

def plot_losses(history: dict, path: pathlib.Path, title: str):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
  ax.plot(*zip(*history['train']), label='train', lw=1.2)
  if history['eval']:
    ax.plot(*zip(*history['eval']), 'o-', label='held-out', lw=1.5, ms=4)
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats / byte)')
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path)
  plt.close(fig)


def train(cfg: TrainConfig, log=print) -> dict:
  """Trains (or resumes) per ``cfg``; returns the final state, the loss
  history, timings and a sample."""
  if not is_lead():
    log = lambda *_: None  # pylint: disable=unnecessary-lambda-assignment
  model = TransformerLM(cfg.model)
  optimizer = make_optimizer(cfg)
  train_data, held_data = data.load(max_bytes=cfg.max_bytes)
  log(f'data: {len(train_data):,} training bytes, {len(held_data):,} held-out '
      f'bytes from {len(data.stdlib_files())} standard-library files')
  mesh = make_mesh(cfg)
  state, shardings = init_state(model, optimizer, cfg.seed, mesh)
  if mesh is not None:
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(state['params']))
    local = sum(x.addressable_shards[0].data.nbytes
                for x in jax.tree_util.tree_leaves(state['params']))
    log(f'mesh: {dict(mesh.shape)} over {cfg.devices} {jax.default_backend()} '
        f'devices in {jax.process_count()} process(es); parameters created sharded by nn.init_sharded, '
        f'{local:,} of {total:,} bytes on each device')
  history = {'train': [], 'eval': []}
  manager = checkpoint_manager(cfg)
  if cfg.resume:
    state, history = restore(manager, state, history)
  start = int(state['step'])
  if start:
    log(f'resumed from step {start}')

  batch_sharding = None if mesh is None else NamedSharding(
      mesh, PartitionSpec('data'))
  rows = (slice(None) if batch_sharding is None
          else local_rows(batch_sharding, cfg.batch_size))
  train_step = make_train_step(
      model, optimizer, cfg.seed, state_shardings=shardings,
      batch_sharding=batch_sharding)
  eval_step = make_eval_step(model)
  held = [global_batch(b[rows], batch_sharding, cfg.batch_size)
          for b in data.eval_batches(held_data, cfg.eval_batches,
                                     cfg.batch_size, cfg.seq_len)]
  tokens_per_step = cfg.batch_size * cfg.seq_len
  window, window_start, timed = [], None, (0, 0.0)
  began = time.perf_counter()
  stop = cfg.steps if cfg.stop_at is None else min(cfg.stop_at, cfg.steps)
  bar = tqdm(range(start, stop), initial=start, total=cfg.steps,
             disable=not cfg.progress or not is_lead(), dynamic_ncols=True, desc='train')
  for i in bar:
    rng = np.random.default_rng([cfg.seed, i])
    batch = global_batch(
        data.batch_rows(train_data, rng, cfg.batch_size, cfg.seq_len, rows),
        batch_sharding, cfg.batch_size)
    state, loss = train_step(state, batch)
    window.append(loss)
    step = i + 1
    if cfg.step_file and is_lead():
      report_step(cfg.step_file, step, loss)
    if window_start is None:  # the first step compiles; time from here
      jax.block_until_ready(loss)
      window_start, window = time.perf_counter(), []
      history['train'].append((step, float(loss)))
    elif step % 10 == 0 or step == stop:
      mean = float(np.mean(jax.device_get(window)))
      elapsed = time.perf_counter() - window_start
      timed = (timed[0] + len(window), timed[1] + elapsed)
      history['train'].append((step, mean))
      bar.set_postfix(loss=f'{mean:.3f}',
                      tok_s=f'{len(window) * tokens_per_step / elapsed:,.0f}')
      window, window_start = [], time.perf_counter()
    if step % cfg.eval_every == 0 or step == stop:
      held_loss = evaluate(eval_step, state['params'], held)
      history['eval'].append((step, held_loss))
      if is_lead():
        bar.write(f'step {step}: held-out loss {held_loss:.4f}')
      window_start = time.perf_counter()  # keep evals out of tokens/s
    if save(manager, step, state, history, force=step == stop):
      window_start = time.perf_counter()  # and checkpoints
  bar.close()
  manager.wait_until_finished()
  train_time = time.perf_counter() - began
  tokens_per_s = timed[0] * tokens_per_step / timed[1] if timed[1] else math.nan

  sample = ''
  whole = None
  if cfg.sample_length or cfg.save_params:  # collective: every process
    whole = on_all_processes(state['params'], mesh)
  if cfg.sample_length:
    tokens = generate(model, whole, data.encode(cfg.prompt),
                      cfg.sample_length, jax.random.key(cfg.seed + 2),
                      cfg.temperature)
    sample = data.decode(tokens)
  result = {'state': state, 'history': history, 'tokens_per_s': tokens_per_s,
            'train_time_s': train_time, 'sample': sample}
  if not is_lead():
    return result
  if cfg.save_params:
    flat = jax.tree_util.tree_flatten_with_path(whole)[0]
    np.savez(pathlib.Path(cfg.workdir) / 'params.npz', **{
        jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
  if cfg.plot and history['train']:
    path = pathlib.Path(cfg.workdir) / cfg.plot
    final = history['eval'][-1][1] if history['eval'] else math.nan
    plot_losses(history, path, f'byte-level LM on the Python stdlib: '
                f'{stop} steps, held-out {final:.3f}')
    result['plot'] = str(path)
  (pathlib.Path(cfg.workdir) / 'summary.json').write_text(json.dumps(
      {k: result[k] for k in ('tokens_per_s', 'train_time_s', 'sample')}
      | {'history': history}, indent=1))
  return result
