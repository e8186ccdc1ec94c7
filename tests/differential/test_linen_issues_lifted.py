"""Programs with lifted transforms that flax.linen rejects or gets wrong
(flax issues), run.

Each test states the flax issue, shows what flax.linen does with the program
(raises, or computes the wrong thing), and checks liftmods' result against a
reference that Linen does compute: the program written the way Linen's
documentation recommends, the same model untransformed, or the arithmetic
written out in JAX. The table of these issues is in
docs/coming-from-linen.md ("Linen issues that work in liftmods").
"""
from typing import Any

import flax
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
from treecheck import assert_identical, normal, plain

pytestmark = pytest.mark.usefixtures('fast_compiles')

KEY = jax.random.key(0)
X = normal(0, (2, 3))


# -- flax 2200: cond / switch whose branches create different variables ------


def _heads(nn, kind, recipe=False):
  """A multi-head model: the branch picks one head; a counter counts the
  calls of the first branch. With ``recipe``, every branch first runs once
  during init, as Linen's documentation of ``switch`` says to write it."""
  class Heads(nn.Module):
    def setup(self):
      self.heads = [nn.Dense(2 + k, name=f'head{k}') for k in range(3)]
      self.calls = self.variable('counter', 'calls',
                                 lambda: jnp.zeros((), jnp.int32))

    def __call__(self, x, index):
      def first(m, x):
        m.calls.value += 1
        return m.heads[0](x).sum(-1)
      branches = [first] + [
          lambda m, x, k=k: m.heads[k](x).sum(-1) * k for k in (1, 2)]
      if kind == 'cond':
        branches = branches[:2]
      if recipe and self.is_initializing():
        for branch in branches:
          branch(self, x)
      if kind == 'cond':
        return nn.cond(index == 0, branches[0], branches[1], self, x)
      return nn.switch(index, branches, self, x)
  return Heads()


@pytest.mark.parametrize('kind', ['cond', 'switch'])
def test_2200_linen_rejects_branches_creating_different_heads(kind):
  with pytest.raises(TypeError, match='same'):
    _heads(fnn, kind).init(KEY, X, 0)


@pytest.mark.parametrize('kind', ['cond', 'switch'])
def test_2200_branches_creating_different_heads_run(kind):
  """Variables, outputs, counter updates and gradients equal Linen's for
  the program that runs every branch once during init."""
  ours, theirs = _heads(lnn, kind), _heads(fnn, kind, recipe=True)
  variables = ours.init(KEY, X, 0)
  assert_identical(variables, plain(theirs.init(KEY, X, 0)))
  assert sorted(variables['params']) == (
      ['head0', 'head1'] if kind == 'cond' else ['head0', 'head1', 'head2'])

  def loss(model, params, index):
    y, state = model.apply({**variables, 'params': params}, X, index,
                           mutable=['counter'])
    return jnp.sum(y ** 2), state

  for index in range(2 if kind == 'cond' else 3):
    assert_identical(
        jax.grad(lambda p: loss(ours, p, index), has_aux=True)(
            variables['params']),
        jax.grad(lambda p: loss(theirs, p, index), has_aux=True)(
            variables['params']))


def _vmapped_heads(nn, recipe=False):
  """flax#2200's program: one head per example, chosen by a switch under
  vmap."""
  class Multi(nn.Module):
    def setup(self):
      self.heads = [nn.Dense(2, name=f'head{k}') for k in range(3)]

    def __call__(self, x, index):
      branches = [lambda m, x, k=k: m.heads[k](x) for k in range(3)]
      if recipe and self.is_initializing():
        for branch in branches:
          branch(self, x)
      per_example = nn.vmap(
          lambda m, i, x: nn.switch(i, branches, m, x),
          variable_axes={'params': None}, split_rngs={'params': False})
      return per_example(self, index, x)
  return Multi()


def test_2200_vmapped_switch_over_heads():
  x, index = normal(2, (4, 3)), jnp.array([0, 1, 2, 1])
  with pytest.raises(TypeError, match='same'):
    _vmapped_heads(fnn).init(KEY, x, index)
  ours, theirs = _vmapped_heads(lnn), _vmapped_heads(fnn, recipe=True)
  variables = ours.init(KEY, x, index)
  assert_identical(variables, theirs.init(KEY, x, index))
  loss = lambda m: lambda p: jnp.sum(m.apply({'params': p}, x, index) ** 2)
  assert_identical(jax.value_and_grad(loss(ours))(variables['params']),
                   jax.value_and_grad(loss(theirs))(variables['params']))


def _cond_in_scan(nn, recipe=False):
  class Body(nn.Module):
    def setup(self):
      self.a, self.b = nn.Dense(3), nn.Dense(3)

    def __call__(self, c, p):
      if recipe and self.is_initializing():
        self.a(c), self.b(c)
      return nn.cond(p, lambda m, c: m.a(c), lambda m, c: m.b(c), self, c), c
  return nn.scan(Body, variable_broadcast='params',
                 split_rngs={'params': False})()


def test_2200_cond_with_different_branches_inside_scan():
  """Inside a scan body (traced twice by Linen) too: equal to Linen's
  run-every-branch-first program, rng counters included."""
  preds = jnp.array([True, False, True])
  ours, theirs = _cond_in_scan(lnn), _cond_in_scan(fnn, recipe=True)
  variables = ours.init(KEY, X, preds)
  assert_identical(variables, theirs.init(KEY, X, preds))
  assert_identical(ours.apply(variables, X, preds),
                   theirs.apply(variables, X, preds))


def test_2200_branches_still_must_agree_on_shapes():
  """A variable two branches create with different shapes cannot be made
  to work: the error names it (Linen: JAX's TypeError)."""
  class Model(lnn.Module):
    @lnn.compact
    def __call__(self, x, p):
      return lnn.cond(p, lambda m, x: lnn.Dense(3, name='a')(x),
                      lambda m, x: lnn.Dense(4, name='a')(x)[:, :3], self, x)
  with pytest.raises(lnn.errors.CondBranchVariablesError, match='"a/'):
    Model().init(KEY, X, True)


# -- nn.remat_scan over a block taking more than the carry ---------------------
# (no flax issue found; flax's FAQ, added in flax#3267, recommends
# scan(remat(...)) because remat_scan takes nothing but the carry)


def _remat_scan_block(nn, train=None, mask=None):
  """A block with dropout and a mask; with ``train``/``mask`` given they are
  attributes (what Linen's remat_scan can run), else call arguments."""
  class Body(nn.Module):
    flag: bool | None = None
    fixed_mask: jax.Array | None = None

    @nn.compact
    def __call__(self, x, *args):
      train, mask = args if args else (self.flag, self.fixed_mask)
      x = jnp.tanh(nn.Dense(3)(x)) * mask
      return nn.Dropout(0.5, deterministic=not train)(x)
  return nn.remat_scan(Body, lengths=(2, 2))(flag=train, fixed_mask=mask)


MASK = jnp.array([1., 0., 1.])
RNGS = {'params': KEY, 'dropout': jax.random.key(1)}


def test_remat_scan_linen_calls_the_block_with_the_carry_only():
  with pytest.raises(TypeError, match='positional argument'):
    _remat_scan_block(fnn).init(RNGS, X, True, MASK)


@pytest.mark.parametrize('train', [True, False])
def test_remat_scan_passes_further_arguments_to_every_block(train):
  """A Python flag (static) and an array reach every application; the
  variables, outputs (dropout keys included) and gradients equal Linen's
  remat_scan of the block holding them as attributes."""
  ours = _remat_scan_block(lnn)
  theirs = _remat_scan_block(fnn, train=train, mask=MASK)
  variables = ours.init(RNGS, X, train, MASK)
  assert_identical(variables, plain(theirs.init(RNGS, X)))

  def loss(params, model, *args):
    y = model.apply({'params': params}, X, *args,
                    rngs={'dropout': jax.random.key(2)})
    return jnp.sum(y ** 2)

  params = variables['params']
  assert_identical(jax.value_and_grad(loss)(params, ours, train, MASK),
                   jax.value_and_grad(loss)(params, theirs))


# -- nn.scan / nn.vmap stacking partitioned variables on a negative axis -------
# (no flax issue found)


def _stacked_last(nn, kind, partitioned=True):
  """Four Dense layers stacked on the last axis (``variable_axes=-1``: the
  only axis valid for both the kernel and the bias)."""
  init = nn.initializers.lecun_normal()
  if partitioned:
    init = nn.with_partitioning(init, ('embed', 'mlp'))
  meta = {nn.PARTITION_NAME: 'layers'}

  class Body(nn.Module):
    @nn.compact
    def __call__(self, c, _):
      return jnp.tanh(nn.Dense(3, kernel_init=init, name='dense')(c)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      if kind == 'scan':
        return nn.scan(Body, variable_axes={'params': -1}, length=4,
                       split_rngs={'params': True}, metadata_params=meta,
                       )(name='layers')(x, None)[0]
      return nn.vmap(Body, variable_axes={'params': -1}, in_axes=(0, None),
                     split_rngs={'params': True}, metadata_params=meta,
                     )(name='layers')(x, None)[0]
  return Model()


def _x_for(kind):
  return X if kind == 'scan' else normal(1, (4, 2, 3))


@pytest.mark.parametrize('kind', ['scan', 'vmap'])
def test_linen_names_the_negative_stacked_axis_one_place_too_early(kind):
  model, x = _stacked_last(fnn, kind), _x_for(kind)
  kernel = model.init(KEY, x)['params']['layers']['dense']['kernel']
  assert kernel.value.shape == (3, 3, 4)
  assert kernel.names == ('embed', 'layers', 'mlp')  # misaligned
  with pytest.raises(AssertionError):
    model.apply(model.init(KEY, x), x)


@pytest.mark.parametrize('kind', ['scan', 'vmap'])
def test_negative_variable_axis_names_the_stacked_axis(kind):
  """The layer axis is named where the value has it; values, outputs and
  gradients equal Linen's for the same model unpartitioned."""
  ours, x = _stacked_last(lnn, kind), _x_for(kind)
  variables = ours.init(KEY, x)
  kernel = variables['params']['layers']['dense']['kernel']
  assert kernel.value.shape == (3, 3, 4)
  assert kernel.names == ('embed', 'mlp', 'layers')
  assert tuple(lnn.get_partition_spec(variables)['params']['layers'][
      'dense']['kernel']) == ('embed', 'mlp', 'layers')
  theirs = _stacked_last(fnn, kind, partitioned=False)
  assert_identical(lnn.unbox(variables), theirs.init(KEY, x))

  def loss(model, params):
    return jnp.sum(model.apply({'params': params}, x) ** 2)
  params = lnn.unbox(variables)['params']
  assert_identical(jax.value_and_grad(lambda p: loss(ours, p))(params),
                   jax.value_and_grad(lambda p: loss(theirs, p))(params))
  assert_identical(ours.apply(variables, x), theirs.apply(
      {'params': params}, x))


# -- nn.remat with a static parameter left at its default ----------------------
# (no flax issue found; jax.checkpoint fails alike, jax-ml/jax#18405)


def _remat_flag_block(nn):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
      x = nn.Dense(3)(x)
      if not deterministic:
        x = nn.Dropout(0.5, deterministic=False)(x)
      return jnp.tanh(x)
  return nn.remat(Block, static_argnums=(2,))()


def test_remat_static_parameter_left_at_its_default():
  """Linen hands jax.checkpoint a static position past the arguments given
  (ValueError); liftmods leaves the default in place, giving Linen's
  results for the call that passes it, gradients included."""
  with pytest.raises(ValueError, match='static_argnums'):
    _remat_flag_block(fnn).init(KEY, X)

  ours, theirs = _remat_flag_block(lnn), _remat_flag_block(fnn)
  variables = ours.init(KEY, X)
  assert_identical(variables, theirs.init(KEY, X, True))
  assert_identical(
      jax.value_and_grad(lambda p: jnp.sum(ours.apply({'params': p}, X)))(
          variables['params']),
      jax.value_and_grad(lambda p: jnp.sum(theirs.apply(
          {'params': p}, X, True)))(variables['params']))


# -- nn.jit of a module holding a jax.Array field -------------------------------
# (no flax issue found)


def _offset_dense(nn):
  class OffsetDense(nn.Module):
    offset: Any

    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(x) + self.offset
  return nn.jit(OffsetDense)


def test_jit_of_a_module_with_an_array_field():
  """Linen fingerprints the field by iterating it (TypeError on a scalar
  array); liftmods keys it by identity. Two offsets give two results, each
  Linen's for the offset given as a (hashable) Python float."""
  with pytest.raises(TypeError, match='0-d array'):
    _offset_dense(fnn)(jnp.float32(1.)).init(KEY, X)
  for offset in (1., -2.):
    ours = _offset_dense(lnn)(jnp.float32(offset))
    reference = _offset_dense(fnn)(offset)
    variables = ours.init(KEY, X)
    assert_identical(variables, reference.init(KEY, X))
    assert_identical(ours.apply(variables, X), reference.apply(variables, X))


# -- nn.jit called again under a method interceptor ----------------------------
# (no flax issue found)


def _double_dense_outputs(next_fun, args, kwargs, context):
  y = next_fun(*args, **kwargs)
  return y * 2 if type(context.module).__name__ == 'Dense' else y


def test_jit_sees_an_interceptor_added_after_the_first_call():
  """Linen's compile cache ignores the active interceptors: a second call
  under nn.intercept_methods silently returns the first call's result.
  liftmods keys the cache on them and returns what the unjitted module
  computes under the interceptor."""
  def run(nn, variables, jit=True):
    model = (nn.jit(nn.Dense) if jit else nn.Dense)(3)
    plain_y = model.apply(variables, X)
    with nn.intercept_methods(_double_dense_outputs):
      return plain_y, model.apply(variables, X)

  variables = lnn.jit(lnn.Dense)(3).init(KEY, X)
  assert_identical(variables, fnn.jit(fnn.Dense)(3).init(KEY, X))
  plain_y, intercepted = run(fnn, variables)
  assert_identical(intercepted, plain_y)  # Linen: the interceptor is lost
  ours = run(lnn, variables)
  assert_identical(ours, run(fnn, variables, jit=False))
  assert_identical(ours[1], 2 * ours[0])


# -- nn.scan with None in in_axes, as in vmap ----------------------------------
# (no flax issue found)


def _masked_rnn(nn, not_scanned):
  class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, x, mask):
      c = jnp.tanh(nn.Dense(3)(c) + x * mask)
      return c, c

  class Model(nn.Module):
    @nn.compact
    def __call__(self, c, xs, mask):
      return nn.scan(Cell, variable_broadcast='params',
                     split_rngs={'params': False},
                     in_axes=(0, not_scanned))(name='cell')(c, xs, mask)
  return Model()


def test_scan_in_axes_none_is_not_scanned():
  """Linen rejects None (a pytree structure error); liftmods reads it as
  vmap does, giving Linen's results for nn.broadcast, gradients included."""
  xs, mask = normal(3, (5, 2, 3)), jnp.array([1., 0., 1.])
  with pytest.raises(ValueError, match='pytree structure'):
    _masked_rnn(fnn, None).init(KEY, X, xs, mask)
  ours, theirs = _masked_rnn(lnn, None), _masked_rnn(fnn, fnn.broadcast)
  variables = ours.init(KEY, X, xs, mask)
  assert_identical(variables, theirs.init(KEY, X, xs, mask))
  loss = lambda m: lambda p: jnp.sum(
      m.apply({'params': p}, X, xs, mask)[1] ** 2)
  assert_identical(jax.value_and_grad(loss(ours))(variables['params']),
                   jax.value_and_grad(loss(theirs))(variables['params']))


# -- flax 2772: a vmapped / scanned module called with keyword arguments -------


def _batch_dense(nn):
  return nn.vmap(nn.Dense, in_axes=0, out_axes=0,
                 variable_axes={'params': 0}, split_rngs={'params': True})(3)


def _keyword_rnn(nn):
  class Cell(nn.Module):
    @nn.compact
    def __call__(self, carry, x, scale=1.):
      carry = jnp.tanh(nn.Dense(3)(carry) + x * scale)
      return carry, carry
  return nn.scan(Cell, variable_broadcast='params',
                 split_rngs={'params': False})()


def test_2772_linen_drops_keyword_arguments_of_vmap_and_scan():
  """The dropped arguments leave nothing to map over."""
  x, xs = normal(4, (4, 3)), normal(5, (5, 2, 3))
  with pytest.warns(RuntimeWarning, match='kwargs are not supported'):
    with pytest.raises(ValueError, match='axis_size should be specified'):
      _batch_dense(fnn).init(KEY, inputs=x)
  with pytest.warns(RuntimeWarning, match='kwargs are not supported'):
    with pytest.raises(ValueError, match='length should be specified'):
      _keyword_rnn(fnn).init(KEY, X, x=xs)


def test_2772_required_keyword_arguments_take_their_position():
  """A keyword argument for a required parameter is passed at its position
  (so in_axes applies to it): variables, outputs and gradients equal
  Linen's positional call. One with a default is still dropped with
  Linen's warning."""
  x, xs = normal(4, (4, 3)), normal(5, (5, 2, 3))
  variables = _batch_dense(lnn).init(KEY, inputs=x)
  assert_identical(variables, _batch_dense(fnn).init(KEY, x))
  loss = lambda m, *a, **k: lambda p: jnp.sum(
      jax.tree.leaves(m.apply({'params': p}, *a, **k))[-1] ** 2)
  assert_identical(
      jax.value_and_grad(loss(_batch_dense(lnn), inputs=x))(
          variables['params']),
      jax.value_and_grad(loss(_batch_dense(fnn), x))(variables['params']))

  variables = _keyword_rnn(lnn).init(KEY, X, x=xs)
  assert_identical(variables, _keyword_rnn(fnn).init(KEY, X, xs))
  assert_identical(
      jax.value_and_grad(loss(_keyword_rnn(lnn), X, x=xs))(
          variables['params']),
      jax.value_and_grad(loss(_keyword_rnn(fnn), X, xs))(variables['params']))
  with pytest.warns(RuntimeWarning, match='scale'):
    ours = _keyword_rnn(lnn).apply(variables, X, xs, scale=2.)
  assert_identical(ours, _keyword_rnn(fnn).apply(variables, X, xs))


# -- flax 2052: a scan whose body creates its carried variables --------------


def _bn_block(nn, dropout=False):
  class Block(nn.Module):
    """BatchNorm statistics and a call counter carried through the loop."""
    @nn.compact
    def __call__(self, c, x):
      h = nn.Dense(4)(x)
      h = nn.BatchNorm(use_running_average=False)(h)
      calls = self.variable('batch_stats', 'calls',
                            lambda: jnp.zeros((), jnp.int32))
      calls.value += 1
      if dropout:
        h = nn.Dropout(0.5, deterministic=False)(h)
      y = nn.Dense(2)(h) * calls.value
      return c + y.sum(), y
  return Block


def _scanned(nn, reverse=False, dropout=False, split=False):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, xs):
      loop = nn.scan(_bn_block(nn, dropout), variable_carry='batch_stats',
                     variable_broadcast='params',
                     split_rngs={'params': False, 'dropout': split},
                     reverse=reverse)
      c, ys = loop(name='loop')(0.0, xs)
      return c, ys
  return Net()


def _python_loop(nn, reverse=False):
  """The reference: the block called once per row, in a Python loop."""
  class Net(nn.Module):
    @nn.compact
    def __call__(self, xs):
      block = _bn_block(nn)(name='loop')
      c, ys = 0.0, [None] * xs.shape[0]
      rows = range(xs.shape[0])
      for i in reversed(rows) if reverse else rows:
        c, ys[i] = block(c, xs[i])
      return c, jnp.stack(ys)
  return Net()


XS = normal(3, (3, 5, 2))


def test_2052_linen_rejects_a_scan_that_creates_its_carried_variables():
  with pytest.raises(TypeError, match='carry'):
    _scanned(fnn).init(KEY, XS)


@pytest.mark.parametrize('reverse', [False, True])
@pytest.mark.parametrize('rows', [1, 3])
def test_2052_scan_creating_its_carried_variables_equals_a_python_loop(
    reverse, rows):
  xs = XS[:rows]
  out, variables = jax.jit(_scanned(lnn, reverse).init_with_output)(KEY, xs)
  want_out, want = jax.jit(_python_loop(lnn, reverse).init_with_output)(
      KEY, xs)
  assert_identical(variables, want)  # created once, then counted per row
  assert int(variables['batch_stats']['loop']['calls']) == rows
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
      out, want_out)
  # Training steps then run the ordinary loop, still equal to the reference.
  got, stats = _scanned(lnn, reverse).apply(variables, xs,
                                            mutable='batch_stats')
  ref, ref_stats = _python_loop(lnn, reverse).apply(variables, xs,
                                                    mutable='batch_stats')
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      (got, stats), (ref, ref_stats))
  assert int(stats['batch_stats']['loop']['calls']) == 2 * rows


@pytest.mark.parametrize('split', [False, True])
def test_2052_init_output_equals_apply_from_the_initial_variables(split):
  """Dropout keys of the first iteration are those the loop would draw:
  init's output is apply's on the same rngs, starting from the created
  values (before the loop counted)."""
  net = _scanned(lnn, dropout=True, split=split)
  rngs = {'params': KEY, 'dropout': jax.random.key(1)}
  out, variables = net.init_with_output(rngs, XS)
  start = {'params': variables['params'], 'batch_stats': jax.tree_util.tree_map(
      jnp.zeros_like, variables['batch_stats'])}
  start['batch_stats']['loop']['BatchNorm_0']['var'] = jnp.ones((4,))
  again, _ = net.apply(start, XS, rngs={'dropout': jax.random.key(1)},
                       mutable='batch_stats')
  assert_identical(again, out)


def test_2052_a_carried_variable_changing_shape_still_raises():
  """Only creation is run outside the loop; a carried variable that
  changes shape is refused as before."""
  class Grow(lnn.Module):
    @lnn.compact
    def __call__(self, c, x):
      n = self.variable('batch_stats', 'n', lambda: jnp.zeros((1,)))
      n.value = jnp.concatenate([n.value, n.value])
      return c, x

  class Outer(lnn.Module):
    @lnn.compact
    def __call__(self, xs):
      return lnn.scan(Grow, variable_carry='batch_stats')(name='g')(0.0, xs)
  with pytest.raises(lnn.errors.ScanCarryError, match='shape'):
    Outer().init(KEY, XS)


# -- the while_loop analogue: a loop body that creates variables -------------


def _while(nn, python=False):
  class Looper(nn.Module):
    def setup(self):
      self.dense = nn.Dense(3)

    @nn.compact
    def __call__(self, x):
      def cond(mdl, c):
        return c[0] < 3

      def body(mdl, c):
        n = mdl.variable('state', 'n', lambda: jnp.zeros((), jnp.int32))
        n.value += 1
        return c[0] + 1, mdl.dense(c[1]) * 0.5
      if not python:
        return nn.while_loop(cond, body, self, (0, x),
                             carry_variables='state')
      carry = (0, x)
      n = self.variable('state', 'n', lambda: jnp.zeros((), jnp.int32))
      while carry[0] < 3:
        n.value += 1
        carry = carry[0] + 1, self.dense(carry[1]) * 0.5
      return carry

  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Looper(name='looper')(x)
  return Outer()


def test_linen_rejects_a_while_loop_whose_body_creates_variables():
  with pytest.raises(flax.errors.ScopeCollectionNotFound):
    _while(fnn).init(KEY, X)


def test_while_loop_creating_its_variables_equals_a_python_loop():
  (_, got), variables = jax.jit(_while(lnn).init_with_output)(KEY, X)
  (_, want), want_variables = _while(lnn, python=True).init_with_output(KEY,
                                                                        X)
  assert_identical((got, variables), (want, want_variables))  # bit for bit
  assert int(variables['state']['looper']['n']) == 3
  (_, got), counted = _while(lnn).apply(variables, X, mutable='state')
  (_, want), want_counted = _while(lnn, python=True).apply(
      variables, X, mutable='state')
  assert_identical((got, counted), (want, want_counted))
  assert int(counted['state']['looper']['n']) == 6


def test_while_loop_that_never_runs_still_creates_its_variables():
  """As before the first test of the condition: created, never updated."""
  class Never(lnn.Module):
    @lnn.compact
    def __call__(self, x):
      def body(mdl, c):
        n = mdl.variable('state', 'n', lambda: jnp.zeros((), jnp.int32))
        n.value += 1
        return lnn.Dense(3, name='d')(c)
      return lnn.while_loop(lambda mdl, c: False, body, self, x,
                            carry_variables='state')
  out, variables = Never().init_with_output(KEY, X)
  assert_identical(out, X)
  assert int(variables['state']['n']) == 0
  assert variables['params']['d']['kernel'].shape == (3, 3)


def _setup_param_loop(nn, python=False, sow=False):
  class Looper(nn.Module):
    def setup(self):
      self.w = self.param('w', nn.initializers.lecun_normal(), (3, 3))

    def __call__(self, x):
      def body(mdl, c):
        if sow:
          mdl.sow('intermediates', 'h', c[1])
        return c[0] + 1, c[1] @ mdl.w
      if python:
        carry = (0, x)
        while carry[0] < 2:
          carry = body(self, carry)
        return carry[1]
      return nn.while_loop(lambda mdl, c: c[0] < 2, body, self, (0, x),
                           carry_variables='intermediates')[1]
  return Looper()


def test_while_loop_sowing_into_its_carry_says_so_with_a_setup_param():
  """Found by the linen fuzz family (seed 53337, jax 0.12): a sow into the
  carried collection sends the loop to its run before the loop, which ran
  the condition and the body on one scope, so a module whose setup
  declares a parameter declared it twice there: NameInUseError, about a
  name nobody reused. The body now runs on the same variables with its
  names free, as in the loop, and the error is the documented one (Linen
  raises JAX's TypeError: the carry changes structure)."""
  got, variables = jax.jit(_setup_param_loop(lnn).init_with_output)(KEY, X)
  want, want_variables = _setup_param_loop(fnn).init_with_output(KEY, X)
  assert_identical((got, variables), (want, plain(want_variables)))
  python = _setup_param_loop(lnn, python=True).apply(variables, X)
  assert_identical(_setup_param_loop(lnn).apply(variables, X), python)
  with pytest.raises(TypeError, match='same pytree structure'):
    _setup_param_loop(fnn, sow=True).apply(variables, X,
                                           mutable='intermediates')
  with pytest.raises(lnn.errors.WhileLoopInitError,
                     match='a sow adds on every iteration'):
    _setup_param_loop(lnn, sow=True).apply(variables, X,
                                           mutable='intermediates')
