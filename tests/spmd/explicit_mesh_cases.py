"""Meshes with Explicit axes (``jax.sharding.AxisType.Explicit``), and mixed
ones, against the same model on an all-Auto mesh, on 8 simulated CPU
devices. Not collected by the main run: ``test_explicit_mesh.py`` runs this
file in a fresh process. By hand: ``python -m pytest
tests/spmd/explicit_mesh_cases.py``.

On an Explicit axis an array's sharding is part of its type: constraints
become ``jax.sharding.reshard``, and JAX asks model code for the output
sharding of a contraction over a sharded dimension (``out_sharding=``,
which ``nn.logical_out_sharding`` derives from logical names). The model
below is written that way once and runs on every mesh.
"""
import multidevice

multidevice.simulate(8)

import functools  # pylint: disable=g-import-not-at-top

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import liftmods as nn
from program_compare import assert_match, optimized_hlo

multidevice.require(8)

KEY = jax.random.key(0)
X = jnp.asarray(np.random.RandomState(0).normal(size=(8, 8)), jnp.float32)
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
TYPES = {'explicit': (EXPLICIT, EXPLICIT), 'first_explicit': (EXPLICIT, AUTO),
         'second_explicit': (AUTO, EXPLICIT)}


def dot_to(*names):
  """A dot_general whose output is laid out as the logical ``names`` say
  (what JAX asks for on Explicit axes; nothing on Auto ones)."""
  def dot_general(*args, **kwargs):
    return jax.lax.dot_general(
        *args, **kwargs, out_sharding=nn.logical_out_sharding(names))
  return dot_general


def part(*names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16, kernel_init=part('embed', 'mlp'))(x)
    h = nn.with_logical_constraint(jnp.tanh(h), ('batch', 'mlp'))
    y = nn.Dense(8, kernel_init=part('mlp', 'embed'),
                 dot_general=dot_to('batch', 'embed'))(h)
    return nn.with_logical_constraint(x + y, ('batch', 'embed'))


class Model(nn.Module):
  pipeline: nn.Pipeline | None = None
  policy: str | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.with_logical_constraint(x, ('batch', 'embed'))
    return nn.Stack(Block, 4, policy=self.policy, pipeline=self.pipeline)(
        name='stack')(x)


STACK_MESH = (('data', 'model'), (4, 2),
              (('batch', 'data'), ('embed', None), ('mlp', 'model')))
PIPE_MESH = (('stage', 'data'), (2, 4),
             (('batch', 'data'), ('embed', None), ('mlp', None)))


def run(model, layout, types):
  """init_sharded, apply and the gradient of a squared loss, with the
  returned shardings' specs, on a mesh of ``types``, and the three
  programs' optimized HLO."""
  names, shape, rules = layout
  mesh = jax.make_mesh(shape, names, axis_types=types)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    init = nn.init_sharded(model, mesh, rules)
    v, shardings = init(KEY, X)
    apply = jax.jit(model.apply)
    grad = jax.jit(jax.grad(lambda v: (model.apply(v, X) ** 2).mean()))
    y, g = apply(v, X), grad(v)
    hlo = [optimized_hlo(init, KEY, X), optimized_hlo(apply, v, X),
           optimized_hlo(grad, v)]
    specs = jax.tree_util.tree_map(lambda s: s.spec, shardings)
    typed = jax.tree_util.tree_map(lambda a: jax.typeof(a).sharding.spec, v)
  return jax.device_get((v, y, g)), specs, typed, jax.typeof(y), hlo


# Explicit axes partition the model otherwise than Auto ones (reshards
# where Auto propagates), so the per-device programs differ (on jax 0.10 and
# 0.12), and whether their other fusions and reduction orders move the last
# bit depends on the CPU: the AdamW step below was bitwise on AVX-512 and
# one ulp apart elsewhere (3e-8 under --xla_cpu_max_isa=AVX2 on jax 0.12).
# Where the programs differ the values are compared to float32 rounding over
# a four-layer stack: 1e-5 relative is about 100 ulps.
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize('kind', sorted(TYPES))
@pytest.mark.parametrize('policy', [None, 'full'])
def test_stack_equals_the_auto_mesh(kind, policy):
  model = Model(policy=policy)
  auto, auto_specs, _, _, auto_hlo = run(model, STACK_MESH, (AUTO, AUTO))
  out, specs, typed, y_type, hlo = run(model, STACK_MESH, TYPES[kind])
  assert_match(out, auto, zip(hlo, auto_hlo), rtol=RTOL, atol=ATOL)
  assert specs == auto_specs
  kernel = ['params', 'stack', 'Dense_0', 'kernel']
  spec = specs
  for k in kernel:
    spec = spec[k]
  assert spec == P(None, None, 'model')
  # On an Explicit axis the arrays' types carry the layout.
  explicit = {n for n, t in zip(STACK_MESH[0], TYPES[kind]) if t == EXPLICIT}
  typed_kernel = typed
  for k in kernel:
    typed_kernel = typed_kernel[k]
  assert typed_kernel == (P(None, None, 'model') if 'model' in explicit
                          else P(None, None, None))
  assert ('data' in explicit) == (y_type.sharding.spec[0] == 'data')


@pytest.mark.parametrize('kind', sorted(TYPES))
def test_pipeline_equals_the_auto_mesh(kind):
  model = Model(pipeline=nn.Pipeline(stages=2, microbatches=2))
  auto, auto_specs, _, _, auto_hlo = run(model, PIPE_MESH, (AUTO, AUTO))
  out, specs, typed, _, hlo = run(model, PIPE_MESH, TYPES[kind])
  assert_match(out, auto, zip(hlo, auto_hlo), rtol=RTOL, atol=ATOL)
  assert specs == auto_specs
  if TYPES[kind][0] == EXPLICIT:  # the stage axis
    assert typed['params']['stack']['Dense_0']['kernel'][0] == 'stage'


def one_f_one_b_step(mode, types, x, microbatches=4):
  model = Model(pipeline=nn.Pipeline(stages=2, microbatches=microbatches,
                                     mode=mode))
  names, shape, rules = PIPE_MESH
  mesh = jax.make_mesh(shape, names, axis_types=types)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    init = nn.init_sharded(model, mesh, rules)
    v, _ = init(KEY, x)
    loss = lambda v, x: (model.apply(v, x) ** 2).mean()
    step = jax.jit(nn.pipeline.value_and_grad(loss))
    hlo = [optimized_hlo(init, KEY, x), optimized_hlo(step, v, x)]
    return jax.device_get(step(v, x)), hlo


@pytest.mark.parametrize('kind', sorted(TYPES))
@pytest.mark.parametrize('mode', ['1f1b', 'zero_bubble'])
def test_training_schedules_equal_the_auto_mesh(kind, mode):
  x = jnp.concatenate([X, -X])  # 16 rows: 4 per microbatch over 'data'
  out, hlo = one_f_one_b_step(mode, TYPES[kind], x)
  auto, auto_hlo = one_f_one_b_step(mode, (AUTO, AUTO), x)
  assert_match(out, auto, zip(hlo, auto_hlo), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('kind', sorted(TYPES))
def test_layer_order_changes_on_a_stage_axis(kind):
  """Found by the pipeline fuzz family (seeds 1000, 1002, 1023 with the
  mesh's axes Explicit): ``to_stack_layout`` of gradients split over an
  Explicit stage axis raised JAX's ShardingTypeError (a reshape it cannot
  type). The layers are reordered and keep the given layout."""
  pipe = nn.Pipeline(stages=2, microbatches=2, repeats=2)
  names, shape, _ = PIPE_MESH
  mesh = jax.make_mesh(shape, names, axis_types=TYPES[kind])
  w = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
  on_stages = jax.device_put(w, NamedSharding(mesh, P('stage')))
  stack = pipe.to_stack_layout({'w': on_stages})['w']
  np.testing.assert_array_equal(stack, pipe.to_stack_layout({'w': w})['w'])
  if TYPES[kind][0] == EXPLICIT:
    assert stack.sharding.spec == P('stage', None)
  assert jax.typeof(stack).sharding.spec == jax.typeof(on_stages).sharding.spec
  back = pipe.to_pipeline_layout({'w': stack})['w']
  np.testing.assert_array_equal(back, w)


@pytest.mark.parametrize('kind', sorted(TYPES))
def test_gpipe_runs_microbatches_that_do_not_divide_the_data_axis(kind):
  """GPipe needs no refusal for 2-row microbatches over a data axis of 4:
  the forward loop holds their rows whole (under jax >= 0.11 XLA's SPMD
  partitioner aborted differentiating it otherwise), on Explicit axes as
  on Auto ones."""
  model = Model(pipeline=nn.Pipeline(stages=2, microbatches=4))
  names, shape, rules = PIPE_MESH
  plain = Model()
  v = plain.init(KEY, X)
  loss = lambda m: lambda v, x: (m.apply(v, x) ** 2).mean()
  want = jax.value_and_grad(loss(plain))(v, X)
  mesh = jax.make_mesh(shape, names, axis_types=TYPES[kind])
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    x = jax.device_put(X, NamedSharding(mesh, P('data')))
    got = jax.jit(jax.value_and_grad(loss(model)))(v, x)
  jax.tree_util.tree_map(functools.partial(
      np.testing.assert_allclose, rtol=RTOL, atol=ATOL), got, want)


def test_uneven_microbatches_are_refused_where_the_sharding_is_known():
  # 8 rows in 4 microbatches: 2 rows each over the 4 devices of 'data'.
  with pytest.raises(nn.PipelineError) as info:
    one_f_one_b_step('1f1b', TYPES['explicit'], X)
  assert str(info.value).startswith(
      "Stack at /stack: Pipeline(mode='1f1b') gives each microbatch 2 rows "
      "of a batch sharded over 'data' (4 devices)")


@pytest.mark.parametrize('kind', sorted(TYPES))
def test_with_logical_constraint_reshards_on_explicit_axes(kind):
  names, shape, rules = STACK_MESH
  mesh = jax.make_mesh(shape, names, axis_types=TYPES[kind])
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    y = jax.jit(lambda x: nn.with_logical_constraint(
        x * 2, ('batch', 'mlp')))(jnp.ones((8, 4)))
  explicit = [n for n, t in zip(names, TYPES[kind]) if t == EXPLICIT]
  want = P(*(a if a in explicit else None for a in ('data', 'model')))
  assert jax.typeof(y).sharding.spec == want
  assert y.sharding.spec == P('data', 'model')
  np.testing.assert_array_equal(y, 2 * np.ones((8, 4)))


def test_logical_out_sharding_keeps_explicit_axes_only():
  names, shape, rules = STACK_MESH
  with nn.logical_axis_rules(rules):
    assert nn.logical_out_sharding(('batch', 'mlp')) is None  # no mesh
    for kind, want in (('explicit', P('data', 'model')),
                       ('first_explicit', P('data', None)),
                       ('second_explicit', P(None, 'model'))):
      mesh = jax.make_mesh(shape, names, axis_types=TYPES[kind])
      with jax.set_mesh(mesh):
        assert nn.logical_out_sharding(('batch', 'mlp')) == want, kind
    with jax.set_mesh(jax.make_mesh(shape, names, axis_types=(AUTO, AUTO))):
      assert nn.logical_out_sharding(('batch', 'mlp')) is None


def test_an_adamw_step_on_an_explicit_mesh_equals_the_auto_one():
  names, shape, rules = STACK_MESH
  model, opt = Model(policy='full'), optax.adamw(1e-2)

  def train(types):
    mesh = jax.make_mesh(shape, names, axis_types=types)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      init = nn.init_sharded(model, mesh, rules)
      v, _ = init(KEY, X)
      state = opt.init(v)

      @jax.jit
      def step(v, state):
        g = jax.grad(lambda v: (model.apply(v, X) ** 2).mean())(v)
        updates, state = opt.update(g, state, v)
        return optax.apply_updates(v, updates), state

      hlo = [optimized_hlo(init, KEY, X), optimized_hlo(step, v, state)]
      for _ in range(3):
        v, state = step(v, state)
      return jax.device_get(v), hlo

  (out, hlo), (auto, auto_hlo) = train(TYPES['explicit']), train((AUTO, AUTO))
  # Adam moves a parameter by at most lr = 1e-2 a step whatever the
  # gradient's scale, so gradients equal to a relative 1e-5 (RTOL) move the
  # parameters by at most 1e-7 a step apart: 3e-7 over three steps (the
  # issue-47 failure was 3.7e-9).
  assert_match(out, auto, zip(hlo, auto_hlo), rtol=1e-6, atol=3e-7)


class FsdpMlp(nn.Module):
  """A first kernel split over 'model' on the features it contracts, which
  the activation holds whole: the product gathers it for itself and for
  the activation's gradient, under a derivative rule of liftmods' own."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16, kernel_init=part('embed', 'mlp'))(x)
    return nn.Dense(4, kernel_init=part('mlp', None))(jnp.tanh(h))


FSDP_MESH = (('data', 'model'), (2, 4),
             (('batch', 'data'), ('embed', 'model'), ('mlp', None)))


@pytest.mark.parametrize('kind', sorted(TYPES))
def test_forward_mode_through_an_fsdp_kernel_equals_the_auto_mesh(kind):
  """jax.jvp of the output, and a Hessian-vector product (forward over
  reverse), in the parameters' own direction, on each mesh."""
  names, shape, rules = FSDP_MESH
  model = FsdpMlp()

  def derivatives(types):
    mesh = jax.make_mesh(shape, names, axis_types=types)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      v, _ = nn.init_sharded(model, mesh, rules, warn_unmapped=False)(KEY, X)
      apply = lambda v: model.apply(v, X)
      loss = lambda v: (apply(v) ** 2).mean()
      y, dy = jax.jit(lambda v: jax.jvp(apply, (v,), (v,)))(v)
      hvp = jax.jit(lambda v: jax.jvp(jax.grad(loss), (v,), (v,))[1])(v)
      return jax.device_get((y, dy, hvp))

  got, want = derivatives(TYPES[kind]), derivatives((AUTO, AUTO))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
