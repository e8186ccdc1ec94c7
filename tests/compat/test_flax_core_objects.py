"""flax.core objects passed to Linen's API, on liftmods as on Linen.

Under liftmods.compat ``flax.core`` stays flax's, so code written for Linen
hands liftmods flax's ``DenyList`` (keras' ``FlaxLayer`` passes
``mutable=DenyList(['params'])``), flax's ``FrozenDict`` of variables,
flax's ``LazyRng`` and filters combined by ``flax.core.scope``'s filter
algebra. Each entry point of Linen's API that takes one is called with the
same flax object on Linen and, under the switch, on liftmods: the results
(values, trees and the type of each container) must be the same, and the
issue's program run by ``python -m liftmods.compat`` prints what it prints
on flax.
"""
import importlib
import os
import subprocess
import sys
import textwrap

import flax.core
import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import scope as flax_scope

import liftmods
from liftmods import compat
from liftmods.core import filters, frozen_dict

# The real flax.linen (under the switch, the attribute flax.linen is liftmods).
LINEN = flax.linen
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
X = jnp.arange(12.).reshape(4, 3)
RNGS = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}
DROPOUT = {'dropout': jax.random.key(2)}


def _model(nn):
  """BatchNorm (a second collection), a sown value and dropout (an rng)."""

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(x)
      self.sow('intermediates', 'h', x)
      x = nn.Dropout(0.5, deterministic=False)(x)
      return nn.Dense(2)(x)

  return Model


def _variables(nn):
  return _model(nn)().init(RNGS, X)


def _cell(nn):

  class Cell(nn.Module):

    @nn.compact
    def __call__(self, c, x):
      self.sow('intermediates', 'c', c)
      return nn.Dense(3)(c) + x, None

  return Cell


def _mutable_of(nn):

  class Probe(nn.Module):

    @nn.compact
    def __call__(self, x):
      return (self.is_mutable_collection('params'),
              self.is_mutable_collection('batch_stats'))

  return Probe().apply({}, X, mutable=flax_scope.DenyList('params'))[0]


def _bound(nn):
  bound = _model(nn)().bind(_variables(nn), rngs=DROPOUT,
                            mutable=flax_scope.DenyList('params'))
  return bound(X), bound.variables


def _partitioned(nn):
  init = LINEN.with_partitioning(LINEN.initializers.ones, (None, 'model'))
  params = nn.Dense(2, kernel_init=init).init(RNGS, X)
  box = params['params']['kernel']
  assert type(box).__module__ == 'flax.core.meta'
  return (type(box).__name__, nn.unbox(params))


# {entry point: fn(nn) -> result}, each given a flax.core object.
ENTRY_POINTS = {
    'init(mutable=DenyList)': lambda nn: _model(nn)().init(
        RNGS, X, mutable=flax_scope.DenyList('intermediates')),
    'init_with_output(mutable=DenyList)': lambda nn: _model(nn)(
    ).init_with_output(RNGS, X, mutable=flax_scope.DenyList(
        ['intermediates'])),
    'apply(mutable=DenyList)': lambda nn: _model(nn)().apply(
        _variables(nn), X, rngs=DROPOUT,
        mutable=flax_scope.DenyList(['params'])),
    'apply(FrozenDict variables)': lambda nn: _model(nn)().apply(
        flax.core.freeze(_variables(nn)), X, rngs=DROPOUT,
        mutable=['batch_stats']),
    'apply(rngs=LazyRng)': lambda nn: _model(nn)().apply(
        _variables(nn), X, mutable=True,
        rngs={'dropout': flax_scope.LazyRng.create(RNGS['dropout'], 'a', 1)}),
    'apply(capture_intermediates, DenyList)': lambda nn: _model(nn)().apply(
        _variables(nn), X, rngs=DROPOUT, capture_intermediates=True,
        mutable=flax_scope.DenyList('params')),
    'apply(mutable=union_filters)': lambda nn: _model(nn)().apply(
        _variables(nn), X, rngs=DROPOUT, mutable=flax_scope.union_filters(
            flax_scope.DenyList(['params', 'batch_stats']), 'batch_stats')),
    'nn.apply(mutable=DenyList)': lambda nn: nn.apply(
        lambda m, x: m(x), _model(nn)(),
        mutable=flax_scope.DenyList('params'))(_variables(nn), X, rngs=DROPOUT),
    'nn.init(mutable=DenyList)': lambda nn: nn.init(
        lambda m, x: m(x), _model(nn)(),
        mutable=flax_scope.DenyList('intermediates'))(RNGS, X),
    'bind(mutable=DenyList)': _bound,
    'is_mutable_collection under DenyList': _mutable_of,
    'vmap(variable_axes={DenyList: None})': lambda nn: nn.vmap(
        _model(nn), variable_axes={
            'params': 0, flax_scope.DenyList(('params',)): None},
        split_rngs={'params': True, 'dropout': True})().init(
            RNGS, jnp.stack([X, X + 1])),
    'scan(variable_broadcast=DenyList)': lambda nn: nn.scan(
        _cell(nn), variable_broadcast=flax_scope.DenyList(['intermediates']),
        variable_axes={'intermediates': 0}, split_rngs={'params': False},
        length=2)().init(RNGS, X, jnp.stack([X, X])),
    'map_variables(mapped_collections=DenyList)': lambda nn: nn.map_variables(
        _model(nn), mapped_collections=flax_scope.DenyList('params'),
        trans_in_fn=lambda t: t, trans_out_fn=lambda t: t,
        mutable=True)().init(RNGS, X),
    'jit(variables=DenyList)': lambda nn: nn.jit(
        _model(nn), variables=flax_scope.DenyList('intermediates'))().init(
            RNGS, X),
    'remat(variables=DenyList)': lambda nn: nn.remat(
        _model(nn), variables=flax_scope.DenyList('intermediates'))().init(
            RNGS, X),
    'with_partitioning(flax.core.meta box)': _partitioned,
}


def _described(tree):
  """Values as lists, each container labelled with its class name (a flax
  and a liftmods FrozenDict are both 'FrozenDict')."""
  if isinstance(tree, dict) or type(tree).__name__ == 'FrozenDict':
    return (type(tree).__name__,
            {k: _described(v) for k, v in sorted(tree.items())})
  if isinstance(tree, (tuple, list)):
    return (type(tree).__name__, [_described(v) for v in tree])
  if isinstance(tree, jax.Array) and jax.dtypes.issubdtype(
      tree.dtype, jax.dtypes.prng_key):
    tree = jax.random.key_data(tree)
  if hasattr(tree, 'dtype'):
    return (str(tree.dtype), np.asarray(tree).tolist())
  return tree


@pytest.mark.parametrize('entry', ENTRY_POINTS)
def test_entry_point_takes_the_flax_core_object_as_linen_does(entry):
  fn = ENTRY_POINTS[entry]
  theirs = fn(LINEN)
  with compat.flax_linen_as_liftmods(warn=False):
    switched = importlib.import_module('flax.linen')
    assert switched.__liftmods_module__ is liftmods
    ours = fn(switched)
  assert _described(ours) == _described(theirs)


def test_flax_deny_list_is_a_deny_list():
  deny = flax_scope.DenyList(['params'])
  assert isinstance(deny, filters.DenyList)
  assert not filters.in_filter(deny, 'params')
  assert filters.in_filter(deny, 'batch_stats')
  assert filters.intersect(deny, ['params', 'cache']) == {'cache'}
  assert filters.subtract(True, deny) == {'params'}


def test_flax_frozen_dict_is_a_frozen_dict():
  frozen = flax.core.freeze({'a': {'b': 1}})
  assert isinstance(frozen, frozen_dict.FrozenDict)
  assert frozen_dict.unfreeze(frozen) == {'a': {'b': 1}}
  assert type(frozen_dict.unfreeze(frozen)['a']) is dict


def test_other_classes_are_not_taken_for_flax_objects():
  """Only a class named DenyList with a ``deny`` field, or a Mapping named
  FrozenDict, passes; anything else is still a bad filter."""

  class DenyList:  # pylint: disable=redefined-outer-name
    deny = 'params'

  assert not isinstance(DenyList(), filters.DenyList)
  assert not isinstance(object(), frozen_dict.FrozenDict)
  with pytest.raises(liftmods.errors.InvalidFilterError,
                     match='Invalid Filter'):
    filters.in_filter(3, 'params')


def test_issue_program_under_the_switch_prints_what_flax_prints(tmp_path):
  script = tmp_path / 'issue45.py'
  script.write_text(textwrap.dedent('''
      import jax, jax.numpy as jnp, flax.linen as nn
      from flax.core import scope as flax_scope
      class M(nn.Module):
        @nn.compact
        def __call__(self, x):
          return nn.Dense(2)(nn.BatchNorm(use_running_average=False)(x))
      x = jnp.ones((4, 3)); v = M().init(jax.random.key(0), x)
      y, upd = M().apply(v, x, mutable=flax_scope.DenyList(["params"]))
      print(nn.Dense.__module__, sorted(upd), float(y.sum()))
  '''))
  outputs = []
  for switch in ('0', '1'):
    proc = subprocess.run(
        [sys.executable, '-m', 'liftmods.compat', str(script)],
        capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, 'LIFTMODS_AS_FLAX_LINEN': switch,
             'JAX_PLATFORMS': 'cpu'}, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outputs.append(proc.stdout.split())
  assert outputs[0][0] == 'flax.linen.linear'
  assert outputs[1][0] == 'liftmods.layers.linear'
  assert outputs[0][1:] == outputs[1][1:] == ["['batch_stats']", '0.0']
