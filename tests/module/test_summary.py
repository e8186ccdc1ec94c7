"""Tests of liftmods.summary.tabulate: rows, variables, totals, depth,
the call-recording hook it uses, and agreement with flax.linen."""
import inspect
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
from liftmods import summary
from liftmods.module import Module


def make_model(nn):
  """The same model source for liftmods and (as the oracle) flax.linen."""

  class Dense(nn.Module):
    features: int
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
      w = self.param('kernel', jax.nn.initializers.lecun_normal(),
                     (x.shape[-1], self.features), self.dtype)
      b = self.param('bias', jax.nn.initializers.zeros, (self.features,),
                     self.dtype)
      return x @ w.astype(x.dtype) + b.astype(x.dtype)

  class Norm(nn.Module):

    @nn.compact
    def __call__(self, x):
      mean = self.variable('batch_stats', 'mean', jnp.zeros, x.shape[-1:])
      count = self.variable('batch_stats', 'count',
                            lambda: jnp.zeros((), jnp.int32))
      scale = self.param('scale', jax.nn.initializers.ones, x.shape[-1:])
      if self.is_mutable_collection('batch_stats'):
        count.value += 1
      return (x - mean.value) * scale

  class Block(nn.Module):  # nested: block/inner/Dense_0, block/Norm_0

    @nn.compact
    def __call__(self, x):
      h = Inner(name='inner')(x)
      return Norm()(h)

  class Inner(nn.Module):

    @nn.compact
    def __call__(self, x):
      return jax.nn.relu(Dense(64, dtype=jnp.bfloat16)(x))

  class Model(nn.Module):

    def setup(self):
      self.embed = Dense(16)
      self.block = Block()
      self.head = Dense(3)

    def __call__(self, x, train: bool = True):
      h = self.embed(x)
      h = self.block(h)
      h = self.embed(h[..., :x.shape[-1]])  # embed is called twice
      return self.head(h), {'hidden': h}

    def encode(self, x):
      return self.embed(x)

  return Model


Model = make_model(lnn)
X = jnp.ones((2, 5))
KEY = jax.random.key(0)


# -- helpers -------------------------------------------------------------------


def parse_rows(table: str) -> list:
  """The rows (header, body rows, total row) of a box-drawn table (ours or
  rich's), each a list of cell texts (lines joined with '\\n')."""
  rows, current = [], []
  for line in table.splitlines():
    if line[:1] in ('│', '┃'):
      cells = [c.strip() for c in line.strip()[1:-1].split(line[0])]
      current = current or [[] for _ in cells]
      for acc, c in zip(current, cells):
        acc.append(c)
    elif line[:1] in '┌┏╞┡├└' and line:
      if current:
        rows.append(['\n'.join(c).strip('\n') for c in current])
      current = []
  return rows


def rows_by_path(table: str) -> dict:
  header, *body, total = parse_rows(table)
  return header, {r[0]: dict(zip(header, r)) for r in body}, dict(
      zip(header, total))


def size_bytes(tree):
  leaves = jax.tree_util.tree_leaves(tree)
  return (sum(int(np.size(x)) for x in leaves),
          sum(int(np.size(x)) * np.dtype(x.dtype).itemsize for x in leaves))


def human(num_bytes):
  if num_bytes > 1e6:
    return f'{num_bytes / 1e6:,.1f} MB'
  if num_bytes > 1e3:
    return f'{num_bytes / 1e3:,.1f} KB'
  return f'{num_bytes:,} B'


def count_in(cell: str):
  """The 'N (X B)' count at the end of a variables cell, as (N, text)."""
  m = re.search(r'([\d,]+) \(([^)]*)\)$', cell)
  return (int(m.group(1).replace(',', '')), m.group(2)) if m else (0, None)


@pytest.fixture(scope='module')
def variables():
  return jax.jit(Model().init)(KEY, X)


@pytest.fixture(scope='module')
def table():
  return Model().tabulate(KEY, X)


# -- rows and variables --------------------------------------------------------


def test_one_row_per_module_with_class_names(table):
  header, rows, _ = rows_by_path(table)
  assert header[:4] == ['path', 'module', 'inputs', 'outputs']
  assert header[4:] == ['params', 'batch_stats']
  assert {p: r['module'] for p, r in rows.items()} == {
      '': 'Model', 'embed': 'Dense', 'block': 'Block',
      'block/inner': 'Inner', 'block/inner/Dense_0': 'Dense',
      'block/Norm_0': 'Norm', 'head': 'Dense'}
  # pre-order (call order), the repeated call of embed shown once
  assert [r[0] for r in parse_rows(table)[1:-1]] == [
      '', 'embed', 'block', 'block/inner', 'block/inner/Dense_0',
      'block/Norm_0', 'head']
  assert table.splitlines()[0].strip() == 'Model Summary'


def test_inputs_and_outputs(table):
  _, rows, _ = rows_by_path(table)
  assert rows['']['inputs'] == 'float32[2,5]'
  assert rows['']['outputs'].splitlines() == [
      '- float32[2,3]', '- hidden: float32[2,16]']
  assert rows['block/inner/Dense_0']['outputs'] == 'float32[2,64]'
  t = Model().tabulate(KEY, X, train=False)
  assert rows_by_path(t)[1]['']['inputs'].splitlines() == [
      '- float32[2,5]', '- train: False']


def test_per_variable_shapes_and_row_counts(table, variables):
  _, rows, _ = rows_by_path(table)
  p, bs = variables['params'], variables['batch_stats']
  dense = rows['block/inner/Dense_0']['params']
  assert 'bias: bfloat16[64]' in dense and 'kernel: bfloat16[16,64]' in dense
  assert count_in(dense) == (16 * 64 + 64, human((16 * 64 + 64) * 2))
  assert 'kernel: float32[5,16]' in rows['embed']['params']
  assert 'kernel: float32[16,3]' in rows['head']['params']
  norm = rows['block/Norm_0']
  assert 'scale: float32[64]' in norm['params']
  assert 'count: int32[]' in norm['batch_stats']
  assert 'mean: float32[64]' in norm['batch_stats']
  assert count_in(norm['batch_stats']) == (65, human(65 * 4))
  # modules without own variables show no counts
  assert rows['']['params'] == rows['block']['params'] == ''
  # each row counts exactly its own variables
  for path, sub in [('embed', p['embed']), ('head', p['head']),
                    ('block/inner/Dense_0', p['block']['inner']['Dense_0']),
                    ('block/Norm_0', p['block']['Norm_0'])]:
    assert count_in(rows[path]['params'])[0] == size_bytes(sub)[0]
  assert count_in(norm['batch_stats'])[0] == size_bytes(bs)[0]


def test_totals_match_init_variables(table, variables):
  _, rows, total = rows_by_path(table)
  assert total['outputs'] == 'Total'
  grand = [0, 0]
  for col in ('params', 'batch_stats'):
    n, b = size_bytes(variables[col])
    grand[0] += n
    grand[1] += b
    assert total[col] == f'{n:,} ({human(b)})'
    assert sum(count_in(r[col])[0] for r in rows.values()) == n
  n_params = 5 * 16 + 16 + 16 * 64 + 64 + 64 + 16 * 3 + 3
  assert size_bytes(variables['params'])[0] == n_params
  assert grand == [n_params + 65, (n_params - 16 * 64 - 64) * 4
                   + (16 * 64 + 64) * 2 + 65 * 4]
  caption = table.strip().splitlines()[-1].strip()
  assert caption == f'Total Parameters: {grand[0]:,} ({human(grand[1])})'
  assert caption == 'Total Parameters: 1,364 (3.3 KB)'


def test_depth_collapses_rows_into_ancestors(variables):
  for depth, paths in [(1, ['', 'embed', 'block', 'head']), (0, [''])]:
    t = Model().tabulate(KEY, X, depth=depth)
    _, rows, total = rows_by_path(t)
    assert list(rows) == paths
    for col in ('params', 'batch_stats'):
      assert sum(count_in(r[col])[0] for r in rows.values()) == size_bytes(
          variables[col])[0]
      assert total[col] == rows_by_path(Model().tabulate(KEY, X))[2][col]
  _, rows, _ = rows_by_path(Model().tabulate(KEY, X, depth=1))
  assert count_in(rows['block']['params'])[0] == size_bytes(
      variables['params']['block'])[0]
  assert count_in(rows['block']['batch_stats'])[0] == 65
  assert 'kernel' not in rows['block']['params']  # only its own variables
  _, rows, _ = rows_by_path(Model().tabulate(KEY, X, depth=2))
  assert 'block/inner' in rows and 'block/inner/Dense_0' not in rows


def test_show_repeated_and_methods():
  t = Model().tabulate(KEY, X, show_repeated=True)
  paths = [r[0] for r in parse_rows(t)[1:-1]]
  assert paths.count('embed') == 2
  second = [r for r in parse_rows(t)[1:-1] if r[0] == 'embed'][1]
  assert second[2] == 'float32[2,5]' and second[4] == ''  # no double count
  t = Model().tabulate(KEY, X, method='encode')
  _, rows, _ = rows_by_path(t)
  assert rows['']['module'] == 'Model (encode)'
  assert list(rows) == ['', 'embed']


def test_mutable_and_extra_collections():

  class Sower(lnn.Module):

    @lnn.compact
    def __call__(self, x):
      self.sow('intermediates', 'x2', x * 2)
      return x

  assert 'intermediates' not in Sower().tabulate(KEY, X)
  header, rows, _ = rows_by_path(Sower().tabulate(KEY, X, mutable=True))
  assert 'intermediates' in header
  assert 'x2:\n- float32[2,5]' in rows['']['intermediates']


def test_abstract_inputs_and_partitioned_metadata():

  class P(lnn.Module):

    @lnn.compact
    def __call__(self, x):
      init = lnn.with_partitioning(jax.nn.initializers.ones, (None, 'model'))
      return x @ self.param('w', init, (x.shape[-1], 4))

  t = P().tabulate(KEY, jax.ShapeDtypeStruct((7, 3), jnp.float16))
  _, rows, _ = rows_by_path(t)
  assert rows['']['inputs'] == 'float16[7,3]'
  assert "w: float32[3,4] P(None, 'model')" in rows['']['params']
  assert count_in(rows['']['params']) == (12, '48 B')


def test_flops_columns():
  t = Model().tabulate(KEY, X, depth=1, compute_flops=True,
                       compute_vjp_flops=True)
  header, rows, total = rows_by_path(t)
  assert header[4:6] == ['flops', 'vjp_flops']
  assert total['vjp_flops'] == 'Total'
  for r in rows.values():
    assert int(r['flops']) > 0 and int(r['vjp_flops']) > int(r['flops'])
  # a 2x5 @ 5x16 matmul plus bias: about 2*2*5*16 + 2*16 flops
  assert 2 * 2 * 5 * 16 <= int(rows['embed']['flops']) <= 4 * 2 * 5 * 16


def test_table_options_and_module_method_routing():
  params = inspect.signature(summary.tabulate).parameters
  options = {n for n, p in params.items()
             if p.kind is p.POSITIONAL_OR_KEYWORD} - {'module', 'rngs'}
  assert set(summary.TABULATE_OPTIONS) == options
  t = Model().tabulate(KEY, X, table_kwargs={'title': 'Mine', 'box': None},
                       column_kwargs={'justify': 'right'},
                       console_kwargs={'width': 40})
  assert t.splitlines()[0].strip() == 'Mine'
  assert '│  Model │' in t and '│  float32[2,5] │' in t
  fn = summary.tabulate(Model(), KEY, depth=0)
  assert fn(X) == Model().tabulate(KEY, X, depth=0)


# -- interception is scoped ----------------------------------------------------


def test_call_wrapped_method_restored_and_init_unaffected(variables):
  original = Module.__dict__['_call_wrapped_method']
  Model().tabulate(KEY, X)
  assert Module.__dict__['_call_wrapped_method'] is original

  class Boom(lnn.Module):

    @lnn.compact
    def __call__(self, x):
      self.param('w', jax.nn.initializers.ones, (2,))
      raise RuntimeError('boom')

  with pytest.raises(RuntimeError, match='boom'):
    Boom().tabulate(KEY, X)
  assert Module.__dict__['_call_wrapped_method'] is original
  again = jax.jit(Model().init)(KEY, X)
  jax.tree_util.tree_map(np.testing.assert_array_equal, again, variables)
  out, state = jax.jit(lambda v: Model().apply(v, X, mutable=['batch_stats']))(
      again)
  assert out[0].shape == (2, 3)
  assert state['batch_stats']['block']['Norm_0']['count'] == 2  # init: 1


def test_concurrent_tabulate_records_per_thread():
  original = Module.__dict__['_call_wrapped_method']
  expected = Model().tabulate(KEY, X)
  results, barrier = [None] * 4, threading.Barrier(5)

  def work(i):
    barrier.wait()
    results[i] = Model().tabulate(KEY, X)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  barrier.wait()
  jax.eval_shape(Model().init, KEY, X)  # an untabulated init meanwhile
  for t in threads:
    t.join()
  assert results == [expected] * 4
  assert Module.__dict__['_call_wrapped_method'] is original


# -- against flax.linen --------------------------------------------------------


def flax_table(**kwargs):
  linen = pytest.importorskip('flax.linen')
  out = make_model(linen)().tabulate(
      KEY, X, console_kwargs={'width': 300, 'force_terminal': False},
      **kwargs)
  return re.sub(r'\x1b\[[0-9;]*m', '', out)


def total_parameters(text):
  m = re.search(r'Total Parameters: ([\d,]+) \(([^)]*)\)', text)
  return int(m.group(1).replace(',', '')), m.group(2)


@pytest.mark.parametrize('kwargs', [
    {}, {'depth': 1}, {'depth': 0}, {'train': False, 'show_repeated': True},
    {'method': 'encode'}], ids=str)
def test_matches_flax_linen(kwargs):
  ours = Model().tabulate(KEY, X, **kwargs)
  theirs = flax_table(**kwargs)
  assert total_parameters(ours) == total_parameters(theirs)
  assert total_parameters(ours)[0] == (96 if 'method' in kwargs else 1364)
  ours_paths = [r[0] for r in parse_rows(ours)[1:-1]]
  assert ours_paths == [r[0] for r in parse_rows(theirs)[1:-1]]
  ours_header, ours, ours_total = rows_by_path(ours)
  theirs_header, theirs, theirs_total = rows_by_path(theirs)
  assert set(ours_header) == set(theirs_header)
  collections = set(ours_header) - {'path', 'module', 'inputs', 'outputs'}
  assert collections == ({'params'} if 'method' in kwargs else
                         {'params', 'batch_stats'})
  for path, row in ours.items():
    for col in ('module', 'inputs', 'outputs'):
      assert row[col] == theirs[path][col], (path, col)
    for col in collections:
      assert count_in(row[col]) == count_in(theirs[path][col]), (path, col)
      assert ours_total[col] == theirs_total[col]


def test_record_calls_hook():
  from liftmods import call_context

  class Child(lnn.Module):

    def setup(self):
      self.dense = lnn.Dense(2)

    def __call__(self, x):
      return self.dense(x)

  class Parent(lnn.Module):

    @lnn.compact
    def __call__(self, x):
      return Child(name='child')(x)

  with lnn.module.record_calls() as outer:
    with call_context.record_calls() as inner:
      variables = Parent().init(KEY, X)
    Parent().apply(variables, X)
  assert call_context.calls.recording is None
  # parents first, no setup calls, arrays kept as ShapeDtypeStructs
  assert [(c.path, c.method) for c in inner] == [
      ((), '__call__'), (('child',), '__call__'),
      (('child', 'dense'), '__call__')]
  assert inner[0].args == (jax.ShapeDtypeStruct(X.shape, X.dtype),)
  assert inner[-1].outputs == jax.ShapeDtypeStruct((X.shape[0], 2), X.dtype)
  assert [c.path for c in outer] == [c.path for c in inner]  # apply only


def _layers_model(nn):
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))
      x = nn.GroupNorm(num_groups=2)(x)
      return nn.Dropout(0.5, deterministic=False)(x)
  return Model()


@pytest.mark.parametrize('kwargs', [{}, {'show_repeated': True}], ids=str)
def test_layer_helpers_are_not_rows(kwargs):
  """BatchNorm, GroupNorm and Dropout's private helpers are not module
  calls: the table has Linen's rows, one per layer."""
  linen = pytest.importorskip('flax.linen')
  keys = {'params': KEY, 'dropout': KEY}
  ours = _layers_model(lnn).tabulate(keys, X, **kwargs)
  theirs = re.sub(r'\x1b\[[0-9;]*m', '', _layers_model(linen).tabulate(
      keys, X, console_kwargs={'width': 300, 'force_terminal': False},
      **kwargs))
  assert ([r[:2] for r in parse_rows(ours)[1:-1]] ==
          [r[:2] for r in parse_rows(theirs)[1:-1]] ==
          [['', 'Model'], ['Dense_0', 'Dense'], ['BatchNorm_0', 'BatchNorm'],
           ['GroupNorm_0', 'GroupNorm'], ['Dropout_0', 'Dropout']])


def _wrapped_methods(cls):
  # dunders aside (Linen on Python 3.13 also wraps dataclasses' __replace__)
  return {k for c in cls.__mro__ for k, v in c.__dict__.items()
          if getattr(v, 'method_handler_wrapped', False)
          and (k == '__call__' or not k.startswith('__'))}


def test_layers_wrap_the_methods_linen_wraps():
  """A wrapped method is a module call (a tabulate row, an interceptor
  call): each layer wraps exactly the methods its Linen namesake does."""
  linen = pytest.importorskip('flax.linen')
  checked = 0
  for name in dir(linen):
    theirs, ours = getattr(linen, name), getattr(lnn, name, None)
    if (inspect.isclass(ours) and issubclass(ours, Module)
        and ours.__module__.startswith(('liftmods.layers',
                                        'liftmods.fp8_ops'))):
      assert _wrapped_methods(ours) == _wrapped_methods(theirs), name
      checked += 1
  assert checked > 20


def _flops_model(nn):
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
      x = nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(x))
      x = nn.Dropout(0.5, deterministic=not train)(x)
      return nn.SelfAttention(num_heads=2)(x[:, None, :])
  return Model()


def test_flops_columns_equal_linens():
  """Both FLOP columns, row by row, are Linen's: the VJP counts the pullback
  of the output and the updated state, and the rngs are arguments of the
  compiled call."""
  linen = pytest.importorskip('flax.linen')
  from flax.linen import summary as linen_summary
  keys = {'params': KEY, 'dropout': jax.random.key(1)}

  def rows(nn, table_fn):
    table = table_fn(_flops_model(nn), depth=None, show_repeated=False,
                     compute_flops=True, compute_vjp_flops=True)(keys, X)
    return [(r.path, r.method, r.flops, r.vjp_flops) for r in table]

  ours = rows(lnn, summary._get_module_table)
  assert ours == rows(linen, linen_summary._get_module_table)
  assert len(ours) == 9 and all(r[2] > 0 and r[3] > r[2] for r in ours)


def _module_argument_model(nn):
  class Apply(nn.Module):
    @nn.compact
    def __call__(self, layer, x):
      return layer(x)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Apply()(nn.Dense(2), x)
  return Model()


def test_flops_of_a_call_taking_a_module_equal_linens():
  """A module passed as an argument keeps its variables, which are inputs
  but not differentiated (liftmods raised InvalidRngError here)."""
  linen = pytest.importorskip('flax.linen')
  from flax.linen import summary as linen_summary

  def rows(nn, table_fn):
    table = table_fn(_module_argument_model(nn), depth=None,
                     show_repeated=False, compute_flops=True,
                     compute_vjp_flops=True)(KEY, X)
    return [(r.path, r.flops, r.vjp_flops) for r in table]

  ours = rows(lnn, summary._get_module_table)
  assert ours == rows(linen, linen_summary._get_module_table)
  assert [r[0] for r in ours] == [(), ('Apply_0',), ('Dense_0',)]
