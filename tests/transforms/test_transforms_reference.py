"""Differential tests of the lifted transforms against the docstring examples
of Flax Linen's lifted-transform API (the docstrings of ``nn.vmap``,
``nn.scan``, ``nn.remat`` and the other transforms in
``flax/linen/transforms.py``, which serve as the reference specification).

Every example model is written ONCE, as ``build(nn)`` (the source is
parameterized by the namespace), and run twice: with ``nn = flax.linen`` (the
oracle) and with ``nn = liftmods``. For each example we assert

* identical variable trees (``jax.tree_util.tree_structure``, shapes, dtypes),
* BIT-IDENTICAL init values for two seeds,
* equal outputs (``rtol=1e-5, atol=1e-6``) (for the zero-initialized
  examples also at perturbed parameters), and
* equal gradients of a scalar loss w.r.t. ``params`` where differentiable.

The examples were adapted from the reference into tests; where an example was
incomplete (it only builds a transformed class, refers to an undefined name,
or uses an API removed from current JAX) it is completed minimally and the
completion is called out in a comment.
"""
import flax.core
import flax.core.lift
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
import liftmods.core
import liftmods.core.lift
from treecheck import assert_close, assert_identical, normal

pytestmark = pytest.mark.usefixtures('fast_compiles')

SEEDS = (0, 1)
BACKENDS = (fnn, lnn)
CORE = {fnn: flax.core, lnn: liftmods.core}
CORE_LIFT = {fnn: flax.core.lift, lnn: liftmods.core.lift}
RTOL, ATOL = 1e-5, 1e-6


def scalar_loss(tree):
  """A scalar that depends on every floating leaf of ``tree`` with distinct
  weights (so that symmetric mistakes do not cancel)."""
  total = jnp.zeros((), jnp.float32)
  for leaf in jax.tree_util.tree_leaves(tree):
    leaf = jnp.asarray(leaf)
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      continue
    w = 1.0 + 0.1 * jnp.arange(leaf.size, dtype=jnp.float32).reshape(leaf.shape)
    total = total + jnp.sum(jnp.tanh(leaf) * w)
  return total


def perturb(variables, amount=0.25):
  """Moves every float param away from its init value (deterministically), so
  that zero-initialized examples give non-trivial outputs."""
  def f(path, x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return x
    h = (sum(len(str(p)) for p in path) % 7) + 1
    return x + amount * h * jnp.cos(jnp.arange(x.size, dtype=x.dtype)
                                    ).reshape(x.shape)
  out = dict(variables)
  out['params'] = jax.tree_util.tree_map_with_path(f, variables['params'])
  return out


def check_module(make, init_args, apply_cases=None, *, mutable=False,
                 differentiable=True, seeds=SEEDS, perturbed=False,
                 check_init_output=True):
  """Runs the module built by ``make(nn)`` on both backends.

  ``init_args``: positional args for ``init`` (run for every seed);
  ``apply_cases``: a list of positional-arg tuples for ``apply`` (defaults to
  ``[init_args]``), each run eagerly (outputs compared) and, if
  ``differentiable``, through ``jax.jit(jax.value_and_grad(loss))`` (param
  gradients compared). ``perturbed`` also runs every case at perturbed params.
  Returns the flax and liftmods variables of the first seed.
  """
  if apply_cases is None:
    apply_cases = [init_args]
  mods = {nn: make(nn) for nn in BACKENDS}
  first = None
  for seed in seeds:
    key = jax.random.key(seed)
    res = {nn: mods[nn].init_with_output(key, *init_args) for nn in BACKENDS}
    (fo, fv), (lo, lv) = res[fnn], res[lnn]
    assert_identical(lv, fv, f'init variables (seed {seed})')
    if check_init_output:
      assert_close(lo, fo, rtol=RTOL, atol=ATOL,
                   what=f'init output (seed {seed})')
    if first is None:
      first = (fv, lv)
  fv, lv = first
  variables = {fnn: fv, lnn: lv}
  settings = [('init', variables)]
  if perturbed:
    settings.append(('perturbed',
                     {nn: perturb(v) for nn, v in variables.items()}))

  for case in apply_cases:
    for tag, vs in settings:
      what = f'({tag}, case {case!r:.50})'
      outs = {nn: mods[nn].apply(vs[nn], *case, mutable=mutable)
              for nn in BACKENDS}
      assert_close(outs[lnn], outs[fnn], rtol=RTOL, atol=ATOL,
                   what=f'apply output {what}')
      if not differentiable:
        continue

      def loss(params, nn, vs=vs, case=case):
        v = dict(vs[nn])
        v['params'] = params
        out = mods[nn].apply(v, *case, mutable=mutable)
        if mutable:
          out = out[0]
        return scalar_loss(out)

      grads = {nn: jax.jit(jax.grad(loss), static_argnums=1)(vs[nn]['params'], nn)
               for nn in BACKENDS}
      assert_close(grads[lnn], grads[fnn], rtol=RTOL, atol=ATOL,
                   what=f'param grads {what}')
  return fv, lv


# -- vmap ------------------------------------------------------------------------

XB = normal(7, (4, 5))


def test_vmap_unshared_params():
  """``vmap`` of ``Dense`` that does not share params along the batch axis.
  (The example only builds ``BatchDense``; completed by instantiating it.)"""
  def make(nn):
    BatchDense = nn.vmap(
        nn.Dense,
        in_axes=0, out_axes=0,
        variable_axes={'params': 0},
        split_rngs={'params': True})
    return BatchDense(features=3)

  fv, _ = check_module(make, (XB,))
  assert fv['params']['kernel'].shape == (4, 5, 3)
  # split rngs: the per-example kernels differ
  assert not np.array_equal(fv['params']['kernel'][0], fv['params']['kernel'][1])


def test_vmap_shared_params():
  """``vmap`` of ``Dense`` with params broadcast along the batch axis."""
  def make(nn):
    BatchDense = nn.vmap(
        nn.Dense,
        in_axes=0, out_axes=0,
        variable_axes={'params': None},
        split_rngs={'params': False})
    return BatchDense(features=3)

  fv, _ = check_module(make, (XB,))
  assert fv['params']['kernel'].shape == (5, 3)


def test_vmap_in_compact_parent():
  """The ``BatchDense`` of the example used as a submodule of a parent."""
  def make(nn):
    class Parent(nn.Module):
      @nn.compact
      def __call__(self, x):
        BatchDense = nn.vmap(
            nn.Dense,
            in_axes=0, out_axes=0,
            variable_axes={'params': 0},
            split_rngs={'params': True})
        return nn.Dense(2)(nn.relu(BatchDense(3)(x)))
    return Parent()

  check_module(make, (XB,))


# -- jit (the reference has no docstring example; minimal usage) ---------------


def test_jit_module_class():
  """``nn.jit`` has no example in the reference; minimal use of its signature:
  a jitted ``Dense`` class and a jitted submodule inside a compact parent."""
  def make(nn):
    JitDense = nn.jit(nn.Dense)

    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        x = JitDense(4)(x)
        x = nn.relu(x)
        return JitDense(2)(x)
    return MLP()

  check_module(make, (XB,))


def test_jit_direct():
  def make(nn):
    return nn.jit(nn.Dense)(features=3)

  check_module(make, (XB,))


# -- checkpoint / remat ----------------------------------------------------------


@pytest.mark.parametrize('which', ['checkpoint', 'remat'])
def test_checkpoint_mlp(which):
  """The ``CheckpointedMLP`` example (``remat`` is documented as an alias)."""
  def make(nn):
    class CheckpointedMLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        CheckpointDense = getattr(nn, which)(nn.Dense)
        x = CheckpointDense(128)(x)
        x = nn.relu(x)
        x = CheckpointDense(1)(x)
        return x
    return CheckpointedMLP()

  x = jax.random.normal(jax.random.key(3), (1, 16))
  fv, _ = check_module(make, (jnp.ones((1, 16)),), [(x,)])
  assert set(fv['params']) == {'CheckpointDense_0', 'CheckpointDense_1'}


# -- remat_scan ------------------------------------------------------------------


def test_remat_scan_big_model():
  """The ``BigModel`` example: 10x10 = 100 stacked ``Dense(8)`` layers. The
  example omits the input; a Dense stack carries its input, so it needs 8
  input features."""
  def make(nn):
    class BigModel(nn.Module):
      @nn.compact
      def __call__(self, x):
        DenseStack = nn.remat_scan(nn.Dense, lengths=(10, 10))
        # 100x dense with O(sqrt(N)) memory for gradient computation
        return DenseStack(8, name='dense_stack')(x)
    return BigModel()

  x = jax.random.normal(jax.random.key(5), (2, 8)) * 0.1
  fv, _ = check_module(make, (x,))
  assert fv['params']['dense_stack']['kernel'].shape == (10, 10, 8, 8)


# -- scan ------------------------------------------------------------------------

XS = normal(11, (4, 12, 7))


def test_scan_lstm_class():
  """The ``LSTM`` example that scans the ``LSTMCell`` class."""
  def make(nn):
    class LSTM(nn.Module):
      features: int

      @nn.compact
      def __call__(self, x):
        ScanLSTM = nn.scan(
            nn.LSTMCell, variable_broadcast='params',
            split_rngs={'params': False}, in_axes=1, out_axes=1)

        lstm = ScanLSTM(self.features)
        input_shape = x[:, 0].shape
        carry = lstm.initialize_carry(jax.random.key(0), input_shape)
        carry, x = lstm(carry, x)
        return x
    return LSTM(features=32)

  fv, _ = check_module(make, (jnp.ones((4, 12, 7)),), [(XS,)])
  assert set(fv['params']) == {'ScanLSTMCell_0'}


def test_scan_lstm_functional():
  """The functional form of the ``LSTM`` example (scan over ``body_fn``)."""
  def make(nn):
    class LSTM(nn.Module):
      features: int

      @nn.compact
      def __call__(self, x):
        cell = nn.LSTMCell(self.features)

        def body_fn(cell, carry, x):
          carry, y = cell(carry, x)
          return carry, y
        scan = nn.scan(
            body_fn, variable_broadcast='params',
            split_rngs={'params': False}, in_axes=1, out_axes=1)

        input_shape = x[:, 0].shape
        carry = cell.initialize_carry(jax.random.key(0), input_shape)
        carry, x = scan(cell, carry, x)
        return x
    return LSTM(features=32)

  fv, _ = check_module(make, (jnp.ones((4, 12, 7)),), [(XS,)])
  assert set(fv['params']) == {'LSTMCell_0'}


def test_scan_residual_mlp():
  """The ``ResidualMLP`` example: ``n_layers`` stacked blocks in one scan."""
  def make(nn):
    class ResidualMLPBlock(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        h = nn.Dense(features=2)(x)
        h = nn.relu(h)
        return x + h, None

    class ResidualMLP(nn.Module):
      n_layers: int = 4

      @nn.compact
      def __call__(self, x):
        ScanMLP = nn.scan(
            ResidualMLPBlock, variable_axes={'params': 0},
            variable_broadcast=False, split_rngs={'params': True},
            length=self.n_layers)
        x, _ = ScanMLP()(x, None)
        return x
    return ResidualMLP(n_layers=4)

  x = jax.random.normal(jax.random.key(2), (3, 2))
  fv, _ = check_module(make, (jnp.ones((1, 2)),), [(x,)])
  kernel = fv['params']['ScanResidualMLPBlock_0']['Dense_0']['kernel']
  assert kernel.shape == (4, 2, 2)


# -- map_variables ---------------------------------------------------------------


def test_map_variables_causal_dense():
  """The ``CausalDense`` example. Completion: the reference uses
  ``jax.tree_map``, which current JAX removed; ``jax.tree_util.tree_map`` is
  the same function."""
  def make(nn):
    class CausalDense(nn.Module):
      """Masks the weights so that output i only depends on input <= i."""
      features: int

      def apply_mask(self, variables):
        return (jax.tree_util.tree_map(jnp.triu, variables)
                if not self.is_initializing() else variables)

      def setup(self):
        # temporary class
        _CausalDense = nn.map_variables(
            nn.Dense, 'params', self.apply_mask, init=self.is_initializing())
        self.dense = _CausalDense(features=self.features, use_bias=False)

      def __call__(self, x):
        return self.dense(x)
    return CausalDense(features=5)

  x = jax.random.normal(jax.random.key(4), (3, 5))
  fv, lv = check_module(make, (jnp.ones((1, 5)),), [(x,)])
  # The stored kernel is unmasked; the applied one is masked (causal).
  k = np.asarray(fv['params']['dense']['kernel'])
  assert not np.array_equal(k, np.triu(k))
  for nn, v in ((fnn, fv), (lnn, lv)):
    m = make(nn)
    y0 = m.apply(v, jnp.zeros((1, 5)).at[0, 4].set(1.0))
    # input 4 only feeds output 4
    np.testing.assert_array_equal(np.asarray(y0)[0, :4], 0.0)


# -- vjp / value_and_grad / grad / jvp -------------------------------------------


def _learn_scale_xy(nn):
  class LearnScale(nn.Module):
    @nn.compact
    def __call__(self, x, y):
      p = self.param('scale', nn.initializers.zeros_init(), ())
      return p * x * y
  return LearnScale


def test_vjp_learn_scale():
  """The ``nn.vjp`` example (``Foo`` returns the value and all cotangents)."""
  def make(nn):
    LearnScale = _learn_scale_xy(nn)

    class Foo(nn.Module):
      @nn.compact
      def __call__(self, x, y):
        z, bwd = nn.vjp(lambda mdl, x, y: mdl(x, y), LearnScale(), x, y)
        params_grad, x_grad, y_grad = bwd(jnp.ones(z.shape))
        return z, params_grad, x_grad, y_grad
    return Foo()

  x = jax.random.normal(jax.random.key(1), (3,))
  y = jax.random.normal(jax.random.key(2), (3,))
  fv, _ = check_module(make, (x, y), perturbed=True)
  assert set(fv['params']) == {'LearnScale_0'}


def test_value_and_grad_learn_scale():
  """The ``nn.value_and_grad`` example. Completion: ``value_and_grad`` needs a
  scalar output, so ``x`` and ``y`` are scalars."""
  def make(nn):
    LearnScale = _learn_scale_xy(nn)

    class Foo(nn.Module):
      @nn.compact
      def __call__(self, x, y):
        z, (x_grad, y_grad) = nn.value_and_grad(
            lambda mdl, x, y: mdl(x, y), LearnScale(), x, y)
        return z, x_grad, y_grad
    return Foo()

  check_module(make, (jnp.float32(2.0), jnp.float32(-3.0)), perturbed=True)


def test_grad_learn_scale():
  """The ``nn.grad`` example (scalar ``x``, ``y`` as for value_and_grad)."""
  def make(nn):
    LearnScale = _learn_scale_xy(nn)

    class Foo(nn.Module):
      @nn.compact
      def __call__(self, x, y):
        x_grad, y_grad = nn.grad(
            lambda mdl, x, y: mdl(x, y), LearnScale(), x, y)
        return x_grad, y_grad
    return Foo()

  check_module(make, (jnp.float32(2.0), jnp.float32(-3.0)), perturbed=True)


def test_jvp_learn_scale_module():
  """The Module ``nn.jvp`` example. Completion: the reference's initializer
  ``nn.initializers._init()`` is an undefined name; the functional-core
  version of the same example uses ``zeros_init()``, used here too."""
  def make(nn):
    class LearnScale(nn.Module):
      @nn.compact
      def __call__(self, x):
        p = self.param('test', nn.initializers.zeros_init(), ())
        return p * x

    class Foo(nn.Module):
      @nn.compact
      def __call__(self, x):
        scale = LearnScale()
        vars_t = jax.tree_util.tree_map(jnp.ones_like,
                                        scale.variables.get('params', {}))
        _, out_t = nn.jvp(
            lambda mdl, x: mdl(x), scale, (x,), (jnp.zeros_like(x),),
            variable_tangents={'params': vars_t})
        return out_t
    return Foo()

  x = jax.random.normal(jax.random.key(9), (3,))
  fv, _ = check_module(make, (x,), perturbed=True)
  assert set(fv['params']) == {'LearnScale_0'}
  # After init the param exists, so the tangent is d(p*x)/dp . 1 = x.
  for nn in BACKENDS:
    np.testing.assert_allclose(make(nn).apply(fv, x), x, rtol=RTOL, atol=ATOL)


def test_jvp_functional_core():
  """The functional-core ``lift.jvp`` example (``flax.core.lift`` vs
  ``liftmods.core.lift``). Completion: it is run via ``core.init`` /
  ``core.apply``."""
  def make(nn):
    lift = CORE_LIFT[nn]

    def learn_scale(scope, x):
      p = scope.param('scale', nn.initializers.zeros_init(), ())
      return p * x

    def f(scope, x):
      vars_t = jax.tree_util.tree_map(jnp.ones_like,
                                      scope.variables().get('params', {}))
      x, out_t = lift.jvp(
          learn_scale, scope, (x,), (jnp.zeros_like(x),),
          variable_tangents={'params': vars_t})
      return out_t
    return f

  x = jax.random.normal(jax.random.key(9), (3,))
  fns = {nn: make(nn) for nn in BACKENDS}
  for seed in SEEDS:
    res = {nn: CORE[nn].init(fns[nn])(jax.random.key(seed), x)
           for nn in BACKENDS}
    assert_identical(res[lnn][1], res[fnn][1], f'core init vars (seed {seed})')
    assert_close(res[lnn][0], res[fnn][0], rtol=RTOL, atol=ATOL,
                 what=f'core init out (seed {seed})')
  fv = res[fnn][1]
  for vs in (fv, perturb(fv)):
    outs = {nn: CORE[nn].apply(fns[nn])(vs, x) for nn in BACKENDS}
    assert_close(outs[lnn], outs[fnn], rtol=RTOL, atol=ATOL,
                 what='core apply output')

    def loss(params, nn):
      return scalar_loss(CORE[nn].apply(fns[nn])({'params': params}, x))
    grads = {nn: jax.grad(loss)(vs['params'], nn) for nn in BACKENDS}
    assert_close(grads[lnn], grads[fnn], rtol=RTOL, atol=ATOL,
                 what='core param grads')


# -- while_loop ------------------------------------------------------------------


def _while_loop_example(nn):
  class WhileLoopExample(nn.Module):
    @nn.compact
    def __call__(self, x):
      def cond_fn(mdl, c):
        return mdl.variables['state']['acc'] < 10

      def body_fn(mdl, c):
        acc = mdl.variable('state', 'acc', lambda: jnp.array(0))
        acc.value += 1
        y = nn.Dense(c.shape[-1])(c)
        return y
      c = x
      if self.is_mutable_collection('params'):
        return body_fn(self, c)
      else:
        return nn.while_loop(cond_fn, body_fn, self, c,
                             carry_variables='state')
  return WhileLoopExample()


def test_while_loop_example():
  """The ``WhileLoopExample``: init runs the body once, apply loops until the
  carried ``state/acc`` counter reaches 10. ``lax.while_loop`` is not
  reverse-differentiable, so params are compared in forward mode (jvp)."""
  x = jnp.ones((2, 2)) * 0.5
  fv, lv = check_module(_while_loop_example, (x,), [], differentiable=False)
  assert int(fv['state']['acc']) == 1

  mods = {nn: _while_loop_example(nn) for nn in BACKENDS}
  vs = {fnn: fv, lnn: lv}
  for tag, v in (('init', vs), ('perturbed', {k: perturb(a, 0.05)
                                              for k, a in vs.items()})):
    res = {nn: mods[nn].apply(v[nn], x, mutable=['state']) for nn in BACKENDS}
    assert_close(res[lnn], res[fnn], rtol=RTOL, atol=ATOL,
                 what=f'while_loop apply ({tag})')
    assert int(res[fnn][1]['state']['acc']) == 10

    tangent = jax.tree_util.tree_map(jnp.ones_like, v[fnn]['params'])

    def fwd(params, nn, v=v):
      w = dict(v[nn])
      w['params'] = params
      return mods[nn].apply(w, x, mutable=['state'])[0]
    jvps = {nn: jax.jvp(lambda p, nn=nn: fwd(p, nn), (v[nn]['params'],),
                        (tangent,)) for nn in BACKENDS}
    assert_close(jvps[lnn], jvps[fnn], rtol=RTOL, atol=ATOL,
                 what=f'while_loop param jvp ({tag})')


# -- cond / switch ---------------------------------------------------------------


def test_cond_example():
  """The ``CondExample``: both branches share ``dense`` and count calls in
  the ``state`` collection. Completion: inputs and ``pred`` values."""
  def make(nn):
    class CondExample(nn.Module):
      @nn.compact
      def __call__(self, x, pred):
        self.variable('state', 'true_count', lambda: 0)
        self.variable('state', 'false_count', lambda: 0)

        def true_fn(mdl, x):
          mdl.variable('state', 'true_count').value += 1
          return nn.Dense(2, name='dense')(x)

        def false_fn(mdl, x):
          mdl.variable('state', 'false_count').value += 1
          return -nn.Dense(2, name='dense')(x)
        return nn.cond(pred, true_fn, false_fn, self, x)
    return CondExample()

  x = jax.random.normal(jax.random.key(6), (3, 4))
  fv, _ = check_module(
      make, (x, True),
      [(x, False), (x, jnp.array(True))],
      mutable=['state'])
  assert set(fv['params']) == {'dense'}
  assert set(fv['state']) == {'true_count', 'false_count'}


def test_switch_example():
  """The ``SwitchExample``: three branches sharing ``dense``, each counting
  its calls in the ``state`` collection."""
  def make(nn):
    class SwitchExample(nn.Module):
      @nn.compact
      def __call__(self, x, index):
        self.variable('state', 'a_count', lambda: 0)
        self.variable('state', 'b_count', lambda: 0)
        self.variable('state', 'c_count', lambda: 0)

        def a_fn(mdl, x):
          mdl.variable('state', 'a_count').value += 1
          return nn.Dense(2, name='dense')(x)

        def b_fn(mdl, x):
          mdl.variable('state', 'b_count').value += 1
          return -nn.Dense(2, name='dense')(x)

        def c_fn(mdl, x):
          mdl.variable('state', 'c_count').value += 1
          return nn.Dense(2, name='dense')(x)
        return nn.switch(index, [a_fn, b_fn, c_fn], self, x)
    return SwitchExample()

  x = jax.random.normal(jax.random.key(6), (3, 4))
  cases = [(x, jnp.array(i)) for i in range(3)]
  fv, _ = check_module(make, (x, 1), cases, mutable=['state'])
  assert set(fv['params']) == {'dense'}


def test_switch_multi_head():
  """The ``MultiHeadSwitchExample``: per-branch parameter structures, all
  created on init by running every branch before ``switch``."""
  def make(nn):
    class MultiHeadSwitchExample(nn.Module):
      def setup(self) -> None:
        self.heads = [
            nn.Sequential([nn.Dense(10), nn.Dense(7), nn.Dense(5)]),
            nn.Sequential([nn.Dense(11), nn.Dense(5)]),
            nn.Dense(5),
        ]

      @nn.compact
      def __call__(self, x, index):
        def head_fn(i):
          return lambda mdl, x: mdl.heads[i](x)
        branches = [head_fn(i) for i in range(len(self.heads))]

        # run all branches on init
        if self.is_mutable_collection('params'):
          for branch in branches:
            _ = branch(self, x)

        return nn.switch(index, branches, self, x)
    return MultiHeadSwitchExample()

  x = jax.random.normal(jax.random.key(8), (2, 3))
  cases = [(x, jnp.array(i)) for i in range(3)]
  fv, _ = check_module(make, (x, 0), cases)
  assert set(fv['params']) == {'heads_0', 'heads_1', 'heads_2'}


# -- custom_vjp ------------------------------------------------------------------


def test_custom_vjp_sign_grad():
  """The ``custom_vjp`` example: the params gradient is replaced by its sign.
  ``check_module`` compares ``jax.grad`` of a loss w.r.t. params; the
  example's own ``jax.grad(Foo().apply)(variables, x)`` is compared too."""
  def make(nn):
    class Foo(nn.Module):
      @nn.compact
      def __call__(self, x):
        def f(mdl, x):
          return mdl(x)

        def fwd(mdl, x):
          return nn.vjp(f, mdl, x)

        def bwd(vjp_fn, y_t):
          params_t, *inputs_t = vjp_fn(y_t)
          params_t = jax.tree_util.tree_map(jnp.sign, params_t)
          return (params_t, *inputs_t)

        sign_grad = nn.custom_vjp(
            f, forward_fn=fwd, backward_fn=bwd)
        return sign_grad(nn.Dense(1), x).reshape(())
    return Foo()

  x = jnp.ones((2,))
  x2 = jnp.array([0.5, -2.0])
  fv, lv = check_module(make, (x,), [(x2,)])

  grads = {fnn: jax.grad(make(fnn).apply)(fv, x),
           lnn: jax.grad(make(lnn).apply)(lv, x)}
  assert_close(grads[lnn], grads[fnn], rtol=RTOL, atol=ATOL,
               what='jax.grad(Foo().apply)')
  for g in jax.tree_util.tree_leaves(grads[fnn]):
    assert set(np.unique(np.asarray(g))) <= {-1.0, 0.0, 1.0}
  # input gradient is NOT sign-transformed: it equals the kernel
  xg = {nn: jax.grad(lambda x, nn=nn, v=v: make(nn).apply(v, x))(x2)
        for nn, v in ((fnn, fv), (lnn, lv))}
  assert_close(xg[lnn], xg[fnn], rtol=RTOL, atol=ATOL, what='input grads')
  np.testing.assert_allclose(xg[fnn], fv['params']['Dense_0']['kernel'][:, 0],
                             rtol=RTOL, atol=ATOL)


# -- named_call / add_metadata_axis (no docstring examples in the reference) ---


def test_named_call_method():
  """``named_call`` has no example in the reference; minimal use: it wraps a
  compact method, which must keep names, params, outputs and gradients."""
  def make(nn):
    class Block(nn.Module):
      @nn.named_call
      @nn.compact
      def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(3)(x)))

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Block()(x) + Block()(x)
    return Outer()

  fv, _ = check_module(make, (XB,))
  assert set(fv['params']) == {'Block_0', 'Block_1'}


def _names_and_values(tree):
  """Replaces boxed (``Partitioned``) leaves by ``(names, value)`` so trees
  boxed by flax's and liftmods' own metadata classes can be compared."""
  is_box = lambda x: hasattr(x, 'names') and hasattr(x, 'value')
  return jax.tree_util.tree_map(
      lambda x: (tuple(x.names), x.value) if is_box(x) else x, tree,
      is_leaf=is_box)


def _is_box(x):
  return hasattr(x, 'names') and hasattr(x, 'value')


def _names_only(tree):
  return [tuple(x.names) for x in
          jax.tree_util.tree_leaves(tree, is_leaf=_is_box) if _is_box(x)]


def _values_only(tree):
  return jax.tree_util.tree_map(lambda x: x.value if _is_box(x) else x, tree,
                                is_leaf=_is_box)


def test_add_metadata_axis():
  """``add_metadata_axis`` has no example in the reference; minimal use from
  its signature: add a leading ``'layers'`` axis name to the partitioning
  metadata of a ``with_partitioning`` param (the param itself is unchanged).
  The metadata key is written as the literal ``'partition_name'``."""
  def make(nn):
    class Inner(nn.Module):
      @nn.compact
      def __call__(self, x):
        k = self.param(
            'k', nn.with_partitioning(nn.initializers.lecun_normal(),
                                      ('a', 'b')), (x.shape[-1], 3))
        return x @ k

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        M = nn.add_metadata_axis(
            Inner, variable_axes={'params': 0},
            metadata_params={'partition_name': 'layers'})
        return M()(x)
    return Outer()

  mods = {nn: make(nn) for nn in BACKENDS}
  vs = {}
  for seed in SEEDS:
    res = {nn: mods[nn].init_with_output(jax.random.key(seed), XB)
           for nn in BACKENDS}
    assert_identical(_names_and_values(res[lnn][1]),
                     _names_and_values(res[fnn][1]), f'init (seed {seed})')
    assert_close(res[lnn][0], res[fnn][0], rtol=RTOL, atol=ATOL,
                 what=f'init output (seed {seed})')
    vs = {nn: r[1] for nn, r in res.items()}
  (names, _), = jax.tree_util.tree_leaves(
      _names_and_values(vs[fnn]), is_leaf=lambda x: isinstance(x, tuple))
  assert names == ('layers', 'a', 'b')
  outs = {nn: mods[nn].apply(vs[nn], XB) for nn in BACKENDS}
  assert_close(outs[lnn], outs[fnn], rtol=RTOL, atol=ATOL, what='apply output')
  grads = {nn: jax.grad(lambda p, nn=nn: scalar_loss(
      mods[nn].apply({'params': p}, XB)))(vs[nn]['params']) for nn in BACKENDS}
  assert _names_only(grads[lnn]) == _names_only(grads[fnn])
  assert_close(_values_only(grads[lnn]), _values_only(grads[fnn]),
               rtol=RTOL, atol=ATOL, what='param grads')
