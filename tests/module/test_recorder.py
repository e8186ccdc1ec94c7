"""Tests of the call recorder in liftmods.call_context: one thread-local
gathering events of three kinds (module calls, logical constraint names,
pipelined stacks), how its blocks nest, that threads do not see each
other's blocks, and the views record_calls, record_constraint_names and
record_stage_axes."""
import threading

import jax
import jax.numpy as jnp
import pytest

import liftmods as nn
from liftmods import call_context, pipeline, spmd
from liftmods.call_context import (CONSTRAINT_NAMES, MODULE_CALLS, STAGE_AXES,
                                   note, open_record, record)

KINDS = (MODULE_CALLS, CONSTRAINT_NAMES, STAGE_AXES)
X = jnp.ones((2, 4))


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = spmd.with_logical_constraint(x, ('batch', 'embed'))
    return x + nn.Dense(x.shape[-1])(x)


class Model(nn.Module):
  """A constraint, a plain child and a pipelined stack."""

  @nn.compact
  def __call__(self, x):
    x = spmd.with_logical_constraint(x, ('batch', None))
    x = nn.Dense(4, name='head')(x)
    stack = nn.Stack(Block, 2,
                     pipeline=nn.Pipeline(stages=2, microbatches=2))
    return stack(name='body')(x)


def _init_shapes(model=None):
  model = Model() if model is None else model
  return jax.eval_shape(model.init, jax.random.key(0), X)


def test_nothing_is_open_outside_blocks():
  assert call_context.calls.records == {}
  assert call_context.calls.recording is None
  for kind in KINDS:
    assert open_record(kind) is None
    note(kind, ('ignored', None) if kind.keyed else 'ignored')  # no effect
  assert call_context.calls.records == {}


def test_kinds_are_distinct_and_described():
  assert len(set(map(id, KINDS))) == 3
  assert not MODULE_CALLS.keyed
  assert CONSTRAINT_NAMES.keyed and STAGE_AXES.keyed
  assert repr(STAGE_AXES) == "EventKind('pipelined stacks')"


def test_the_three_kinds_from_one_run():
  with (record(MODULE_CALLS) as calls, record(CONSTRAINT_NAMES) as names,
        record(STAGE_AXES) as stacks):
    assert open_record(MODULE_CALLS) is calls
    assert open_record(CONSTRAINT_NAMES) is names
    assert open_record(STAGE_AXES) is stacks
    _init_shapes()
  assert call_context.calls.records == {}
  paths = [c.path for c in calls]
  assert paths[:2] == [(), ('head',)]
  assert ('body',) in paths
  assert all(isinstance(c, call_context.ModuleCall) for c in calls)
  assert list(names) == ['batch', 'embed']
  assert stacks == {('body',): 'stage'}


def test_views_yield_the_recorders_containers():
  with call_context.record_calls() as calls:
    assert call_context.calls.recording is calls
    assert call_context.calls.records[MODULE_CALLS] is calls
    with spmd.record_constraint_names() as names:
      assert call_context.calls.records[CONSTRAINT_NAMES] is names
      with pipeline.record_stage_axes() as stacks:
        assert call_context.calls.records[STAGE_AXES] is stacks
        _init_shapes()
  assert isinstance(calls, list) and calls
  assert list(names) == ['batch', 'embed']
  assert stacks == {('body',): 'stage'}


def test_module_calls_reach_the_innermost_block_only():
  with call_context.record_calls() as outer:
    with call_context.record_calls() as inner:
      _init_shapes(nn.Dense(3))
    assert outer == []
    _init_shapes(nn.Dense(5))
  assert [c.outputs.shape for c in inner] == [(2, 3)]
  assert [c.outputs.shape for c in outer] == [(2, 5)]


@pytest.mark.parametrize('kind', [CONSTRAINT_NAMES, STAGE_AXES])
def test_keyed_kinds_pass_their_events_out_when_a_block_ends(kind):
  with record(kind) as outer:
    note(kind, ('a', 1))
    with record(kind) as inner:
      note(kind, ('b', 2))
      note(kind, ('a', 3))  # already outside: keeps its place there
      assert outer == {'a': 1}  # not yet
      assert call_context.calls.records[kind] is inner
    assert call_context.calls.records[kind] is outer
    note(kind, ('c', 4))
  assert inner == {'b': 2, 'a': 3}
  assert list(outer.items()) == [('a', 3), ('b', 2), ('c', 4)]
  assert open_record(kind) is None


def test_constraint_names_of_a_tree_are_gathered_in_order_once():
  names = {'a': ('batch', 'embed'), 'b': (None, 'embed', 'mlp'), 'c': None}
  tree = {'a': X, 'b': X, 'c': X}
  assert spmd.with_logical_constraint(tree, names) is tree  # no rules
  with spmd.record_constraint_names() as outer:
    with spmd.record_constraint_names() as inner:
      spmd.with_logical_constraint(tree, names)
      spmd.with_logical_constraint(X, None)  # no names: nothing to gather
    spmd.with_logical_constraint(X, ('vocab', 'batch'))
  assert list(inner) == ['batch', 'embed', 'mlp']
  assert list(outer) == ['batch', 'embed', 'mlp', 'vocab']
  assert call_context.calls.records == {}


def test_kinds_do_not_see_each_other():
  with record(CONSTRAINT_NAMES) as names:
    with record(STAGE_AXES) as stacks:
      note(CONSTRAINT_NAMES, ('embed', None))
    with record(MODULE_CALLS) as calls:
      note(STAGE_AXES, (('s',), 'stage'))  # no STAGE_AXES block is open
  assert names == {'embed': None}
  assert stacks == {} and calls == []
  # Module calls made while only other kinds' blocks are open go nowhere.
  with record(CONSTRAINT_NAMES) as names, record(STAGE_AXES) as stacks:
    _init_shapes()
    assert open_record(MODULE_CALLS) is None
  assert list(names) == ['batch', 'embed']
  assert stacks == {('body',): 'stage'}


def test_a_block_ended_by_an_error_is_closed_and_still_passed_out():
  with record(STAGE_AXES) as outer:
    with pytest.raises(ValueError):
      with record(STAGE_AXES):
        note(STAGE_AXES, (('s',), 'stage'))
        raise ValueError('stop')
    assert call_context.calls.records[STAGE_AXES] is outer
  assert outer == {('s',): 'stage'}
  with pytest.raises(ValueError):
    with call_context.record_calls():
      raise ValueError('stop')
  assert call_context.calls.recording is None


def test_another_thread_neither_sees_nor_feeds_this_threads_blocks():
  seen = {}

  def other():
    seen['open'] = {k.name: open_record(k) is not None for k in KINDS}
    for kind in KINDS:
      note(kind, ('x', None) if kind.keyed else 'x')
    _init_shapes()
    with record(CONSTRAINT_NAMES) as names:
      note(CONSTRAINT_NAMES, ('theirs', None))
    seen['names'] = names

  with (call_context.record_calls() as calls,
        spmd.record_constraint_names() as names,
        pipeline.record_stage_axes() as stacks):
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
  assert seen['open'] == {k.name: False for k in KINDS}
  assert seen['names'] == {'theirs': None}
  assert calls == [] and names == {} and stacks == {}


def test_threads_record_at_once_each_into_its_own_blocks():
  barrier = threading.Barrier(4)
  results = {}

  def work(i):
    with (record(MODULE_CALLS) as calls, record(CONSTRAINT_NAMES) as names,
          record(STAGE_AXES) as stacks):
      barrier.wait()  # every thread's blocks are open together
      for j in range(20):
        note(CONSTRAINT_NAMES, (f'n{i}_{j}', None))
        note(STAGE_AXES, ((f's{i}',), f'axis{j}'))
      _init_shapes(nn.Dense(i + 1))
      barrier.wait()
    results[i] = calls, names, stacks

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for i, (calls, names, stacks) in results.items():
    assert [c.outputs.shape for c in calls] == [(2, i + 1)]
    assert list(names) == [f'n{i}_{j}' for j in range(20)]
    assert stacks == {(f's{i}',): 'axis19'}
  assert call_context.calls.records == {}
