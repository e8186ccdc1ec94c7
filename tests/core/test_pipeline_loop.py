"""core.pipeline_loop on a bare layer function and a one-stage mesh (the
multi-stage runs, through nn.Stack, are tests/pipeline)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from liftmods.core import pipeline_loop

L, WIDTH, ROWS = 4, 3, 8


@dataclasses.dataclass(frozen=True)
class Layout:
  """One stage: the stored order is the layer order."""
  microbatches: int
  repeats: int = 1
  stages: int = 1
  axis: str = 'stage'
  remat_iterations: bool = False
  per_microbatch: tuple = ()

  @property
  def iterations(self):
    return self.microbatches * self.repeats + self.stages - 1

  def stage_major(self, tree):
    return tree


class Explain:
  """Each error names its method and arguments."""

  def __getattr__(self, name):
    return lambda *args: ValueError(f'{name}: {args}')


def layer(c, sliced):
  """A tanh layer; counts its calls in 'counts' when that is mutable."""
  (variables,), _, _ = sliced
  y = jnp.tanh(c @ variables['params']['w'])
  mutable = {k: v for k, v in variables.items() if k == 'counts'}
  if mutable:
    mutable = {'counts': {'n': mutable['counts']['n'] + 1}}
  return y, ((), (mutable,))


def weights():
  return jax.random.normal(jax.random.key(0), (L, WIDTH, WIDTH)) / 2


def sequential(w, x):
  for i in range(L):
    x = jnp.tanh(x @ w[i])
  return x


def mesh():
  return jax.make_mesh((1,), ('stage',),
                       axis_types=(jax.sharding.AxisType.Auto,))


def run(layout, stacked, x, mutable=('params',), **options):
  is_mutable = lambda col: col in mutable
  return pipeline_loop.run_pipeline(
      layout, mesh(), layer, None, x, stacked, (), (), length=L,
      is_mutable=is_mutable, explain=Explain(), **options)


X = jax.random.normal(jax.random.key(1), (ROWS, WIDTH))


@pytest.mark.parametrize('microbatches,repeats', [(2, 1), (4, 2)])
def test_forward_loop_is_the_layers_in_order(microbatches, repeats):
  w = weights()
  y, mutable, loss = jax.jit(lambda w, x: run(
      Layout(microbatches, repeats), ({'params': {'w': w}},), x, ()))(w, X)
  np.testing.assert_allclose(y, sequential(w, X), rtol=1e-6)
  assert mutable == ({},) and loss is None
  grad = jax.grad(lambda w: jnp.sum(run(
      Layout(microbatches, repeats), ({'params': {'w': w}},), X, ())[0]))(w)
  ref = jax.grad(lambda w: jnp.sum(sequential(w, X)))(w)
  np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-6)


def test_a_per_microbatch_collection_counts_every_microbatch():
  stacked = ({'params': {'w': weights()},
              'counts': {'n': jnp.zeros((L,), jnp.int32)}},)
  _, (updated,), _ = run(Layout(4, per_microbatch=('counts',)), stacked, X,
                         mutable=('counts',))
  assert updated['counts']['n'].tolist() == [4] * L


def test_errors_are_worded_by_the_caller():
  stacked = ({'params': {'w': weights()},
              'counts': {'n': jnp.zeros((L,), jnp.int32)}},)
  with pytest.raises(ValueError, match=r"^mutable: \('counts',\)"):
    run(Layout(2), stacked, X, mutable=('counts',))
  with pytest.raises(ValueError, match=r'^batch: \(\(6, 3\), 4\)'):
    run(Layout(4), stacked, X[:6], mutable=())

  def writes(c, sliced):
    y, _ = layer(c, sliced)
    return y, ((), ({'counts': {'n': 1, 'extra': 2}},))

  with pytest.raises(ValueError, match=r'^wrote: '):
    pipeline_loop.run_pipeline(
        Layout(2, per_microbatch=('counts',)), mesh(), writes, None, X,
        stacked, (), (), length=L, is_mutable=lambda col: col == 'counts',
        explain=Explain())


@dataclasses.dataclass
class Training:
  """loss = mean((stack(x @ w_in) @ w_out − target)²): the loop calls it
  per microbatch, the stack answered by ``given``."""
  params: dict
  arrays: list
  batched: list
  has_aux: bool = False

  def call(self, params, arrays, given):
    x, target = arrays
    h = x @ params['in']
    if isinstance(given, pipeline_loop.Capture):
      given.value = h
      y = h
    else:
      y = given
    return jnp.mean((y @ params['out'] - target) ** 2)


def test_one_forward_one_backward_gives_the_gradients_of_the_loss():
  params = {'in': jnp.eye(WIDTH) * 0.5, 'stack': weights(),
            'out': jnp.ones((WIDTH, 1))}
  target = jnp.arange(ROWS, dtype=jnp.float32)[:, None] / ROWS

  def plain(params):
    y = sequential(params['stack'], X @ params['in'])
    return jnp.mean((y @ params['out'] - target) ** 2)

  def pipelined(params):
    training = Training(params, [X, target], [True, True])
    _, _, loss = run(Layout(4), ({'params': {'w': params['stack']}},),
                     X @ params['in'], (), training=training)
    return loss

  loss, grads = jax.jit(jax.value_and_grad(pipelined))(params)
  ref_loss, ref = jax.value_and_grad(plain)(params)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for name in params:
    np.testing.assert_allclose(grads[name], ref[name], rtol=1e-5, atol=1e-6)


def test_one_forward_one_backward_errors():
  params = {'in': jnp.eye(WIDTH), 'stack': weights(),
            'out': jnp.ones((WIDTH, 1))}
  stacked = ({'params': {'w': params['stack']}},)
  odd = Training(params, [X[:6], X[:6]], [True, True])
  with pytest.raises(ValueError, match=r'^argument: \(\(6, 3\), 4\)'):
    run(Layout(4), stacked, X, (), training=odd)
  elsewhere = Training({'in': params['in']}, [X, X], [True, True])
  with pytest.raises(ValueError, match=r'^not_in_params: \(\)'):
    run(Layout(4), stacked, X, (), training=elsewhere)


class Closure(Training):
  """Reads the whole batch from a closure, not from its microbatch."""

  def call(self, params, arrays, given):
    del arrays
    return super().call(params, [X, X[:, :1]], given)


def test_one_forward_one_backward_checks_the_stack_input_per_microbatch():
  params = {'in': jnp.eye(WIDTH), 'stack': weights(),
            'out': jnp.ones((WIDTH, 1))}
  training = Closure(params, [X, X[:, :1]], [True, True])
  with pytest.raises(ValueError,
                     match=r'^input_shape: \(\(8, 3\), \(2, 3\)\)'):
    run(Layout(4), ({'params': {'w': params['stack']}},), X, (),
        training=training)
