"""Pipelined ``nn.Stack`` on 8 simulated CPU devices, against the
unpipelined stack with the same parameters.

Not collected by the main run (the name does not start with ``test_``):
``test_pipeline.py`` runs it in a fresh process, because the device count
is fixed when JAX starts. By hand: ``python -m pytest
tests/pipeline/pipeline_cases.py``.

Tolerances. Every row goes through the same operations as in the
unpipelined stack, but XLA compiles them differently inside the schedule's
loop and for another row count (how a product is blocked, what is fused),
which moves the last bit: at 32 rows the largest output difference seen is
2.4e-7 (about 2 ulp of the outputs' scale). Outputs are therefore compared
within OUT_RTOL = 1e-6 of their largest entry. Parameter gradients also sum
the per-row contributions in another order (per microbatch, then over
microbatches) and are compared within GRAD_RTOL = 1e-5 of each gradient's
largest entry. The tests that compare against the unpipelined stack run
microbatch by microbatch (gradients summed in the pipeline's order, dropout,
initial values) do the same arithmetic in the same order, but in other
compiled programs, whose last bit depends on the CPU (bitwise on AVX-512,
not promised elsewhere): they compare within OUT_RTOL of each leaf's
largest entry (``assert_same_arithmetic``).
"""
import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8')

import dataclasses  # pylint: disable=g-import-not-at-top
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import liftmods as nn
from benchmarks.pipeline import Annotated  # kernel, bias annotated or not
from liftmods import errors

if jax.device_count() < 8:
  pytest.skip('needs 8 devices: JAX was started before XLA_FLAGS was set '
              '(run this file in its own process)', allow_module_level=True)

WIDTH = 8
OUT_RTOL = 1e-6
GRAD_RTOL = 1e-5


class Block(nn.Module):
  """Normalizes without an epsilon: an all-zero input (what a zero-filled
  idle slot would hold) gives NaN in the output and the gradients."""

  @nn.compact
  def __call__(self, x):
    unit = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return x + jnp.tanh(nn.Dense(x.shape[-1])(unit))


class Counted(nn.Module):
  """Counts its calls in a mutable collection."""

  @nn.compact
  def __call__(self, x):
    calls = self.variable('counts', 'calls', lambda: jnp.zeros((), jnp.int32))
    calls.value += 1
    return x + nn.Dense(x.shape[-1])(x)


class Dropped(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + nn.Dropout(0.5, deterministic=False)(nn.Dense(x.shape[-1])(x))


def mesh_of(stages, data):
  devices = jax.devices()[:stages * data]
  if data > 1:
    return jax.make_mesh((stages, data), ('stage', 'data'),
                         axis_types=(AxisType.Auto,) * 2, devices=devices)
  return jax.make_mesh((stages,), ('stage',), axis_types=(AxisType.Auto,),
                       devices=devices)


def init(module, x):
  return jax.jit(module.init)(jax.random.key(0), x)


def leaves(tree):
  return jax.tree_util.tree_leaves(tree)


def assert_same_arithmetic(a, b):
  """Equal to float32 rounding: within OUT_RTOL (about 8 ulps) of each
  leaf's largest entry. For two programs doing the same operations in the
  same order: they still compile to other per-device programs (the
  schedule's loop, another row count, a sharded init), whose last bit XLA:CPU
  may round otherwise on another CPU (bitwise on AVX-512 is no promise)."""
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(leaves(a), leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(x, y, rtol=0,
                               atol=OUT_RTOL * np.abs(y).max())


def assert_grads_close(a, b, scale=None):
  """Equal within GRAD_RTOL of ``scale`` (default: each leaf's largest
  entry)."""
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(leaves(a), leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert np.isfinite(x).all()
    np.testing.assert_allclose(
        x, y, rtol=0, atol=GRAD_RTOL * (np.abs(y).max() if scale is None
                                        else scale))


def batch(rows, seed=1):
  return jax.random.normal(jax.random.key(seed), (rows, WIDTH))


def value_and_grads(module):
  """``(v, x) -> ((sum(y ** 2), y), (d/dv, d/dx))``, compiled."""
  def loss(v, x):
    y = module.apply(v, x)
    return jnp.sum(y ** 2), y
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def outputs_and_grads(module, variables, x):
  (_, y), grads = value_and_grads(module)(variables, x)
  return y, grads


REFERENCES = {}  # layers -> the unpipelined stack's compiled step


def reference(length, variables, x):
  """The unpipelined stack (no policy: a policy changes what is kept,
  not the values), compiled once per depth."""
  if length not in REFERENCES:
    REFERENCES[length] = value_and_grads(nn.Stack(Block, length)())
  (_, y), grads = REFERENCES[length](variables, x)
  return y, grads


# stages, microbatches, repeats, data-axis size, policy
# The first four cover S in {2, 4}, R in {1, 2}, a data axis and a policy;
# the rest (marked) run in a second process beside the first
# (test_pipeline.py).
_MORE = pytest.mark.integration
MATRIX = [
    (2, 2, 1, 1, None),
    (2, 4, 1, 4, 'full'),
    (4, 4, 1, 2, None),
    (4, 4, 2, 1, None),
    pytest.param(2, 2, 2, 4, None, marks=_MORE),
    pytest.param(2, 4, 2, 1, 'full', marks=_MORE),
    pytest.param(4, 8, 1, 1, 'full', marks=_MORE),
    pytest.param(4, 8, 2, 2, 'full', marks=_MORE),
]


@pytest.mark.parametrize('stages,micro,repeats,data,policy', MATRIX)
def test_outputs_and_gradients_match_unpipelined(stages, micro, repeats, data,
                                                 policy):
  length = 2 * stages * repeats
  pipe = nn.Pipeline(stages=stages, microbatches=micro, repeats=repeats)
  pipelined = nn.Stack(Block, length, policy=policy, pipeline=pipe)()
  plain = nn.Stack(Block, length, policy=policy)()
  x = batch(32)  # one batch size for all: the references compile once
  v_plain = init(plain, x)
  v_pipe = init(pipelined, x)
  # Initial parameters are the unpipelined ones, in stage-major order.
  assert_same_arithmetic(v_pipe, pipe.to_pipeline_layout(v_plain))
  assert_same_arithmetic(pipe.to_stack_layout(v_pipe), v_plain)

  with jax.set_mesh(mesh_of(stages, data)):
    y, (gv, gx) = outputs_and_grads(pipelined, v_pipe, x)
  y_plain, (rv, rx) = reference(length, v_plain, x)
  # Within float32 rounding (see the module docstring).
  np.testing.assert_allclose(y, y_plain, rtol=0,
                             atol=OUT_RTOL * np.abs(y_plain).max())
  assert_grads_close(gv, pipe.to_pipeline_layout(rv))
  assert_grads_close(gx, rx)


def test_gradients_match_the_microbatch_loop():
  """The reference runs the unpipelined stack on each microbatch and adds
  the gradients last microbatch first, as the pipeline's backward loop
  does: then nothing differs in the arithmetic, only in how it compiles."""
  pipe = nn.Pipeline(stages=2, microbatches=4)
  pipelined = nn.Stack(Block, 4, pipeline=pipe)()
  plain = nn.Stack(Block, 4)()
  x = batch(16)
  v = init(plain, x)
  loss = lambda m: lambda v, x: jnp.sum(m.apply(v, x) ** 2)
  with jax.set_mesh(mesh_of(2, 1)):
    g = jax.jit(jax.grad(loss(pipelined)))(v, x)
  step = jax.jit(jax.grad(loss(plain)))
  total = None
  for m in reversed(range(4)):
    g_m = step(v, x[m::4])
    total = g_m if total is None else jax.tree_util.tree_map(
        jnp.add, total, g_m)
  assert_same_arithmetic(g, total)


def test_idle_iterations_do_not_leak_and_counters_count_microbatches():
  pipe = nn.Pipeline(stages=4, microbatches=8, repeats=2,
                     per_microbatch=('counts',))
  pipelined = nn.Stack(Counted, 16, pipeline=pipe)()
  plain = nn.Stack(Counted, 16)()
  x = batch(16)
  v = init(pipelined, x)
  assert (v['counts']['calls'] == 1).all()  # init runs each layer once
  with jax.set_mesh(mesh_of(4, 1)):
    y, updated = jax.jit(
        lambda v, x: pipelined.apply(v, x, mutable=['counts']))(v, x)
  # Once per microbatch and layer: never on the 4 - 1 idle iterations.
  np.testing.assert_array_equal(updated['counts']['calls'],
                                np.full(16, 1 + 8))
  y_plain, _ = jax.jit(lambda v, x: plain.apply(v, x, mutable=['counts']))(
      pipe.to_stack_layout(v), x)
  # 2-row microbatches against the 16-row batch: whether XLA:CPU picks the
  # same product kernel for both depends on the CPU (bitwise on some, 3e-6
  # relative on others); the tolerance is float32 rounding over 16 layers.
  np.testing.assert_allclose(y, y_plain, rtol=2e-5, atol=1e-5)


def test_dropout_draws_the_unpipelined_keys_per_microbatch():
  """Each layer draws the key the unpipelined stack gives that layer; a
  microbatch sees exactly what the unpipelined stack does on that
  microbatch alone."""
  pipe = nn.Pipeline(stages=2, microbatches=4, repeats=2)
  pipelined = nn.Stack(Dropped, 8, pipeline=pipe)()
  plain = nn.Stack(Dropped, 8)()
  x = batch(16)
  v_plain = init(plain, x)
  v_pipe = pipe.to_pipeline_layout(v_plain)
  rngs = {'dropout': jax.random.key(7)}
  def loss(v):
    y = pipelined.apply(v, x, rngs=rngs)
    return y.sum(), y
  with jax.set_mesh(mesh_of(2, 4)):
    (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(v_pipe)
  apply = jax.jit(lambda v, x, key: plain.apply(v, x, rngs={'dropout': key}))
  grad = jax.jit(jax.grad(lambda v, x: apply(v, x, rngs['dropout']).sum()))
  for m in range(4):
    assert_same_arithmetic(y[m::4], apply(v_plain, x[m::4], rngs['dropout']))
  # dropout is active: another key, other masks
  assert not np.allclose(y[:4], apply(v_plain, x[:4], jax.random.key(8)))
  total = None
  for m in reversed(range(4)):
    g_m = grad(v_plain, x[m::4])
    total = g_m if total is None else jax.tree_util.tree_map(
        jnp.add, total, g_m)
  assert_grads_close(g, pipe.to_pipeline_layout(total))


def test_remat_iterations_matches_and_excludes_a_stack_policy():
  pipe = nn.Pipeline(stages=2, microbatches=2, remat_iterations=True)
  pipelined = nn.Stack(Block, 4, pipeline=pipe)()
  x = batch(32)
  v = init(nn.Stack(Block, 4)(), x)
  with jax.set_mesh(mesh_of(2, 1)):
    y, (g, gx) = outputs_and_grads(pipelined, v, x)
  y_plain, (rv, rx) = reference(4, v, x)
  np.testing.assert_allclose(y, y_plain, rtol=0,
                             atol=OUT_RTOL * np.abs(y_plain).max())
  assert_grads_close((g, gx), (rv, rx))
  with pytest.raises(ValueError, match='recompute every layer twice'):
    nn.Stack(Block, 4, policy='full', pipeline=pipe)


def collectives(hlo_text):
  ops = ('collective-permute', 'all-gather', 'all-reduce', 'all-to-all',
         'reduce-scatter')
  return {op: len(re.findall(rf'\s{op}(?:-start)?\(', hlo_text))
          for op in ops}


def test_compiled_step_holds_one_stage_of_params_and_permutes():
  stages = 4
  pipe = nn.Pipeline(stages=stages, microbatches=8)
  pipelined = nn.Stack(Block, 8, pipeline=pipe)()
  x = jnp.ones((16, 64))
  mesh = mesh_of(stages, 1)
  variables = init(pipelined, x)
  total = sum(a.nbytes for a in leaves(variables))
  sharded = jax.device_put(
      variables, jax.sharding.NamedSharding(mesh, jax.P('stage')))
  with jax.set_mesh(mesh):
    step = jax.jit(jax.grad(lambda v, x: jnp.sum(pipelined.apply(v, x))))
    compiled = step.lower(sharded, x).compile()
  memory = compiled.memory_analysis()
  assert memory.argument_size_in_bytes == total // stages + x.nbytes
  # The gradients: one stage's share (plus a few bytes of tuple header).
  assert 0 <= memory.output_size_in_bytes - total // stages < 256
  counts = collectives(compiled.as_text())
  # Activations move around the ring of stages; nothing is gathered.
  assert counts['collective-permute'] >= 2, counts  # forward and backward
  assert counts['all-gather'] == counts['all-to-all'] == 0, counts
  assert re.search(r'source_target_pairs=\{\{0,1\},\{1,2\},\{2,3\},\{3,0\}\}',
                   compiled.as_text())


def test_init_sharded_puts_each_stage_on_its_devices():
  class Wide(nn.Module):

    @nn.compact
    def __call__(self, x):
      init = nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                          ('embed', 'mlp'))
      return x + nn.Dense(x.shape[-1], kernel_init=init)(x)

  pipe = nn.Pipeline(stages=4, microbatches=4, repeats=2)
  pipelined = nn.Stack(Wide, 16, pipeline=pipe)()
  x = batch(8)
  mesh = mesh_of(4, 2)
  rules = (('layers', 'stage'), ('mlp', 'data'), ('embed', None))
  variables, shardings = nn.init_sharded(pipelined, mesh, rules)(
      jax.random.key(0), x)
  kernel = variables['params']['Dense_0']['kernel']
  assert shardings['params']['Dense_0']['kernel'].spec == jax.P(
      'stage', None, 'data')
  plain = nn.unbox(init(nn.Stack(Wide, 16)(), x))
  expected = np.asarray(pipe.to_pipeline_layout(plain)['params']['Dense_0'][
      'kernel'])
  # Bit for bit on jax 0.10; jaxlib 0.12 rounds the float arithmetic of the
  # sharded init program apart from the one-device one in the last bit (43
  # of 1024 entries, at most 1.2e-7 apart).
  np.testing.assert_allclose(kernel, expected, rtol=1e-6, atol=0)
  stage_of = {d: i for i, row in enumerate(mesh.devices) for d in row}
  for shard in kernel.addressable_shards:
    stage = stage_of[shard.device]
    layers = shard.index[0]
    assert (layers.start, layers.stop) == (4 * stage, 4 * stage + 4)
    # stage s holds layers (r * 4 + s) * 2 + l of the unpipelined stack
    natural = [(r * 4 + stage) * 2 + l for r in range(2) for l in range(2)]
    # (jaxlib 0.12's sharded init rounds apart in the last bit, as above.)
    np.testing.assert_allclose(
        np.asarray(shard.data), np.asarray(plain['params']['Dense_0'][
            'kernel'])[natural][:, :, shard.index[2]], rtol=1e-6, atol=0)
  with jax.set_mesh(mesh):
    y = jax.jit(pipelined.apply)({'params': variables['params']}, x)
  # Here the kernels' 'mlp' dimension is split over 'data', so each layer's
  # product is summed in two halves and all-reduced: the same arithmetic as
  # the one-device stack up to float32 rounding (seen: 3.3e-6 relative).
  np.testing.assert_allclose(y, jax.jit(nn.Stack(Wide, 16)().apply)(plain, x),
                             rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize('annotate', ['both', 'kernel', 'none'])
def test_every_stack_variable_lives_on_its_stage(annotate):
  """Annotated or not, init_sharded puts each layer's variables on its
  stage only: the compiled step's arguments per device are 1/S of the
  stack's."""
  stages = 4
  pipe = nn.Pipeline(stages=stages, microbatches=4)
  pipelined = nn.Stack(Annotated, 8, pipeline=pipe)(annotate)
  x = jnp.ones((8, 32))
  mesh = mesh_of(stages, 1)
  rules = (('layers', 'stage'), ('embed', None), ('mlp', None))
  variables, shardings = nn.init_sharded(
      pipelined, mesh, rules, warn_unmapped=False)(jax.random.key(0), x)
  params = shardings['params']['Dense_0']
  assert params['kernel'].spec == jax.P('stage', None, None)
  assert params['bias'].spec == jax.P('stage', None)
  total = sum(a.nbytes for a in leaves(variables))
  assert total == 8 * (32 * 32 + 32) * 4
  for leaf in leaves(variables):
    for shard in leaf.addressable_shards:
      assert shard.data.shape[0] == 8 // stages
  with jax.set_mesh(mesh):
    step = jax.jit(jax.grad(lambda v, x: jnp.sum(pipelined.apply(v, x))),
                   in_shardings=(shardings, None))
    compiled = step.lower(variables, x).compile()
  memory = compiled.memory_analysis()
  assert memory.argument_size_in_bytes == total // stages + x.nbytes
  # The values are the unpipelined stack's (repeats=1: the same layout).
  plain = nn.unbox(init(nn.Stack(Annotated, 8)(annotate), x))
  assert_same_arithmetic(variables, plain)


def test_init_sharded_rejects_a_stage_axis_the_annotations_misuse():
  pipe = nn.Pipeline(stages=4, microbatches=4)
  pipelined = nn.Stack(Annotated, 8, pipeline=pipe)('kernel')
  x = jnp.ones((8, 32))
  mesh = mesh_of(4, 2)
  with pytest.raises(
      nn.PipelineError,
      match=r'Variable "kernel" of collection "params" at /Dense_0 belongs '
      r"to a stack pipelined over mesh axis 'stage', but its annotations "
      r"place its layer axis on 'data'"):
    nn.init_sharded(pipelined, mesh, (('layers', 'data'),),
                    warn_unmapped=False)(jax.random.key(0), x)
  with pytest.raises(
      nn.PipelineError,
      match=r"also shard dimension 2 over 'stage' \(spec "
      r"P\(None, None, 'stage'\)\)"):
    nn.init_sharded(pipelined, mesh, (('mlp', 'stage'),),
                    warn_unmapped=False)(jax.random.key(0), x)


def test_errors_name_the_problem():
  with pytest.raises(nn.PipelineError, match=r'divisible by stages·repeats = 8'):
    nn.Stack(Block, 12, pipeline=nn.Pipeline(stages=4, microbatches=4,
                                              repeats=2))
  with pytest.raises(ValueError, match='at least as many microbatches'):
    nn.Pipeline(stages=4, microbatches=2, repeats=2)
  pipe = nn.Pipeline(stages=2, microbatches=4)
  stack = nn.Stack(Block, 4, pipeline=pipe)(name='blocks')
  x = batch(8)
  v = init(stack, x)
  with jax.set_mesh(mesh_of(2, 1)):
    with pytest.raises(nn.PipelineError,
                       match=r'Stack at /:.*divisible by microbatches=4; '
                       r'got a carry of shape \(6, 8\)'):
      stack.apply(v, batch(6))
  with jax.set_mesh(jax.make_mesh((2, 4), ('pipe', 'data'),
                                  axis_types=(AxisType.Auto,) * 2)):
    with pytest.raises(nn.PipelineError,
                       match=r"mesh axis 'stage', but the mesh has axes "
                       r"\('pipe', 'data'\)"):
      stack.apply(v, x)
  with jax.set_mesh(mesh_of(4, 1)):
    with pytest.raises(nn.PipelineError, match="'stage' has 4 devices, but "
                       'the pipeline has stages=2'):
      stack.apply(v, x)

  class Widens(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(x.shape[-1] + 1)(x)

  widens = nn.Stack(Widens, 4, pipeline=pipe)(name='blocks')
  with jax.set_mesh(mesh_of(2, 1)):
    with pytest.raises(errors.StackError,
                       match=r'Stack at /: Widens.__call__ returned a '
                       r'carry of .*\(8, 9\).*received.*\(8, 8\)'):
      widens.init(jax.random.key(0), x)

  counted = nn.Stack(Counted, 4, pipeline=pipe)(name='blocks')
  vc = init(counted, x)
  with jax.set_mesh(mesh_of(2, 1)):
    with pytest.raises(nn.PipelineError,
                       match=r"Stack at /: collection 'counts' is "
                       r'mutable.*per_microbatch='):
      counted.apply(vc, x, mutable=['counts'])
  with pytest.raises(errors.StackError, match='stack.scan has no pipelined'):
    stack.apply(v, x, method='scan')


class Sows(nn.Module):

  @nn.compact
  def __call__(self, x):
    self.sow('intermediates', 'h', x)
    return x + nn.Dense(x.shape[-1])(x)


def test_sown_intermediates_are_refused_naming_the_variable():
  """A pipelined stack cannot collect what its blocks sow (they would
  create variables inside the loop); the error named tree structures
  (PyTreeDef(...)), now the variable and the collection not to make
  mutable. Unmutable, sow is a no-op and the stack runs."""
  pipe = nn.Pipeline(stages=2, microbatches=2)
  stack = nn.Stack(Sows, 4, pipeline=pipe)(name='blocks')
  x = batch(8)
  v = init(stack, x)
  with jax.set_mesh(mesh_of(2, 1)):
    with pytest.raises(nn.PipelineError, match=re.escape(
        "Stack at /: the blocks created ['intermediates']['h'][0], which "
        'the stack does not hold;') + '.*' + re.escape(
            "do not make 'intermediates' mutable here.")):
      stack.apply(v, x, mutable=['intermediates'])
    y = jax.jit(stack.apply)(v, x)
  np.testing.assert_allclose(
      y, nn.Stack(Sows, 4)().apply(v, x), rtol=0,
      atol=OUT_RTOL * np.abs(y).max())


class Model(nn.Module):
  """An input layer, a pipelined stack of ``block``s, an output layer: the
  1F1B schedule must give every one of them its gradients."""
  block: type
  length: int
  pipeline: nn.Pipeline | None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    x = nn.Stack(self.block, self.length, pipeline=self.pipeline)(
        name='blocks')(x)
    return nn.Dense(3)(x)


def model_loss(model):
  def loss_fn(params, x, target):
    return jnp.mean((model.apply({'params': params}, x) - target) ** 2)
  return loss_fn


def model_batch(rows, seed=1):
  x = jax.random.normal(jax.random.key(seed), (rows, 5))
  return x, jax.random.normal(jax.random.key(seed + 1), (rows, 3))


def one_f_one_b(stages, micro, block=Block, length=None, mode='1f1b',
                **options):
  pipe = nn.Pipeline(stages=stages, microbatches=micro, mode=mode,
                     **options)
  return Model(block, length or 2 * stages, pipe), pipe


def unpipelined(length):
  """The unpipelined model of ``length`` blocks, a batch ``(x, target)``,
  its params and the loss's value and gradients on them."""
  plain = Model(Block, length, None)
  x, target = model_batch(32)
  params = init(plain, x)['params']
  value = jax.jit(jax.value_and_grad(model_loss(plain)))(params, x, target)
  return plain, (x, target), params, value


@pytest.mark.parametrize('stages,micro,data', [
    (2, 2, 1), (4, 4, 2), pytest.param(4, 8, 1, marks=_MORE)])
def test_1f1b_matches_unpipelined_and_gpipe(stages, micro, data):
  """Loss and the gradients of every layer (before, in and after the
  stack). Block gives NaN on the all-zero input an idle slot holds, and
  what arrives before real work is NaN: any leak would show."""
  model, pipe = one_f_one_b(stages, micro)
  gpipe = Model(Block, 2 * stages, dataclasses.replace(pipe, mode='gpipe'))
  plain, (x, target), params, (loss_ref, grads_ref) = unpipelined(
      2 * stages)
  with jax.set_mesh(mesh_of(stages, data)):
    loss, grads = jax.jit(nn.pipeline.value_and_grad(model_loss(model)))(
        params, x, target)
    loss_g, grads_g = jax.jit(jax.value_and_grad(model_loss(gpipe)))(
        params, x, target)
    # Outside value_and_grad the stack runs the GPipe forward loop.
    y = jax.jit(model.apply)({'params': params}, x)
  assert sorted(grads) == ['Dense_0', 'Dense_1', 'blocks']
  np.testing.assert_allclose(loss, loss_ref, rtol=OUT_RTOL)
  assert_grads_close(grads, grads_ref)
  assert_grads_close(grads, grads_g)
  np.testing.assert_allclose(loss, loss_g, rtol=OUT_RTOL)
  y_ref = plain.apply({'params': params}, x)
  np.testing.assert_allclose(y, y_ref, rtol=0,
                             atol=OUT_RTOL * np.abs(y_ref).max())


def test_1f1b_against_microbatch_loop():
  """The reference runs the unpipelined model on each microbatch, in
  order, and adds loss / M and gradients as the 1F1B loop does. The
  arithmetic still differs in the last bits (the loop's backward pass is
  a vjp recomputed from the stage input, compiled inside the loop), so the
  check is a few ulp of each gradient's largest entry: 10x tighter than
  against the whole-batch model."""
  model, _ = one_f_one_b(2, 4)
  plain = Model(Block, 4, None)
  x, target = model_batch(16)
  params = init(plain, x)['params']
  with jax.set_mesh(mesh_of(2, 1)):
    loss, grads = jax.jit(nn.pipeline.value_and_grad(model_loss(model)))(
        params, x, target)
  step = jax.jit(jax.value_and_grad(
      lambda p, x, t: model_loss(plain)(p, x, t) / 4))
  total_loss, total = step(params, x[0::4], target[0::4])
  for m in range(1, 4):
    loss_m, g_m = step(params, x[m::4], target[m::4])
    total_loss = total_loss + loss_m
    total = jax.tree_util.tree_map(jnp.add, total, g_m)
  np.testing.assert_allclose(loss, total_loss, rtol=1e-6)
  assert jax.tree_util.tree_structure(grads) == (
      jax.tree_util.tree_structure(total))
  for got, want in zip(leaves(grads), leaves(total)):
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=1e-6 * np.abs(want).max())


def test_1f1b_dropout_uses_the_gpipe_keys():
  model, pipe = one_f_one_b(2, 4, block=Dropped)
  gpipe = Model(Dropped, 4, dataclasses.replace(pipe, mode='gpipe'))
  x, target = model_batch(16)
  params = init(Model(Dropped, 4, None), x)['params']

  def loss_of(model, key):
    def loss_fn(params, x, target):
      y = model.apply({'params': params}, x, rngs={'dropout': key})
      return jnp.mean((y - target) ** 2)
    return loss_fn

  key = jax.random.key(7)
  with jax.set_mesh(mesh_of(2, 1)):
    run = lambda grad, model, key: jax.jit(grad(loss_of(model, key)))(
        params, x, target)
    loss, grads = run(nn.pipeline.value_and_grad, model, key)
    loss_g, grads_g = run(jax.value_and_grad, gpipe, key)
    other, _ = run(nn.pipeline.value_and_grad, model, jax.random.key(8))
  np.testing.assert_allclose(loss, loss_g, rtol=OUT_RTOL)
  assert_grads_close(grads, grads_g)
  assert abs(float(other) - float(loss)) > 1e-3  # dropout is active


def test_1f1b_counts_each_microbatch_once_and_returns_aux():
  model, pipe = one_f_one_b(4, 8, block=Counted, length=8,
                            per_microbatch=('counts',))
  x, target = model_batch(16)
  variables = init(model, x)
  assert (variables['counts']['blocks']['calls'] == 1).all()

  def loss_fn(params, x, target):
    y, updated = model.apply({'params': params,
                              'counts': variables['counts']}, x,
                             mutable=['counts'])
    return jnp.mean((y - target) ** 2), (updated, y)

  plain = Model(Counted, 8, None)
  with jax.set_mesh(mesh_of(4, 1)):
    (loss, (updated, y)), grads = jax.jit(nn.pipeline.value_and_grad(
        loss_fn, has_aux=True))(variables['params'], x, target)
  # Once per microbatch and layer, never on an idle iteration.
  np.testing.assert_array_equal(updated['counts']['blocks']['calls'],
                                np.full(8, 1 + 8))
  # aux comes from loss_fn on the whole batch, with the loop's outputs.
  y_plain, _ = plain.apply(variables, x, mutable=['counts'])
  np.testing.assert_allclose(y, y_plain, rtol=2e-5, atol=1e-5)
  np.testing.assert_allclose(loss, jnp.mean((y_plain - target) ** 2),
                             rtol=1e-5)
  assert all(np.isfinite(g).all() for g in leaves(grads))


@pytest.mark.integration
def test_1f1b_activation_memory_does_not_grow_with_microbatches():
  """At a fixed microbatch size, GPipe's train step keeps every
  iteration's activations (temp grows with M); 1F1B keeps at most 2S - 1
  stage inputs. The stack's parameters stay on their stage (no
  all-gather)."""
  def temp(mode, micro):
    pipe = nn.Pipeline(stages=2, microbatches=micro, mode=mode)
    model = Model(Block, 4, pipe)
    x, target = model_batch(4 * micro)
    params = init(Model(Block, 4, None), x)['params']
    grad = (nn.pipeline.value_and_grad if mode == '1f1b' else
            jax.value_and_grad)(model_loss(model))
    with jax.set_mesh(mesh_of(2, 1)):
      compiled = jax.jit(grad).lower(params, x, target).compile()
    counts = collectives(compiled.as_text())
    assert counts['all-gather'] == 0, counts
    return compiled.memory_analysis().temp_size_in_bytes

  gpipe = [temp('gpipe', m) for m in (4, 32)]
  ours = [temp('1f1b', m) for m in (4, 32)]
  assert gpipe[1] > 2 * gpipe[0], gpipe
  assert ours[1] <= 1.1 * ours[0], ours


class TwoStacks(nn.Module):
  pipeline: nn.Pipeline

  @nn.compact
  def __call__(self, x):
    x = nn.Stack(Block, 2, pipeline=self.pipeline)(name='a')(x)
    return nn.Stack(Block, 2, pipeline=self.pipeline)(name='b')(x)


def test_1f1b_errors_name_the_problem():
  with pytest.raises(ValueError, match='remat_iterations applies to'):
    nn.Pipeline(stages=2, microbatches=2, remat_iterations=True,
                mode='1f1b')
  with pytest.raises(ValueError, match=r"Pipeline.mode must be one of "
                     r"'gpipe', '1f1b', 'zero_bubble'; got '1F1B'"):
    nn.Pipeline(stages=2, microbatches=2, mode='1F1B')
  x, target = model_batch(8)
  plain = Model(Block, 4, None)
  params = init(plain, x)['params']
  with pytest.raises(nn.PipelineError, match=r"loss_fn called no stack with "
                     r"Pipeline\(mode='1f1b'\)"):
    nn.pipeline.value_and_grad(model_loss(plain))(params, x, target)
  model, _ = one_f_one_b(2, 4)

  def casts(params, x, target):
    params = jax.tree_util.tree_map(lambda p: p * 1.0, params)
    return model_loss(model)(params, x, target)

  with jax.set_mesh(mesh_of(2, 1)):
    with pytest.raises(nn.PipelineError, match=r"Stack at /blocks: "
                       r"pipeline.value_and_grad cannot find the stack's "
                       r'variables in the params given to loss_fn'):
      nn.pipeline.value_and_grad(casts)(params, x, target)
    with pytest.raises(nn.PipelineError, match=r'divisible by '
                       r'microbatches=4; got a carry of shape \(6, 8\)'):
      nn.pipeline.value_and_grad(model_loss(model))(params, *model_batch(6))
    two = TwoStacks(nn.Pipeline(stages=2, microbatches=4, mode='1f1b'))
    v2 = init(two, x)['params']
    with pytest.raises(nn.PipelineError, match=r"loss_fn calls two stacks "
                       r"with Pipeline\(mode='1f1b'\), at /a and /b; it "
                       r'runs exactly one'):
      nn.pipeline.value_and_grad(
          lambda p, x: jnp.mean(two.apply({'params': p}, x) ** 2))(v2, x)
    with pytest.raises(nn.PipelineError, match=r'split into microbatches='
                       r'M=4 along its leading \(batch\) axis; got one of '
                       r'shape \(6, 3\)'):
      nn.pipeline.value_and_grad(model_loss(model))(params, x,
                                                    target[:6])


@pytest.mark.integration
@pytest.mark.parametrize('mode', ['gpipe', '1f1b'])
def test_lm_train_step_pipelined_over_four_stages(mode):
  from examples.lm import model as lm  # pylint: disable=g-import-not-at-top
  from examples.lm import train as lm_train  # pylint: disable=g-import-not-at-top
  config = lm.Config(max_len=8, num_layers=4, num_heads=2, d_model=16,
                     mlp_ratio=2, dropout_rate=0.0)
  pipe = nn.Pipeline(stages=4, microbatches=4, mode=mode)
  plain = lm.TransformerLM(config)
  pipelined = lm.TransformerLM(dataclasses.replace(config, pipeline=pipe))
  tokens = (jnp.arange(8 * 9, dtype=jnp.int32).reshape(8, 9) * 7) % 256
  # (repeats=1: the pipelined stack stores the unpipelined layout as is;
  # init equality is checked above.)
  params = nn.unbox(init(plain, tokens[:, :-1]))['params']
  params_pipe = params
  # Plain SGD: Adam would turn the key bias's rounding-level gradients
  # (exactly zero in exact arithmetic) into full-size steps of either sign.
  optimizer = optax.sgd(0.1)

  def train_step(model):
    def loss_fn(params, tokens):
      logits = model.apply({'params': params}, tokens[:, :-1], train=True)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens[:, 1:]).mean()

    grad_fn = (nn.pipeline.value_and_grad if model.config.pipeline and
               model.config.pipeline.mode == '1f1b' else jax.value_and_grad)

    @jax.jit
    def step(params, opt_state):
      loss, grads = grad_fn(loss_fn)(params, tokens)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), loss, grads
    return step

  new, loss, grads = train_step(plain)(params, optimizer.init(params))
  with jax.set_mesh(mesh_of(4, 1)):
    new_p, loss_p, grads_p = train_step(pipelined)(
        params_pipe, optimizer.init(params_pipe))
  to_stack = lambda t: {**t, 'blocks': pipe.to_stack_layout(t['blocks'])}
  np.testing.assert_allclose(loss_p, loss, rtol=1e-6)
  # Relative to the largest gradient: the attention key bias has a zero
  # gradient up to rounding (softmax ignores a shift shared by all keys).
  assert_grads_close(to_stack(grads_p), grads,
                     scale=max(np.abs(g).max() for g in leaves(grads)))
  for a, b in zip(leaves(to_stack(new_p)), leaves(new)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)
  # The demo's own train step picks the schedule from the config.
  lm_step = lambda model: lm_train.make_train_step(model, optimizer, 0)
  # (a fresh copy each time: the step donates its state)
  state = lambda: jax.tree_util.tree_map(jnp.copy, {
      'step': jnp.array(0, jnp.int32), 'params': params,
      'opt_state': optimizer.init(params)})
  demo, demo_loss = lm_step(plain)(state(), tokens)
  with jax.set_mesh(mesh_of(4, 1)):
    demo_p, demo_loss_p = lm_step(pipelined)(state(), tokens)
  np.testing.assert_allclose(demo_loss_p, demo_loss, rtol=1e-6)
  for a, b in zip(leaves(demo_p['params']), leaves(demo['params'])):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)


def to_pipeline(pipe, params):
  """The unpipelined model's params with the stack's in stored order."""
  return {**params, 'blocks': pipe.to_pipeline_layout(params['blocks'])}


@pytest.mark.parametrize('mode,stages,micro,repeats,data', [
    ('1f1b', 2, 2, 2, 1), ('1f1b', 4, 4, 2, 2), ('zero_bubble', 2, 4, 1, 1),
    ('zero_bubble', 4, 4, 2, 1),
    pytest.param('1f1b', 4, 8, 3, 1, marks=_MORE),
    pytest.param('zero_bubble', 4, 8, 1, 2, marks=_MORE)])
def test_interleaved_and_zero_bubble_match_unpipelined(mode, stages, micro,
                                                       repeats, data):
  """Interleaved 1F1B (repeats chunks per stage) and zero-bubble: the loss
  and every gradient equal the unpipelined model's to float32 rounding
  (Block gives NaN on what an idle slot holds)."""
  length = 2 * stages * repeats
  model, pipe = one_f_one_b(stages, micro, length=length, mode=mode,
                            repeats=repeats)
  _, (x, target), params, (loss_ref, grads_ref) = unpipelined(length)
  with jax.set_mesh(mesh_of(stages, data)):
    loss, grads = jax.jit(nn.pipeline.value_and_grad(model_loss(model)))(
        to_pipeline(pipe, params), x, target)
  np.testing.assert_allclose(loss, loss_ref, rtol=OUT_RTOL)
  assert_grads_close(grads, to_pipeline(pipe, grads_ref))


def test_zero_bubble_counts_each_microbatch_once_and_uses_gpipe_keys():
  model, pipe = one_f_one_b(2, 4, block=Counted, length=8,
                            mode='zero_bubble', repeats=2,
                            per_microbatch=('counts',))
  x, target = model_batch(16)
  variables = init(model, x)

  def loss_fn(params, x, target):
    y, updated = model.apply({'params': params,
                              'counts': variables['counts']}, x,
                             mutable=['counts'])
    return jnp.mean((y - target) ** 2), updated

  with jax.set_mesh(mesh_of(2, 1)):
    (_, updated), _ = jax.jit(nn.pipeline.value_and_grad(
        loss_fn, has_aux=True))(variables['params'], x, target)
  np.testing.assert_array_equal(updated['counts']['blocks']['calls'],
                                np.full(8, 1 + 4))
  zb, pipe = one_f_one_b(2, 4, block=Dropped, mode='zero_bubble')
  gpipe = dataclasses.replace(zb, pipeline=dataclasses.replace(
      pipe, mode='gpipe'))
  params = init(Model(Dropped, 4, None), x)['params']

  def loss_of(model):
    def loss_fn(params, x, target):
      y = model.apply({'params': params}, x,
                      rngs={'dropout': jax.random.key(7)})
      return jnp.mean((y - target) ** 2)
    return loss_fn

  with jax.set_mesh(mesh_of(2, 1)):
    loss, grads = jax.jit(nn.pipeline.value_and_grad(loss_of(zb)))(
        params, x, target)
    loss_g, grads_g = jax.jit(jax.value_and_grad(loss_of(gpipe)))(
        params, x, target)
  np.testing.assert_allclose(loss, loss_g, rtol=OUT_RTOL)
  assert_grads_close(grads, grads_g)


class Tanh(nn.Module):
  """A block without variables."""

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(x)


@pytest.mark.parametrize('mode,repeats', [
    ('gpipe', 1), ('1f1b', 1), ('1f1b', 2), ('zero_bubble', 1)])
def test_a_block_without_variables_trains_under_every_schedule(mode,
                                                               repeats):
  """A stack of a variable-less block: the training loops looked for the
  stack's variables among loss_fn's params, found none, and raised
  "cannot find the stack's variables ... must pass them to model.apply
  unchanged", which they were. Now every schedule gives the unpipelined
  loss and the gradients of the layers around the stack."""
  pipe = nn.Pipeline(stages=2, microbatches=2, repeats=repeats, mode=mode)
  model = Model(Tanh, 2 * repeats, pipe)
  plain = Model(Tanh, 2 * repeats, None)
  x, target = model_batch(8)
  params = init(plain, x)['params']
  assert sorted(params) == ['Dense_0', 'Dense_1']
  grad = (jax.value_and_grad if mode == 'gpipe' else
          nn.pipeline.value_and_grad)
  with jax.set_mesh(mesh_of(2, 1)):
    loss, grads = jax.jit(grad(model_loss(model)))(params, x, target)
  loss_ref, grads_ref = jax.value_and_grad(model_loss(plain))(
      params, x, target)
  np.testing.assert_allclose(loss, loss_ref, rtol=OUT_RTOL)
  assert_grads_close(grads, grads_ref)


class Accumulates(nn.Module):
  """Adds the running sum of its outputs' row means: a float collection
  that feeds the output."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(x.shape[-1])(x)
    total = self.variable('sums', 'total', jnp.zeros, (x.shape[-1],))
    if self.is_mutable_collection('sums'):
      total.value = total.value + x.mean(0)
    return x + total.value


@pytest.mark.parametrize('mode', ['gpipe', '1f1b', 'zero_bubble'])
def test_collections_carry_no_gradient_between_microbatches(mode):
  """A per_microbatch collection is read by each microbatch as the one
  before left it, as data: the gradients are those of the unpipelined
  model run microbatch by microbatch (gradient accumulation). GPipe's
  loop differentiated through the collection into earlier microbatches'
  activations (found by the pipeline fuzz family, seed 1044), the
  training loops did not."""
  model, _ = one_f_one_b(2, 2, block=Accumulates, mode=mode,
                         per_microbatch=('sums',))
  plain = Model(Accumulates, 4, None)
  x, target = model_batch(8)
  variables = init(plain, x)

  def loss_of(model):
    def loss_fn(params, sums, x, target):
      y, updated = model.apply({'params': params, 'sums': sums}, x,
                               mutable=['sums'])
      return jnp.mean((y - target) ** 2), updated
    return loss_fn

  grad = (jax.value_and_grad if mode == 'gpipe' else
          nn.pipeline.value_and_grad)
  piped = lambda p, x, t: loss_of(model)(p, variables['sums'], x, t)
  with jax.set_mesh(mesh_of(2, 1)):
    (loss, updated), grads = jax.jit(grad(piped, has_aux=True))(
        variables['params'], x, target)
  step = jax.jit(jax.value_and_grad(loss_of(plain), has_aux=True))
  sums, total_loss, total = variables['sums'], 0., None
  for m in range(2):
    (loss_m, new), g_m = step(variables['params'], sums, x[m::2],
                              target[m::2])
    sums, total_loss = new['sums'], total_loss + loss_m / 2
    g_m = jax.tree_util.tree_map(lambda g: g / 2, g_m)
    total = g_m if total is None else jax.tree_util.tree_map(
        jnp.add, total, g_m)
  np.testing.assert_allclose(loss, total_loss, rtol=1e-5)
  assert_grads_close(grads, total)
  assert_same_arithmetic(updated['sums'], sums)


def test_interleaving_errors_name_the_constraint():
  with pytest.raises(ValueError, match=r'microbatches must be a multiple of '
                     r'stages; got microbatches=6, stages=4\. Use '
                     r'microbatches=8, or repeats=1'):
    nn.Pipeline(stages=4, microbatches=6, repeats=2, mode='1f1b')
  with pytest.raises(ValueError, match=r"mode='zero_bubble' already "
                     'recomputes'):
    nn.Pipeline(stages=2, microbatches=2, remat_iterations=True,
                mode='zero_bubble')


@pytest.mark.parametrize('mode,repeats', [('1f1b', 1), ('1f1b', 2),
                                          ('zero_bubble', 1)])
def test_pictures_draw_the_table_the_loop_runs(monkeypatch, mode, repeats):
  """benchmarks.pipeline.timeline (what docs/img's pictures show) is the
  table the training loop read while it ran, cell for cell."""
  from benchmarks import pipeline as bench  # pylint: disable=g-import-not-at-top
  from liftmods.core import pipeline_loop  # pylint: disable=g-import-not-at-top
  read = []
  original = pipeline_loop.training_table
  monkeypatch.setattr(pipeline_loop, 'training_table',
                      lambda *a: read.append(original(*a)) or read[-1])
  model, pipe = one_f_one_b(2, 4, length=4 * repeats, mode=mode,
                            repeats=repeats)
  x, target = model_batch(8)
  params = init(Model(Block, 4 * repeats, None), x)['params']
  with jax.set_mesh(mesh_of(2, 1)):
    jax.make_jaxpr(nn.pipeline.value_and_grad(model_loss(model)))(
        params, x, target)
  table, = read
  blocks, _ = bench.timeline(pipe)
  drawn = {(kind, t, s): (r, m) for s, _, _, kind, r, m, t in blocks}
  ran = {(kind, t, s): (int(cells['repeat'][t, s]), int(cells['micro'][t, s]))
         for kind, cells in table.kinds.items()
         for t, s in zip(*np.nonzero(cells['ok']))}
  assert drawn == ran
  assert len(ran) == len(table.kinds) * 2 * 4 * repeats
