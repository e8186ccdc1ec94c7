"""core.layer_scan: the loop over stacked layers, against lift.scan."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from liftmods import errors
from liftmods.core import apply, init, lift
from liftmods.core.layer_scan import Remat, layer_scan
from liftmods.core.axes_scan import trace_loop
from liftmods.core.rng_counters import RngReplay
from program_compare import assert_match, run_compiled

L = 5
X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
RNGS = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}


def dense(scope, x, scale=1.0):
  w = scope.param('w', jax.nn.initializers.normal(), (4, 4))
  noise = jax.random.uniform(scope.make_rng('dropout'), x.shape)
  return jnp.tanh(x @ w) * scale + 0.01 * noise


def scanning(scope, x, scale=1.0):
  y = dense(scope, x, scale)
  return y, jnp.sum(y)


def reference(body):
  """lift.scan with every collection stacked and every rng split."""
  return lift.scan(body, variable_axes={True: 0}, split_rngs={True: True},
                   length=L)


def jitted_with_hlo(fn, *args, **kwargs):
  """``jax.jit(fn)(*args, **kwargs)`` and its optimized HLO."""
  return run_compiled(jax.jit(fn), *args, **kwargs)


# layer_scan against lift.scan: bit for bit where both compile to the same
# program (they do on jax 0.10 and 0.12; a traced scale against a constant
# one does not), else to float32 rounding (the initializer and a 4-wide
# product, a few ulps).
TOL = dict(rtol=1e-6, atol=1e-7)


def test_fold_matches_lift_scan():
  out, hlo = jitted_with_hlo(init(layer_scan(dense, length=L)), RNGS, X)
  ref, ref_hlo = jitted_with_hlo(
      init(reference(lambda s, c: (dense(s, c), ()))), RNGS, X)
  (y, variables), ((y_ref, _), ref_vars) = out, ref
  assert_match((variables['params']['w'], y), (ref_vars['params']['w'], y_ref),
               [(hlo, ref_hlo)], **TOL)


def test_scan_outputs_and_unrolled_form_agree():
  ((c, ys), variables), hlo = jitted_with_hlo(
      init(layer_scan(scanning, length=L, fold=False)), RNGS, X)
  ((c_ref, ys_ref), ref), ref_hlo = jitted_with_hlo(
      init(reference(scanning)), RNGS, X)
  assert_match((variables['params']['w'], ys), (ref['params']['w'], ys_ref),
               [(hlo, ref_hlo)], **TOL)
  (c_u, ys_u), unrolled = init(layer_scan(scanning, length=L, fold=False,
                                          rolled=False))(RNGS, X)
  # The same keys; the initializer compiled outside the loop rounds apart.
  np.testing.assert_allclose(unrolled['params']['w'], ref['params']['w'],
                             rtol=1e-6)
  np.testing.assert_allclose(c_u, c_ref, rtol=1e-6)
  np.testing.assert_allclose(ys_u, ys_ref, rtol=1e-6)
  assert ys.shape == (L,)


def test_per_layer_and_shared_arguments():
  scales = jnp.arange(1.0, L + 1.0)
  looped = layer_scan(dense, length=L, in_axes=(0,))
  _, variables = init(looped)(RNGS, X, scales)
  rngs = {'dropout': jax.random.key(2)}
  y, hlo = jitted_with_hlo(apply(looped), variables, X, scales, rngs=rngs)
  by_hand = apply(reference(lambda s, c, k: (dense(s, c, k), ())))
  (y_ref, _), ref_hlo = jitted_with_hlo(by_hand, variables, X, scales,
                                        rngs=rngs)
  assert_match(y, y_ref, [(hlo, ref_hlo)], **TOL)
  shared = apply(layer_scan(dense, length=L, in_axes=(lift.broadcast,)))
  keyword = apply(layer_scan(dense, length=L))
  y_shared, hlo = jitted_with_hlo(shared, variables, X, 2.0, rngs=rngs)
  y_keyword, ref_hlo = jitted_with_hlo(
      lambda v, x, rngs: keyword(v, x, scale=2.0, rngs=rngs), variables, X,
      rngs=rngs)
  assert_match(y_shared, y_keyword, [(hlo, ref_hlo)], **TOL)


def _loss(looped, variables):
  def loss(params):
    return jnp.sum(apply(looped)({'params': params}, X,
                                 rngs={'dropout': jax.random.key(3)}))
  return jax.grad(loss)(variables['params'])


def test_remat_and_groups_keep_the_gradient():
  _, variables = init(layer_scan(dense, length=L))(RNGS, X)
  flat = _loss(layer_scan(dense, length=L), variables)
  nothing = jax.checkpoint_policies.nothing_saveable
  for remat in (Remat(nothing), Remat(nothing, group_size=lambda *_: 2)):
    for rolled in (True, False):
      grad = _loss(layer_scan(dense, length=L, remat=remat, rolled=rolled),
                   variables)
      np.testing.assert_allclose(grad['w'], flat['w'], rtol=1e-5, atol=1e-6)


def test_group_size_sees_the_bytes():
  seen = []

  def group_size(length, carry_bytes, sliced_bytes):
    seen.append((length, carry_bytes, sliced_bytes))
    return None

  _, variables = init(layer_scan(dense, length=L))(RNGS, X)
  _loss(layer_scan(dense, length=L, remat=Remat(
      jax.checkpoint_policies.nothing_saveable, group_size=group_size)),
        variables)
  assert seen and seen[0][:2] == (L, X.size * 4)
  assert seen[0][2] >= L * 16 * 4  # at least the stacked kernels


def test_generic_errors():
  with pytest.raises(errors.ScanCarryError,
                     match='layer_scan at .*must return a pair'):
    init(layer_scan(dense, length=L, fold=False))(RNGS, X)
  with pytest.raises(errors.ScanCarryError, match='carry'):
    init(layer_scan(lambda s, x: dense(s, x)[:2], length=L))(RNGS, X)
  _, variables = init(layer_scan(dense, length=L))(RNGS, X)
  with pytest.raises(errors.VariableAxisError,
                     match=r'"w" of collection "params" has shape \(5, 4, 4\);'
                     ' expected a leading axis of 3 layers'):
    apply(layer_scan(dense, length=3))(variables, X, rngs=RNGS)
  with pytest.raises(ValueError, match='in_axes has 0 entries for 1'):
    init(layer_scan(dense, length=L))(RNGS, X, 1.0)


class Worded:
  """An Explain that tags its errors."""

  def output(self, out):
    return RuntimeError(f'output {type(out).__name__}')

  def carry(self, c_in, out, mismatch):
    return RuntimeError(f'carry: {mismatch}')

  def axis(self, scope, where, shape):
    return RuntimeError(f'axis {where} {shape}')


def test_the_caller_words_the_errors():
  with pytest.raises(RuntimeError, match='output .*Tracer'):
    init(layer_scan(dense, length=L, fold=False, explain=Worded()))(RNGS, X)
  with pytest.raises(RuntimeError, match='carry: the carry went in as'):
    init(layer_scan(lambda s, x: dense(s, x)[:2], length=L,
                    explain=Worded()))(RNGS, X)
  _, variables = init(layer_scan(dense, length=L))(RNGS, X)
  with pytest.raises(RuntimeError, match=r'axis variable "w" of collection '
                     r'"params" \(5, 4, 4\)'):
    apply(layer_scan(dense, length=2, explain=Worded()))(variables, X,
                                                          rngs=RNGS)


class Reversed:
  """A Schedule that runs the layers last to first, except in init."""

  def __init__(self):
    self.stored = self.ran = 0

  def takes_over(self, scopes, stacked):
    return not scopes[0].is_mutable_collection('params')

  def run_layers(self, layer, policy, c, stacked, keys, per_layer, length,
                 scopes):
    self.ran += 1
    outs = []
    for i in reversed(range(length)):
      sliced = jax.tree_util.tree_map(lambda a, i=i: a[i],
                                      (stacked, keys, per_layer))
      c, (_, variables) = layer(c, sliced)
      outs.insert(0, variables)
    return c, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)

  def store(self, variables):
    self.stored += 1
    return variables


def test_a_schedule_takes_the_loop_over():
  schedule = Reversed()
  looped = layer_scan(dense, length=L, schedule=schedule)
  _, variables = init(looped)(RNGS, X)
  assert schedule.stored == 1  # init ran the plain loop, stored its layout
  assert schedule.ran == 0
  y = apply(looped)(variables, X, rngs=RNGS)
  assert schedule.ran == 1 and schedule.stored == 1
  # The same layers in the other order: they do not commute.
  plain = apply(layer_scan(dense, length=L))(variables, X, rngs=RNGS)
  assert y.shape == plain.shape and not np.allclose(y, plain)


def test_trace_loop_replays_the_first_trace():
  RngReplay.cache.clear()
  traces = []

  def counting(scope, x):
    traces.append(1)
    return dense(scope, x)

  looped = layer_scan(counting, length=L, site='counting')
  _, variables = init(looped)(RNGS, X)
  first = len(traces)
  init(looped)(RNGS, X)
  assert first == 2  # eval_shape's trace, then the loop's
  assert len(traces) - first == 1  # replayed: the loop's trace alone


def test_trace_loop_without_replay_runs_both():
  calls = []
  out = trace_loop(None, lambda: calls.append('first') or 7,
                   lambda first, verify: (calls.append(first), verify))
  assert calls == ['first', 7] and out == (None, None)
