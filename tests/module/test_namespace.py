"""Every public name of flax.linen (and its submodules), flax.core and
flax.errors exists in liftmods with a compatible signature.

One test per name. A name fails when liftmods lacks it or when its signature
differs (parameter names, kinds, order and defaults; for Module classes the
dataclass fields, with ``parent``/``name`` compared by name only, since
liftmods makes them keyword-only). ``EXCLUDED`` lists the names liftmods
deliberately does not provide, each with its reason.
"""
import dataclasses
import importlib
import inspect
import types
import typing

import flax.core
import flax.errors
import flax.linen
import jax
import numpy as np
import pytest

import liftmods
import liftmods.core
import liftmods.errors

# Linen submodules walked name by name, as ``nn.<submodule>``.
SUBMODULES = ('linear', 'attention', 'recurrent', 'normalization',
              'combinators', 'stochastic', 'initializers', 'summary',
              'partitioning', 'spmd', 'fp8_ops', 'kw_only_dataclasses')

# Submodules that must resolve (``nn.activation.relu`` ...) but whose
# contents are implementation modules of Linen, checked by the names above.
RESOLVING_ONLY = ('activation', 'pooling', 'dtypes', 'module', 'transforms',
                  'batch_apply')

# Non-flax objects a Linen submodule re-exports on purpose.
REEXPORTED = {
    'initializers': None,  # every jax.nn.initializers function
    'linear': ('default_kernel_init', 'default_embed_init'),
    'attention': ('default_kernel_init',),
    'recurrent': ('default_kernel_init', 'sigmoid', 'tanh'),
}

EXCLUDED = {
    # flax.errors raised only outside flax.linen / flax.core.
    'errors.AlreadyExistsError': 'raised by flax.io (file copies), not part '
                                 'of Linen or the core',
    'errors.CursorFindError': 'raised by flax.cursor, which liftmods does '
                              'not provide',
    'errors.TraverseTreeError': 'raised by flax.cursor, which liftmods does '
                                'not provide',
    'errors.InvalidCheckpointError': 'raised by flax.training.checkpoints, '
                                     'which liftmods does not provide',
    'errors.MPACheckpointingRequiredError': 'flax.training.checkpoints '
                                            '(multiprocess arrays)',
    'errors.MPARestoreDataCorruptedError': 'flax.training.checkpoints '
                                           '(multiprocess arrays)',
    'errors.MPARestoreTargetRequiredError': 'flax.training.checkpoints '
                                            '(multiprocess arrays)',
    'errors.TraceContextError': 'raised only by flax.nnx',
    # flax.core internals exposed as submodules.
    'core.axes_scan': 'Flax\'s scan implementation module; liftmods\'s scan '
                      'lives in liftmods.core.lift (core.broadcast is there)',
    'core.partial_eval': 'Flax-internal helper module for jax partial '
                         'evaluation; liftmods uses jax.interpreters directly',
    'core.Scope': 'Linen\'s extra debug_path argument (used only in its '
                  'error messages) is not accepted; every other parameter '
                  'matches',
}

# -- the walk ------------------------------------------------------------------


def _is_typing(obj) -> bool:
  mod = getattr(obj, '__module__', '') or ''
  return (mod in ('typing', 'typing_extensions', 'collections.abc', 'abc',
                  'builtins', 'functools', 'dataclasses', 'types')
          or isinstance(obj, (typing.TypeVar, types.GenericAlias))
          or type(obj).__module__ == 'typing')


def _wanted(submodule, name, obj) -> bool:
  """Whether ``name`` of Linen's ``submodule`` is part of its API."""
  if name.startswith('_') or isinstance(obj, types.ModuleType):
    return False
  if not callable(obj) or _is_typing(obj):
    return False
  mod = getattr(obj, '__module__', '') or ''
  if mod.startswith('flax'):
    return True
  allowed = REEXPORTED.get(submodule, ())
  return allowed is None or name in allowed


def _linen_submodule(name):
  try:
    return importlib.import_module(f'flax.linen.{name}')
  except ImportError:  # pragma: no cover
    return None


def _cases():
  cases = []
  for name in sorted(dir(flax.linen)):
    if not name.startswith('_'):
      cases.append(('nn', name))
  for sub in SUBMODULES:
    mod = _linen_submodule(sub)
    for name in sorted(dir(mod)):
      if _wanted(sub, name, getattr(mod, name)):
        cases.append((f'nn.{sub}', name))
  for sub in RESOLVING_ONLY:
    cases.append(('nn', sub))
  for name in sorted(dir(flax.core)):
    if not name.startswith('_'):
      cases.append(('core', name))
  for name in sorted(dir(flax.core.meta)):  # also nn.meta
    if _wanted('meta', name, getattr(flax.core.meta, name)):
      cases.append(('core.meta', name))
  for name in sorted(dir(flax.errors)):
    obj = getattr(flax.errors, name)
    if inspect.isclass(obj) and issubclass(obj, Exception):
      cases.append(('errors', name))
  # Public methods and properties of Module and Scope.
  for name in dir(flax.linen.Module):
    if not name.startswith('_'):
      cases.append(('nn.Module', name))
  for name in dir(flax.core.Scope):
    if not name.startswith('_'):
      cases.append(('core.Scope', name))
  return sorted(set(cases))


def _flax_parent(space):
  if space == 'nn':
    return flax.linen
  if space.startswith('nn.Module'):
    return flax.linen.Module
  if space.startswith('nn.'):
    return _linen_submodule(space[3:])
  if space == 'core':
    return flax.core
  if space == 'core.Scope':
    return flax.core.Scope
  if space == 'core.meta':
    return flax.core.meta
  return flax.errors


def _ours_parent(space):
  if space == 'nn':
    return liftmods
  if space == 'nn.Module':
    return liftmods.Module
  if space.startswith('nn.'):
    return getattr(liftmods, space[3:], None)
  if space == 'core':
    return liftmods.core
  if space == 'core.Scope':
    return liftmods.core.Scope
  if space == 'core.meta':
    return liftmods.core.meta
  return liftmods.errors


# -- signature comparison ------------------------------------------------------


def _default_key(value):
  """A comparable description of a default value."""
  if value is inspect.Parameter.empty or value is dataclasses.MISSING:
    return '<required>'
  if isinstance(value, (bool, int, float, str, type(None), complex)):
    return value
  if isinstance(value, (tuple, list)):
    return tuple(_default_key(v) for v in value)
  if hasattr(value, 'items') and not callable(value):
    return ('mapping', tuple(sorted((str(k), _default_key(v))
                                    for k, v in value.items())))
  if type(value).__name__ in ('_Sentinel', '_Unspecified'):
    return '<sentinel>'
  if isinstance(value, type) or isinstance(value, np.dtype):
    try:
      return ('dtype', str(np.dtype(value)))
    except TypeError:
      return ('type', value.__name__)
  if callable(value):
    fn = getattr(value, 'func', value)  # functools.partial
    return ('callable', getattr(fn, '__name__', type(fn).__name__))
  return ('object', type(value).__name__)


def _params(obj):
  """[(name, kind, default)] of a callable, or None if unknowable."""
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):
    return None
  out = []
  for p in sig.parameters.values():
    name = p.name
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      name = '*' if p.kind == p.VAR_POSITIONAL else '**'
    out.append((name, p.kind.name, _default_key(p.default)))
  return out


def _fields(cls):
  """[(name, default)] of a dataclass Module's fields, parent/name last and
  compared by name only (None for the Module base class)."""
  if not dataclasses.is_dataclass(cls):
    return None
  out = []
  for f in dataclasses.fields(cls):
    if f.name in ('parent', 'name'):
      out.append((f.name, None))
      continue
    if f.default_factory is not dataclasses.MISSING:
      default = ('factory', _default_key(f.default_factory()))
    else:
      default = _default_key(f.default)
    out.append((f.name, default))
  return out


def _same_default(theirs, ours) -> bool:
  """Equal defaults; a default where Linen requires the argument is
  compatible, and so is any callable where Linen's default is a lambda."""
  if theirs == ours or theirs == '<required>':
    return True
  return (isinstance(theirs, tuple) and theirs == ('callable', '<lambda>')
          and isinstance(ours, tuple) and ours[:1] == ('callable',))


def _compatible(theirs, ours) -> bool:
  """Same parameter names, kinds and order; compatible defaults. liftmods
  may append parameters of its own after Linen's (``out_sharding`` on the
  layers, ``metadata_params`` on ``remat_scan``) if each has a default and
  none comes before a ``*args``/``**kwargs`` of Linen's: every call Linen
  accepts then binds to the same parameters."""
  extra = ours[len(theirs):]
  if [p[:2] for p in theirs] != [p[:2] for p in ours[:len(theirs)]]:
    return False
  if any(p[2] == '<required>' or p[1].startswith('VAR_') for p in extra):
    return False
  if extra and theirs and theirs[-1][1] == 'VAR_KEYWORD':
    return False
  return all(_same_default(a[2], b[2]) for a, b in zip(theirs, ours))


def _is_linen_module_class(obj):
  return inspect.isclass(obj) and issubclass(obj, flax.linen.Module)


def _signature_difference(theirs, ours):
  """None when compatible, else a message."""
  if _is_linen_module_class(theirs):
    if not (inspect.isclass(ours) and issubclass(ours, liftmods.Module)):
      return f'{ours!r} is not a liftmods Module class'
    a, b = _fields(theirs), _fields(ours)
    if a != b and not (a and b and _compatible(
        [(n, '', d) for n, d in a], [(n, '', d) for n, d in b])):
      return f'fields differ:\n  linen    {a}\n  liftmods {b}'
    for method in ('__call__',):
      if method in vars(theirs) or method in vars(ours):
        pa = _params(getattr(theirs, method))
        pb = _params(getattr(ours, method))
        if pa is not None and pb is not None and not _compatible(pa, pb):
          return (f'{method} differs:\n  linen    {pa}\n'
                  f'  liftmods {pb}')
    return None
  if inspect.isclass(theirs) and issubclass(theirs, BaseException):
    # Exceptions: liftmods's constructors take the module path and more
    # context than Linen's; code catches them by class, so the class must
    # exist and be an exception (error classes/messages are checked in the
    # error tests).
    if not (inspect.isclass(ours) and issubclass(ours, BaseException)):
      return f'{ours!r} is not an exception class'
    return None
  if isinstance(theirs, types.ModuleType):
    if not isinstance(ours, types.ModuleType):
      return f'{ours!r} is not a module'
    return None
  if not callable(theirs) or _is_typing(theirs):
    return None  # constants and type aliases: presence is what matters
  if isinstance(theirs, property) or isinstance(ours, property):
    return None
  pa, pb = _params(theirs), _params(ours)
  if pa is None or pb is None or _compatible(pa, pb):
    return None
  return f'signature differs:\n  linen    {pa}\n  liftmods {pb}'


def _param(space, name):
  return pytest.param(space, name, id=f'{space}.{name}')


CASES = [c for c in _cases() if f'{c[0]}.{c[1]}' not in EXCLUDED]


@pytest.mark.parametrize('space,name', [_param(*c) for c in CASES])
def test_name_exists_with_linen_signature(space, name):
  theirs = getattr(_flax_parent(space), name)
  parent = _ours_parent(space)
  assert parent is not None, f'liftmods has no {space}'
  assert hasattr(parent, name), f'liftmods {space} lacks {name!r}'
  if space in ('nn.Module', 'core.Scope'):
    return  # methods: presence (their behaviour is tested elsewhere)
  diff = _signature_difference(theirs, getattr(parent, name))
  assert diff is None, f'{space}.{name}: {diff}'


@pytest.mark.parametrize('key', sorted(EXCLUDED))
def test_excluded_names_are_real_and_justified(key):
  space, name = key.rsplit('.', 1)
  assert hasattr(_flax_parent(space), name), f'{key} is not a Linen name'
  assert len(EXCLUDED[key]) > 20, f'{key} needs a reason'


def test_exclusion_list_stays_short():
  assert len(EXCLUDED) <= 16


def test_submodule_aliases_are_the_same_objects():
  nn = liftmods
  assert nn.linear.Dense is nn.Dense
  assert nn.attention.MultiHeadDotProductAttention is (
      nn.MultiHeadDotProductAttention)
  assert nn.recurrent.LSTMCell is nn.LSTMCell
  assert nn.normalization.LayerNorm is nn.LayerNorm
  assert nn.combinators.Sequential is nn.Sequential
  assert nn.stochastic.Dropout is nn.Dropout
  assert nn.activation.PReLU is nn.PReLU
  assert nn.fp8_ops.Fp8DotGeneral is nn.Fp8DotGeneral
  assert nn.summary.tabulate is nn.tabulate
  assert nn.module.Module is nn.Module
  assert nn.transforms.scan is nn.scan
  assert nn.batch_apply.BatchApply is nn.BatchApply
  assert nn.initializers.lecun_normal is jax.nn.initializers.lecun_normal
  for sub in ('linear', 'attention', 'recurrent', 'normalization',
              'combinators', 'stochastic', 'fp8_ops', 'kw_only_dataclasses'):
    assert importlib.import_module(f'liftmods.{sub}') is getattr(nn, sub)


def test_signature_check_can_fail():
  """The comparison notices a changed default and a missing field."""

  class A(flax.linen.Module):
    features: int
    use_bias: bool = True

  class B(liftmods.Module):
    features: int
    use_bias: bool = False

  class C(liftmods.Module):
    features: int

  class D(liftmods.Module):
    features: int
    use_bias: bool = True

    def __call__(self, x, *, flag=False):
      return x

  assert _signature_difference(A, B) is not None
  assert _signature_difference(A, C) is not None
  assert _signature_difference(A, D) is not None  # __call__ Linen lacks
  assert _signature_difference(flax.linen.RNN, liftmods.RNN) is None
  assert _signature_difference(lambda x, y=1: 0, lambda x, y=2: 0)
  assert _signature_difference(lambda x, *, y=1: 0, lambda x, y=1: 0)
  assert _signature_difference(lambda x, y=1: 0, lambda x, y=1: 0) is None


def test_kw_only_dataclasses():
  from liftmods import kw_only_dataclasses as kw  # pylint: disable=g-import-not-at-top

  @kw.dataclass(extra_fields=[('tag', str, kw.field(default='t',
                                                     kw_only=True))])
  class Base:
    size: int = kw.field(default=1, kw_only=True)

  @kw.dataclass
  class Child(Base):
    width: int

  assert Child(3).size == 1 and Child(3, size=2).size == 2
  assert Child(3).tag == 't'
  with pytest.raises(ValueError, match='no default are not supported'):
    kw.field(kw_only=True)
  with pytest.raises(ValueError, match='list of'):
    kw.dataclass(type('X', (), {}), extra_fields=[('a', int, 3)])


# -- type aliases of Linen's submodules and flax.typing, by meaning -----------

_ALIAS_SPACES = SUBMODULES + RESOLVING_ONLY + ('typing',)
_TYPING_NOT_PROVIDED = {'HashableMapping', 'PytreeDeque', 'SizeBytes',
                        'BaseConfigContext'}  # flax-internal helper classes


def _alias_meaning(obj):
  """An alias's meaning: its repr with module paths reduced to last names."""
  import re  # pylint: disable=import-outside-toplevel
  if isinstance(obj, typing.TypeVar):
    return ('TypeVar', obj.__name__, repr(obj.__bound__))
  return re.sub(r'\b(?:flax|liftmods)\.[\w.]*\.(\w+)', r'\1', repr(obj))


def _alias_cases():
  import flax.typing  # pylint: disable=import-outside-toplevel
  aliases = {n: v for n, v in vars(flax.typing).items()
             if not n.startswith('_') and not isinstance(v, types.ModuleType)
             and not inspect.isfunction(v) and not hasattr(typing, n)
             and getattr(v, '__module__', '') not in ('__future__',
                                                      'collections',
                                                      'functools')
             and n not in _TYPING_NOT_PROVIDED and n != 'MISSING'}
  for space in _ALIAS_SPACES:
    mod = (flax.typing if space == 'typing'
           else importlib.import_module(f'flax.linen.{space}'))
    for name in sorted(aliases):
      if vars(mod).get(name, None) is aliases[name]:
        yield space, name, aliases[name]


@pytest.mark.parametrize('space,name,alias', list(_alias_cases()),
                         ids=lambda v: v if isinstance(v, str) else '')
def test_type_alias(space, name, alias):
  ours = importlib.import_module(f'liftmods.{space}')
  assert hasattr(ours, name), f'liftmods.{space} lacks {name}'
  assert _alias_meaning(getattr(ours, name)) == _alias_meaning(alias)


def test_submodule_helpers_from_traverse_util_and_core_scope():
  import flax.core.scope  # pylint: disable=import-outside-toplevel
  import flax.traverse_util  # pylint: disable=import-outside-toplevel
  import liftmods.core.scope  # pylint: disable=import-outside-toplevel
  tree = {'a': {'x': 1, 'y': 2}, 'b': {}, 'c': 3}
  f = lambda path, v: (path, v * 10)
  assert (liftmods.traverse_util.path_aware_map(f, tree)
          == flax.traverse_util.path_aware_map(f, tree))
  cols = {'params': 1, 'batch_stats': 2, 'cache': 3, 'intermediates': 4}
  filters = [['params'], flax.core.DenyList('cache'), True]
  assert (liftmods.core.scope.group_collections(cols, filters[:1] + [
      liftmods.core.DenyList('cache'), True]) ==
          tuple(flax.core.scope.group_collections(cols, filters)))
  for name in ('union_filters', 'intersect_filters', 'subtract_filters'):
    for a, b in ((['a', 'b'], ['b', 'c']), (True, ['a']), (['a'], False)):
      theirs = getattr(flax.core.scope, name)(a, b)
      ours = getattr(liftmods.core.scope, name)(a, b)
      for col in 'abcd':
        assert (liftmods.core.filters.in_filter(ours, col)
                == flax.core.scope.in_filter(theirs, col)), (name, a, b, col)
