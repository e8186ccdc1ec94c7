"""Linen's private names that public code imports, and Linen's Row, Table and
LazyRng, on liftmods as on Linen.

``SURVEY`` is what a search of public Linen code on GitHub found imported
from Linen's submodules (``from flax.linen.<sub> import _...``,
``nn.<sub>._...``, ``module_lib._...``): each name is either provided, with
Linen's meaning (checked here against flax on the same inputs), or listed
with the reason it is not. sbx's BatchRenorm, for one, imports
``_canonicalize_axes``, ``_compute_stats`` and ``_normalize`` from
``flax.linen.normalization``.
"""
import importlib

import flax.core.scope as flax_scope
import flax.linen
import flax.linen.normalization as linen_norm
import flax.linen.summary as linen_summary
import flax.linen.transforms as linen_transforms
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods
from liftmods import compat

_RECORD = ("reads Linen's _CallInfo records of calls (its module, rngs, "
           "mutable and index), which liftmods' call recording does not make; "
           'liftmods.summary.module_table and module_calls give the rows and '
           'calls')
_NOT_IN_LINEN = 'no longer in Linen (flax 0.12 has no such name)'

# {submodule: {name: None (provided) or why not}}: every private name the
# survey found, once.
SURVEY = {
    'normalization': {
        '_canonicalize_axes': None, '_compute_stats': None,
        '_normalize': None, '_abs_sq': None, '_l2_normalize': None,
        '_absolute_dims': _NOT_IN_LINEN,
    },
    'summary': {
        '_get_module_table': None, '_process_inputs': None,
        '_get_module_variables': None, '_get_path_variables': None,
        '_bytes_repr': None,
        '_get_call_flops': _RECORD,
    },
    'module': {
        '_context': None, '_freeze_attr': None,
        '_CallInfo': _RECORD,
        '_tabulate_context': "opens Linen's _CallInfo recording; liftmods' "
                             'is call_context.record_calls',
        '_Sentinel': "the class of Linen's unset-parent marker, imported for "
                     'type annotations only; liftmods marks an unset parent '
                     'with its own object (_unspecified_parent)',
    },
    'linear': {
        '_conv_dimension_numbers': "Linen's NHWC dimension numbers for "
                                   'lax.conv_general_dilated; liftmods builds '
                                   'them inside its convolution',
        '_Conv': "Linen's convolution base class; liftmods' Conv and ConvLocal "
                 'share a base of their own, whose fields are Conv\'s',
    },
    'transforms': {
        '_HashableProxy': "Linen's nn.jit cache key (a hashable stand-in for "
                          "a module); liftmods' nn.jit keys its own cache",
    },
    'recurrent': {
        '_select_last': _NOT_IN_LINEN,
    },
    'spmd': {
        '_is_logical_spec': "Linen's check of a logical PartitionSpec; "
                            "liftmods' is spmd.is_logical_names",
        '_with_sharding_constraint': "Linen's jax.lax.with_sharding_constraint "
                                     "wrapper; liftmods' constraints go "
                                     'through meta.constrain',
    },
}

PROVIDED = [(sub, name) for sub, names in SURVEY.items()
            for name, why in names.items() if why is None]


def test_survey_counts():
  """The figures docs/third-party.md gives."""
  found = sum(len(names) for names in SURVEY.values())
  assert (found, len(PROVIDED)) == (23, 12)


@pytest.mark.parametrize('sub,name', PROVIDED)
def test_provided_name_imports_under_the_switch(sub, name):
  with compat.flax_linen_as_liftmods(warn=False):
    namespace = {}
    exec(f'from flax.linen.{sub} import {name} as found', namespace)  # pylint: disable=exec-used
  assert namespace['found'] is getattr(getattr(liftmods, sub), name)
  assert name in dir(importlib.import_module(f'flax.linen.{sub}'))


def test_names_left_out_are_not_provided_or_not_in_linen():
  """A listed reason is still true: liftmods lacks the name (and Linen has
  it, unless the reason says Linen dropped it)."""
  for sub, names in SURVEY.items():
    linen = importlib.import_module(f'flax.linen.{sub}')
    ours = getattr(liftmods, sub)
    for name, why in names.items():
      if why is None:
        continue
      assert not hasattr(ours, name), (sub, name)
      assert hasattr(linen, name) == (why != _NOT_IN_LINEN), (sub, name)


def test_summary_names_left_out_say_why():
  with pytest.raises(AttributeError, match='_get_call_flops.*_CallInfo'):
    liftmods.summary._get_call_flops  # pylint: disable=protected-access,pointless-statement


# -- normalization ---------------------------------------------------------------


X = jax.random.normal(jax.random.key(3), (4, 5, 6)) * 3 + 1


def _bits_equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                  strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize('axes', [-1, (0, 2), (2, -3, 0)])
def test_canonicalize_axes_is_linens(axes):
  ours = liftmods.normalization._canonicalize_axes(3, axes)  # pylint: disable=protected-access
  assert ours == linen_norm._canonicalize_axes(3, axes)  # pylint: disable=protected-access


@pytest.mark.parametrize('kwargs', [
    {}, {'use_mean': False}, {'use_fast_variance': False},
    {'dtype': jnp.bfloat16, 'force_float32_reductions': False},
    {'mask': X > 0}])
def test_compute_stats_is_linens(kwargs):
  args = (X.astype(kwargs.get('dtype', X.dtype)), (0, 1),
          kwargs.pop('dtype', None))
  ours = liftmods.normalization._compute_stats(*args, **kwargs)  # pylint: disable=protected-access
  _bits_equal(ours, linen_norm._compute_stats(*args, **kwargs))  # pylint: disable=protected-access


def test_abs_sq_and_l2_normalize_are_linens():
  z = X + 2j * X
  _bits_equal(liftmods.normalization._abs_sq(z), linen_norm._abs_sq(z))  # pylint: disable=protected-access
  _bits_equal(liftmods.normalization._l2_normalize(X, axis=1),  # pylint: disable=protected-access
              linen_norm._l2_normalize(X, axis=1))  # pylint: disable=protected-access


def _renorm(nn):
  """A layer written outside Linen on its private helpers, as sbx does."""

  class Renorm(nn.Module):

    @nn.compact
    def __call__(self, x):
      mean, var = nn.normalization._compute_stats(x, (0,), None)  # pylint: disable=protected-access
      return nn.normalization._normalize(  # pylint: disable=protected-access
          self, x, mean, var, (0,), (-1,), None, jnp.float32, 1e-5, True,
          True, nn.initializers.normal(), nn.initializers.normal())

  return Renorm()


def test_normalize_makes_linens_parameters_and_output():
  x = X.reshape(20, 6)
  key = jax.random.key(0)
  ours = _renorm(liftmods).init_with_output(key, x)
  _bits_equal(ours, _renorm(flax.linen).init_with_output(key, x))


# -- summary -------------------------------------------------------------------


def _model(nn):

  class Count(nn.Module):

    @nn.compact
    def __call__(self, x):
      calls = self.variable('batch_stats', 'calls', jnp.zeros, (), jnp.int32)
      calls.value += 1
      return x * self.param('scale', nn.initializers.ones, x.shape[-1:])

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x):
      return Count()(nn.Dense(5)(x))

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x, scale=1.0):
      block = Block()
      return nn.Dense(2)(block(block(x) * scale))

  return Model()


def _leaf(x):
  """An array's shape and dtype; another value as itself (Linen wraps it in
  a representation holding it as ``obj``)."""
  if hasattr(x, 'shape'):
    return x.shape, str(x.dtype)
  return getattr(x, 'obj', x)


def _abstract(tree):
  return jax.tree_util.tree_map(_leaf, tree)


def _rows(summary, nn, **options):
  table = summary._get_module_table(_model(nn), options.get('depth'),  # pylint: disable=protected-access
                                    options.get('show_repeated', False),
                                    options.get('flops', False), False)(
                                        jax.random.key(0), jnp.ones((3, 5)),
                                        scale=2.0)
  assert isinstance(table, list) and isinstance(table, summary.Table)
  rows = [(r.path, type(r.module_copy).__name__, r.module_copy.parent,
           r.method, _abstract(r.inputs), _abstract(r.outputs),
           _abstract(r.module_variables), _abstract(r.counted_variables),
           r.flops > 0 if options.get('flops') else r.flops, r.vjp_flops,
           r.size_and_bytes(['params', 'batch_stats', 'cache']))
          for r in table]
  return (type(table.module).__name__, sorted(table.collections), rows)


@pytest.mark.parametrize('options', [{}, {'depth': 1},
                                     {'show_repeated': True},
                                     {'flops': True}])
def test_module_table_rows_are_linens(options):
  ours = _rows(liftmods.summary, liftmods, **options)
  assert ours == _rows(linen_summary, flax.linen, **options)
  assert len(ours[2]) > 1


def test_summary_helpers_are_linens():
  variables = jax.eval_shape(_model(flax.linen).init, jax.random.key(0),
                             jnp.ones((3, 5)))
  paths = {('Block_0',), ('Dense_0',), ('Block_0', 'Dense_0'),
           ('Block_0', 'Count_0')}
  for name, args in (
      ('_get_path_variables', (('Block_0',), variables)),
      ('_get_module_variables', (('Block_0',), variables, paths)),
      ('_process_inputs', ((1, 2), {'a': 3})),
      ('_process_inputs', ((1,), {})),
      ('_process_inputs', ((), {'a': 3})),
      ('_bytes_repr', (12_345_678,)),
      ('_bytes_repr', (999,))):
    ours = getattr(liftmods.summary, name)(*args)
    assert _abstract(ours) == _abstract(getattr(linen_summary, name)(*args))


# -- LazyRng ---------------------------------------------------------------------


def test_lazy_rng_is_linens():
  key = jax.random.key(7)
  for ours_module in (liftmods.summary, liftmods.transforms):
    ours = ours_module.LazyRng.create(key, 'a', 3)
    theirs = flax_scope.LazyRng.create(key, 'a', 3)
    assert ours.suffix == theirs.suffix == ('a', 3)
    _bits_equal(jax.random.key_data(ours.as_jax_rng()),
                jax.random.key_data(theirs.as_jax_rng()))
    assert ours_module.LazyRng.create(ours, 'b').suffix == ('a', 3, 'b')
    assert ours_module.LazyRng.create(theirs, 'b').suffix == ('a', 3, 'b')
    assert ours.clear_suffix().suffix == () and ours.clear_suffix().rng is key
  assert linen_transforms.LazyRng is linen_summary.LazyRng


def test_lazy_rng_is_a_pytree_and_an_rng():
  ours = liftmods.summary.LazyRng.create(jax.random.key(1), 'x')
  leaves, tree = jax.tree_util.tree_flatten(ours)
  assert leaves == [ours.rng]
  assert jax.tree_util.tree_unflatten(tree, leaves) == ours
  moved = jax.jit(lambda r: r)(ours)
  assert moved.suffix == ('x',)
  model = liftmods.Dropout(0.5, deterministic=False)
  theirs = flax.linen.Dropout(0.5, deterministic=False)
  x = jnp.ones((8,))
  _bits_equal(model.apply({}, x, rngs={'dropout': ours}),
              theirs.apply({}, x, rngs={'dropout': flax_scope.LazyRng.create(
                  jax.random.key(1), 'x')}))
