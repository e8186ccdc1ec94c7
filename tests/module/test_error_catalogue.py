"""The error catalogue, docs/errors.md, against liftmods.errors and Linen.

- every error class in ``liftmods.errors`` has an entry (``## ClassName``);
- each entry's program (a ``mistake(nn)`` function) raises that class from
  user-level code under liftmods: a liftmods error, never a bare JAX or
  Python exception, and its message ends with a pointer to the entry;
- the same program under flax.linen raises the class Linen has for it
  (``LINEN_RAISES`` lists where that is not a class of the same name).
"""
import builtins
import inspect
import pathlib
import pickle
import re
import sys
import types

import flax.core
import flax.errors
import flax.linen
import pytest

import liftmods
import treecheck
from liftmods import errors

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / 'docs'))
from test_docs import ROOT, extract_blocks  # pylint: disable=wrong-import-position

DOC = ROOT / 'docs' / 'errors.md'

# Classes kept only so that code naming Linen's class ports unchanged: Linen
# 0.12 raises neither, so there is no program to write.
COMPAT_ONLY = {'JaxTransformError'}
# Classes whose program need not raise: Linen 0.12 and liftmods accept
# several @compact methods, so the entry documents a compatibility name.
IN_FLUX = {'MultipleMethodsCompactError'}
# What Linen raises for an entry's program where that is not the class of
# the same name (None: Linen accepts the program). Programs using an API
# Linen lacks (nn.init_sharded, nn.Stack) fail there with AttributeError.
LINEN_RAISES = {
    'LiftmodsError': 'ScopeParamShapeError',
    'InvalidRngTypeError': 'ValueError',
    'ApplyScopeInvalidVariablesTypeError': 'AttributeError',
    'UnboundModuleError': 'ValueError',
    'MultipleMethodsCompactError': None,
    'LiftError': 'TypeError',
    'ScanCarryError': 'TypeError',
    'BroadcastVariableError': 'ValueError',
    'CondBranchVariablesError': 'TypeError',
    'VariableAxisError': 'ValueError',
    'WhileLoopInitError': 'TypeError',
    'PartitionAxisMismatchError': 'AssertionError',
    'ShardingError': 'AttributeError',
    'LogicalAxisUnmappedError': 'AttributeError',
    'MeshAxisNotFoundError': 'AttributeError',
    'ShardingDivisibilityError': 'AttributeError',
    'StackError': 'AttributeError',
    'ShardMapSpecError': 'AttributeError',
    'ExplicitShardingError': 'TypeError',
}
# Entries whose Linen failure is only the absence of the API the program
# uses (Linen's layers take no out_sharding=): no builtin to subclass.
API_ABSENT_IN_LINEN = {'ExplicitShardingError'}
# From flax 0.12.9 Linen's lazy_init fills a ShapeDtypeStruct with zeros
# and runs init, so the LazyInitError program initialises its variable from
# zeros instead of raising; liftmods keeps raising (docs/coming-from-linen.md).
if treecheck.FLAX_VERSION >= (0, 12, 9):
  LINEN_RAISES['LazyInitError'] = None


def _error_classes():
  return {cls.__name__: cls for _, cls in inspect.getmembers(
      errors, inspect.isclass) if issubclass(cls, errors.LiftmodsError)}


def _entries():
  """``{heading: code of the section's first python block}``."""
  text = DOC.read_text(encoding='utf-8')
  sections = re.split(r'^## ', text, flags=re.M)[1:]
  out = {}
  for section in sections:
    heading, _, body = section.partition('\n')
    blocks = extract_blocks(body)
    out[heading.strip()] = blocks[0][1] if blocks else None
  return out


ENTRIES = _entries()
CLASSES = _error_classes()
RAISED = sorted(set(CLASSES) - COMPAT_ONLY)

_LINEN = types.SimpleNamespace(**{
    n: getattr(flax.linen, n) for n in dir(flax.linen) if not n.startswith('_')})
_LINEN.core, _LINEN.errors = flax.core, flax.errors


def _mistake(name):
  namespace = {'__name__': 'catalogue'}
  code = ENTRIES[name]
  # Only the definitions: the block's own try/except runs in test_docs.
  exec(compile(code.split('\ntry:\n')[0], str(DOC), 'exec'), namespace)  # pylint: disable=exec-used
  return namespace['mistake']


def test_every_error_class_has_an_entry():
  headings = {h for h in ENTRIES if h != 'Contents'}
  assert set(CLASSES) <= headings, sorted(set(CLASSES) - headings)
  assert headings <= set(CLASSES), sorted(headings - set(CLASSES))
  for name in RAISED:
    assert ENTRIES[name] and 'def mistake(nn)' in ENTRIES[name], name


def test_aliases_are_named_in_their_entry():
  text = DOC.read_text(encoding='utf-8')
  for alias in ('FlaxError', 'ImmutableVariableError'):
    cls = getattr(errors, alias)
    entry = text.split(f'## {cls.__name__}\n')[1].split('\n## ')[0]
    assert f'`{alias}`' in entry


@pytest.mark.parametrize('name', RAISED)
def test_entry_program_raises_its_class(name):
  mistake = _mistake(name)
  try:
    mistake(liftmods)
  except errors.LiftmodsError as err:
    assert isinstance(err, CLASSES[name]), (name, type(err))
    anchor = re.search(r'\(see docs/errors\.md#(\w+)\)$', str(err))
    assert anchor, str(err)
    assert f'(#{anchor.group(1)})' in DOC.read_text(encoding='utf-8')
  except Exception as err:  # pylint: disable=broad-except
    pytest.fail(f'{name}: the mistake surfaced as a bare '
                f'{type(err).__name__}: {err}')
  else:
    if name not in IN_FLUX:
      pytest.fail(f'{name}: the program in its entry raised nothing')


@pytest.mark.parametrize('name', RAISED)
def test_linen_raises_the_same_class(name):
  expected = LINEN_RAISES.get(name, name)
  mistake = _mistake(name)
  try:
    mistake(_LINEN)
  except Exception as err:  # pylint: disable=broad-except
    assert type(err).__name__ == expected, (name, type(err), err)
  else:
    assert expected is None, f'Linen accepted the {name} program'


def test_liftmods_classes_are_catchable_as_linen_builtins():
  """Where Linen lets a mistake surface as a builtin exception, ours
  subclasses it, so ``except ValueError`` code keeps working."""
  for name, linen_name in LINEN_RAISES.items():
    if (linen_name in ('ValueError', 'TypeError') and name != 'LiftError'
        and name not in API_ABSENT_IN_LINEN):
      assert issubclass(CLASSES[name], getattr(builtins, linen_name)), name


def test_pointer_names_the_nearest_catalogued_class():
  """A subclass defined outside ``liftmods.errors`` points to the entry of
  its nearest base defined there."""

  class MyRngError(errors.InvalidRngError):
    pass

  err = MyRngError('no "dropout" rng at /Dropout_0')
  assert str(err).endswith('(see docs/errors.md#invalidrngerror)')
  from liftmods.layers.attention import AttentionConfigError
  err = AttentionConfigError('bad attention config')
  assert str(err).endswith('(see docs/errors.md#liftmodserror)')


@pytest.mark.parametrize('name', RAISED)
def test_entry_error_survives_pickling(name):
  """Errors cross process boundaries (multi-process tools, pytest-xdist,
  qwix's and AQT's test runners): each class's error, as its entry's
  program raises it, unpickles to an equal error."""
  try:
    _mistake(name)(liftmods)
  except errors.LiftmodsError as err:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert back.args == err.args
    assert vars(back) == vars(err)
  else:
    assert name in IN_FLUX, name


def test_error_with_required_arguments_pickles():
  err = errors.ScopeParamShapeError('kernel', '/Dense_0', (3, 4), (3, 5))
  back = pickle.loads(pickle.dumps(err))
  assert type(back) is errors.ScopeParamShapeError
  assert str(back) == str(err)
  err = errors.ScopeParamNotFoundError('kernel', '/Dense_0')
  back = pickle.loads(pickle.dumps(err))
  assert (back.collection, back.lookup) == ('params', ('kernel', '/Dense_0'))
