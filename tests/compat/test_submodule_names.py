"""Every public name of flax.linen's submodules, in liftmods' counterparts.

Code written for Linen reaches names through the submodules, not only
through ``flax.linen``: brax builds its table of activations from
``nn.activation.compact``, other code writes ``from flax.linen.linear import
initializers`` or annotates with ``flax.linen.recurrent.Carry``. For every
submodule of the installed ``flax.linen`` (found on disk, so one flax adds
is checked too) and for ``flax.linen`` itself, each public name of
``dir(flax.linen.X)`` must be in ``dir(liftmods.X)`` and mean the same:

* a module Linen imports is the same module (``jax``, ``jnp``,
  ``functools``...); one of flax's is liftmods' counterpart
  (``flax.linen.initializers`` -> ``liftmods.initializers``,
  ``flax.core`` -> ``liftmods.core``, ``flax.linen`` -> ``liftmods``);
* an object from outside flax is the same object (``typing.Any``,
  ``jax.eval_shape``, ``jax.nn.initializers`` under
  ``normalization.initializers``);
* one of flax.linen's top-level names is liftmods' top-level name
  (``activation.compact is liftmods.compact``);
* any other object of flax's is one of liftmods' of the same kind, and a
  type alias or TypeVar has the same meaning (its repr with module paths
  cut to their last name).

``NOT_PROVIDED`` lists, with the reason, the names that mean nothing in
liftmods; reading one raises an AttributeError that names it and says why.
Under :mod:`liftmods.compat` every mirrored submodule imports as
``flax.linen.X`` and has the same names.
"""
import importlib
import inspect
import pathlib
import pkgutil
import re
import types
import typing

import flax
import flax.linen
import jax
import numpy as np
import pytest

import liftmods
import liftmods.module
import liftmods.transforms
from liftmods import compat

# Submodules of flax.linen that liftmods does not mirror, and why.
NOT_MIRRORED = {
    'experimental': "Linen's experimental layers_with_named_axes (Dense, "
                    'Embed, LayerNorm over param_with_axes), superseded in '
                    'Linen itself by nn.with_logical_partitioning; importing '
                    'it under the switch raises an ImportError naming it',
}

_NOT_A_DEPENDENCY = ('a dependency of flax, not of liftmods (which needs only '
                     'jax, jaxlib, numpy and msgpack)')
_STRUCT = "flax.struct is flax's own module, not Linen's; it stays flax's"
_JAX_PRIVATE = ('a jax._src module: liftmods reaches private JAX only '
                'through liftmods.jax_private')
_JIT_STEP = "a step of Linen's nn.jit cache; liftmods' nn.jit has its own"

# Names of Linen's submodules that mean nothing in liftmods, with why.
NOT_PROVIDED = {
    'fp8_ops': {
        'core': _JAX_PRIVATE,
        'dtypes': _JAX_PRIVATE,
        'earray': _JAX_PRIVATE,
        'pxla': _JAX_PRIVATE,
    },
    'kw_only_dataclasses': {
        'flax': 'the flax package; liftmods never imports flax',
        'tpe': f'typing_extensions, {_NOT_A_DEPENDENCY}',
    },
    'module': {
        'flax': 'the flax package; liftmods never imports flax',
        'tpe': f'typing_extensions, {_NOT_A_DEPENDENCY}',
        'FlaxId': "the class of Linen's module ids; liftmods numbers its "
                  'modules with plain integers',
        'uuid': "flax.ids' counter of module ids (not the uuid module)",
        'ParentDescriptor': "keeps a Linen module's parent behind a weak "
                            'reference; liftmods keeps a plain field',
        'ThreadLocalStack': "the container of Linen's per-thread stacks; "
                            "liftmods' per-thread state is "
                            'call_context.ThreadCalls',
        'module_field': 'a typing-only field specifier that is never called',
    },
    'partitioning': {
        'flax': 'the flax package; liftmods never imports flax',
        'struct': _STRUCT,
    },
    'recurrent': {
        'logging': f'absl.logging, {_NOT_A_DEPENDENCY}',
        'Protocol': f'typing_extensions.Protocol, {_NOT_A_DEPENDENCY}',
    },
    'spmd': {
        'struct': _STRUCT,
    },
    'summary': {
        'rich': f'rich, {_NOT_A_DEPENDENCY}',
        'yaml': f'PyYAML, {_NOT_A_DEPENDENCY}',
    },
    'transforms': {
        'FlaxId': "the class of Linen's module ids; liftmods numbers its "
                  'modules with plain integers',
        'struct': _STRUCT,
        'clean_clone': 'a helper Linen no longer calls',
        'fork_rngs': _JIT_STEP,
        'decorator_lift_transform_cached': _JIT_STEP,
        'module_class_lift_transform_cached': _JIT_STEP,
        'lift_transform_cached': _JIT_STEP,
    },
}

# Names liftmods binds to something deliberately different from Linen's.
DIFFERENT_ON_PURPOSE = {
    'KW_ONLY': "Linen's own marker, which moves keyword-only fields to the "
               'end; liftmods uses dataclasses.KW_ONLY and makes them truly '
               'keyword-only (docs/namespace.md)',
    'CollectionFilter': "liftmods.typing's alias is typing.Any, which takes "
                        "every filter Linen's Union[bool, str, Collection[str], "
                        "DenyList] does",
    'PRNGSequenceFilter': "liftmods.typing's alias is typing.Any, which takes "
                          "every filter Linen's Union[bool, str, "
                          'Collection[str], DenyList] does',
}

# Listed names that the installed flax may no longer have: flax 0.12.12's
# flax.linen.module does not import FlaxId any more.
NOT_IN_EVERY_FLAX = {('module', 'FlaxId')}


def _linen_submodules():
  """flax.linen's submodules on disk: its modules and its packages,
  namespace packages (``experimental``, which has no ``__init__.py``)
  included."""
  names = {m.name for m in pkgutil.iter_modules(flax.linen.__path__)}
  for path in flax.linen.__path__:
    for entry in pathlib.Path(path).iterdir():
      if entry.is_dir() and any(entry.glob('*.py')):
        names.add(entry.name)
  return sorted(names)


MIRRORED = [s for s in _linen_submodules() if s not in NOT_MIRRORED]
LINEN = {s: importlib.import_module(f'flax.linen.{s}') for s in MIRRORED}


def _public(module):
  return {n for n in dir(module) if not n.startswith('_')}


def _missing(sub):
  return sorted(_public(LINEN[sub]) - set(NOT_PROVIDED.get(sub, {}))
                - set(dir(importlib.import_module(f'liftmods.{sub}'))))


# -- every name is there ----------------------------------------------------------


def test_every_linen_submodule_is_mirrored_or_listed():
  for sub in _linen_submodules():
    if sub in NOT_MIRRORED:
      with pytest.raises(ImportError):
        importlib.import_module(f'liftmods.{sub}')
    else:
      assert importlib.import_module(f'liftmods.{sub}') is getattr(
          liftmods, sub)
  assert set(NOT_MIRRORED) <= set(_linen_submodules())
  assert len(MIRRORED) >= 18, MIRRORED


def test_every_top_level_name():
  assert sorted(_public(flax.linen) - set(dir(liftmods))) == []


@pytest.mark.parametrize('sub', MIRRORED)
def test_every_public_name(sub):
  assert _missing(sub) == [], (
      f'flax.linen.{sub} has names liftmods.{sub} lacks: bind them, or list '
      'them in NOT_PROVIDED with the reason')


def test_the_comparison_sees_a_gap(monkeypatch):
  """A name Linen adds and liftmods lacks fails the check."""
  monkeypatch.setattr(LINEN['activation'], 'new_in_linen', object(),
                      raising=False)
  assert _missing('activation') == ['new_in_linen']


# -- the names that mean nothing here ---------------------------------------------


@pytest.mark.parametrize('sub,name', [(s, n) for s, names in
                                      NOT_PROVIDED.items() for n in names])
def test_not_provided_name_raises_a_clear_error(sub, name):
  assert name in _public(LINEN[sub]) or (sub, name) in NOT_IN_EVERY_FLAX
  assert len(NOT_PROVIDED[sub][name]) > 20
  ours = importlib.import_module(f'liftmods.{sub}')
  assert name not in dir(ours)
  with pytest.raises(AttributeError) as info:
    getattr(ours, name)
  message = str(info.value)
  assert message.startswith(
      f'flax.linen.{sub}.{name} is not provided by liftmods.{sub}: ')
  assert len(message.split(': ', 1)[1]) > 30  # the reason
  assert not hasattr(ours, name)


def test_other_missing_names_keep_the_usual_error():
  with pytest.raises(AttributeError,
                     match="^module 'liftmods.summary' has no attribute "
                           "'no_such_name'$"):
    liftmods.summary.no_such_name  # pylint: disable=pointless-statement


# -- every name means the same ----------------------------------------------------


def _counterpart_module(name):
  """liftmods' counterpart of the flax module ``name``."""
  if name == 'flax.linen':
    return 'liftmods'
  if name.startswith('flax.linen.'):
    return 'liftmods' + name[len('flax.linen'):]
  return 'liftmods' + name[len('flax'):]


def _from_flax(obj):
  module = getattr(obj, '__module__', None)
  return isinstance(module, str) and module.split('.')[0] == 'flax'


def _meaning(obj):
  """A type alias's or TypeVar's meaning: its repr (and a TypeVar's bound
  and constraints) with flax's and liftmods' module paths cut to the last
  name."""
  def cut(text):
    return re.sub(r"\b(?:flax|liftmods)(?:\.\w+)+\.(\w+)", r'\1', text)
  if isinstance(obj, typing.TypeVar):
    return ('TypeVar', obj.__name__, cut(repr(obj.__bound__)),
            cut(repr(obj.__constraints__)))
  return cut(repr(obj))


def _same_closure(ours, theirs):
  """Two functions made by the same factory with equal arguments (the
  initializers both libraries build with jax.nn.initializers)."""
  if not (inspect.isfunction(ours) and inspect.isfunction(theirs)):
    return False
  if ours.__code__ is not theirs.__code__:
    return False
  cells = [(a.cell_contents, b.cell_contents) for a, b in
           zip(ours.__closure__ or (), theirs.__closure__ or ())]
  return all(a is b or (not callable(a) and a == b) or _same_closure(a, b)
             for a, b in cells)


def _home(obj):
  """The module that made ``obj`` (a module's own name for a module)."""
  if isinstance(obj, types.ModuleType):
    return obj.__name__
  return getattr(obj, '__module__', None) or type(obj).__module__


def _top_level_names(obj):
  return {n for n in dir(flax.linen) if getattr(flax.linen, n) is obj}


def _difference(theirs, ours):
  """None when ``ours`` means what ``theirs`` means, else why not."""
  if isinstance(theirs, types.ModuleType):
    if not isinstance(ours, types.ModuleType):
      return f'{ours!r} is not a module'
    if theirs.__name__.split('.')[0] == 'flax':
      want = _counterpart_module(theirs.__name__)
      return None if ours.__name__ == want else f'{ours.__name__} != {want}'
    return None if ours is theirs else f'{ours!r} is not {theirs!r}'
  top = _top_level_names(theirs)
  if _from_flax(theirs) and top:
    if any(getattr(liftmods, n) is ours for n in top):
      return None
    return f'{ours!r} is not liftmods.{sorted(top)[0]}'
  if _from_flax(theirs) and not isinstance(theirs, typing.TypeVar):
    if inspect.isclass(theirs) != inspect.isclass(ours):
      return f'{ours!r} and {theirs!r} differ in kind'
    if callable(theirs) and not callable(ours):
      return f'{ours!r} is not callable'
    home = _home(ours) or ''
    return None if home.startswith('liftmods') else f'{ours!r} is not ours'
  if ours is theirs or _same_closure(ours, theirs):
    return None
  try:
    if ours == theirs:
      return None
  except Exception:  # pylint: disable=broad-except
    pass
  if _meaning(ours) == _meaning(theirs):
    return None
  return f'{_meaning(ours)} != {_meaning(theirs)}'


@pytest.mark.parametrize('sub', MIRRORED)
def test_every_name_means_the_same(sub):
  ours = importlib.import_module(f'liftmods.{sub}')
  wrong = {}
  for name in sorted(_public(LINEN[sub]) & set(dir(ours))
                     - set(DIFFERENT_ON_PURPOSE)):
    why = _difference(getattr(LINEN[sub], name), getattr(ours, name))
    if why:
      wrong[name] = why
  assert not wrong, wrong


def test_the_meaning_check_can_fail():
  assert _difference(jax, np) is not None
  assert _difference(flax.linen.initializers, liftmods.linear) is not None
  assert _difference(flax.linen.Dense, liftmods.Conv) is not None
  assert _difference(typing.Any, typing.Optional) is not None
  assert _difference(flax.linen.module.M, typing.TypeVar('M')) is not None
  assert _difference(flax.linen.module.SetupState, len) is not None
  assert _difference(flax.linen.linear.initializers,
                     liftmods.initializers) is None
  assert _difference(flax.linen, liftmods) is None
  assert _difference(flax.linen.linear.default_kernel_init,
                     liftmods.linear.default_kernel_init) is None
  assert _difference(flax.linen.linear.default_kernel_init,
                     liftmods.linear.default_embed_init) is not None


def test_library_names_are_the_same_objects():
  assert liftmods.activation.jnp is jax.numpy
  assert liftmods.linear.eval_shape is jax.eval_shape
  assert liftmods.linear.ShapedArray is flax.linen.linear.ShapedArray
  assert liftmods.normalization.initializers is jax.nn.initializers
  assert liftmods.linear.initializers is liftmods.initializers
  assert liftmods.recurrent.Carry is typing.Any
  assert liftmods.attention.annotations is flax.linen.attention.annotations
  assert liftmods.module.nn is liftmods
  assert liftmods.partitioning.nn is liftmods
  assert liftmods.module.serialization is importlib.import_module(
      'liftmods.serialization')
  assert liftmods.transforms.linen_module is liftmods.module
  assert liftmods.summary.module_lib is liftmods.module


# -- Linen's own names, bound to liftmods' counterparts, behave as Linen's ---------


def test_activation_holds_compact_module_and_dense():
  """brax's activation table reads nn.activation.compact."""
  act = liftmods.activation

  class Model(act.Module):

    @act.compact
    def __call__(self, x):
      return act.relu(act.Dense(2)(x))

  variables = Model().init(jax.random.key(0), np.ones((1, 3), np.float32))
  assert sorted(variables['params']) == ['Dense_0']
  assert act.Module is liftmods.Module and act.Dense is liftmods.Dense


def test_setup_state_is_linens():
  ours = [(s.name, int(s)) for s in liftmods.module.SetupState]
  theirs = [(s.name, int(s)) for s in flax.linen.module.SetupState]
  assert ours == theirs == [('NEW', 0), ('TRANSFORMED', 1), ('DONE', 2)]


def test_test_scope_gives_key_zero_to_every_stream():
  keys = []
  for nn, mod in ((liftmods, liftmods.module), (flax.linen, flax.linen.module)):
    with mod.TestScope({}, rngs={}, mutable=True).temporary() as root:
      dense = nn.Dense(2, parent=root)
      keys.append([jax.random.key_data(dense.make_rng(s))
                   for s in ('params', 'dropout')])
  for ours, theirs in zip(*keys):
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(ours, jax.random.key_data(
        jax.random.key(0)))


def test_descriptor_wrapper_names():
  mod = liftmods.module

  def getter(self):
    return self.missing

  prop = property(getter)
  wrapped = mod.wrap_descriptor_once(prop)
  assert isinstance(wrapped, mod.DescriptorWrapper)
  assert mod.wrap_descriptor_once(wrapped) is wrapped
  assert isinstance(mod.create_descriptor_wrapper(prop), mod.DescriptorWrapper)

  class Foo(liftmods.Module):
    width = prop

  with pytest.raises(liftmods.errors.DescriptorAttributeError):
    Foo().width  # pylint: disable=expression-not-assigned
  assert isinstance(Foo(), mod.ModuleBase)
  assert issubclass(liftmods.Dense, mod.ModuleBase)


def test_sow_defaults_are_tuple_init_and_reduce():
  for mod in (liftmods.module, flax.linen.module):
    assert mod.tuple_init() == ()
    assert mod.tuple_reduce((1,), 2) == (1, 2)
  defaults = inspect.signature(liftmods.Module.sow).parameters
  assert defaults['reduce_fn'].default is liftmods.module.tuple_reduce
  assert defaults['init_fn'].default is liftmods.module.tuple_init


def test_interceptor_alias_types_an_interceptor():
  seen = []

  def interceptor(next_fun, args, kwargs, context):
    seen.append(context.method_name)
    return next_fun(*args, **kwargs)

  typed: liftmods.module.Interceptor = interceptor
  with liftmods.intercept_methods(typed):
    liftmods.Dense(2).init(jax.random.key(0), np.ones((1, 3), np.float32))
  assert seen == ['__call__']


def _placeholders(nn, transforms):
  """The argument placeholders ``get_module_scopes`` makes for a bound
  module and a Variable passed to a call."""
  found = []

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(2)
      y = dense(x)
      var = self.variable('state', 'count', lambda: 0)
      _, args, _ = transforms.get_module_scopes(self, (dense, var), {})
      found.extend(args)
      return y

  Model().init(jax.random.key(0), np.ones((1, 3), np.float32))
  return found


def test_instance_and_variable_placeholders():
  module_slot, var_slot = _placeholders(liftmods, liftmods.transforms)
  assert isinstance(module_slot, liftmods.transforms.InstancePlaceholder)
  assert isinstance(var_slot, liftmods.transforms.VariablePlaceholder)
  linen = _placeholders(flax.linen, flax.linen.transforms)
  assert module_slot.cls is liftmods.Dense and linen[0].cls is flax.linen.Dense
  assert (var_slot.collection, var_slot.name) == (
      linen[1].collection, linen[1].name) == ('state', 'count')


def _vmapped(nn, core_lift, transforms):
  cls = transforms.module_class_lift_transform(
      core_lift.vmap, nn.Dense, variable_axes={'params': 0},
      split_rngs={'params': True}, in_axes=0)
  x = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
  variables = cls(4).init(jax.random.key(1), x)
  return cls.__name__, variables, cls(4).apply(variables, x)


def test_module_class_lift_transform_is_linens():
  import flax.core.lift  # pylint: disable=import-outside-toplevel
  import liftmods.core.lift  # pylint: disable=import-outside-toplevel
  ours = _vmapped(liftmods, liftmods.core.lift, liftmods.transforms)
  theirs = _vmapped(flax.linen, flax.core.lift, flax.linen.transforms)
  assert ours[0] == theirs[0] == 'VmapDense'
  for a, b in zip(jax.tree_util.tree_leaves(ours[1:]),
                  jax.tree_util.tree_leaves(theirs[1:])):
    np.testing.assert_array_equal(a, b, strict=True)


def _lifted_methods(nn, core_lift, transforms):
  """A method lifted with decorator_lift_transform and one run through
  lift_direct_transform, both under core checkpoint."""

  class Model(nn.Module):

    @nn.compact
    def body(self, x):
      return nn.Dense(3)(x)

    def __call__(self, x):
      decorated = transforms.decorator_lift_transform(core_lift.checkpoint,
                                                      Model.body)
      y = decorated(self, x)
      # A direct transform is called with the scope function right away.
      doubled = lambda fn, scopes, y: 2 * fn(scopes, y)
      return transforms.lift_direct_transform(doubled, (Model.body,), self, y)

  x = np.ones((2, 3), np.float32)
  variables = Model().init(jax.random.key(2), x)
  return variables, Model().apply(variables, x)


def test_decorator_and_direct_lift_transforms_are_linens():
  import flax.core.lift  # pylint: disable=import-outside-toplevel
  import liftmods.core.lift  # pylint: disable=import-outside-toplevel
  ours = _lifted_methods(liftmods, liftmods.core.lift, liftmods.transforms)
  theirs = _lifted_methods(flax.linen, flax.core.lift, flax.linen.transforms)
  assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(
      theirs)
  for a, b in zip(jax.tree_util.tree_leaves(ours),
                  jax.tree_util.tree_leaves(theirs)):
    np.testing.assert_array_equal(a, b, strict=True)


# -- under the switch ----------------------------------------------------------------


def test_every_submodule_imports_under_the_switch():
  imported = {}
  with compat.flax_linen_as_liftmods(warn=False):
    for sub in MIRRORED:
      module = importlib.import_module(f'flax.linen.{sub}')
      namespace = {}
      exec(f'from flax.linen import {sub} as found', namespace)  # pylint: disable=exec-used
      imported[sub] = module, namespace['found']
    with pytest.raises(ImportError, match="'flax.linen.experimental'"):
      importlib.import_module('flax.linen.experimental')
    with pytest.raises(AttributeError, match='typing-only field specifier'):
      importlib.import_module('flax.linen.module').module_field  # pylint: disable=expression-not-assigned
    with pytest.raises(ImportError, match="'flax.linen.summary.rich'.*the "
                       'rich module, a dependency of flax'):
      exec('from flax.linen.summary import rich', {})  # pylint: disable=exec-used
  for sub, (module, found) in imported.items():
    ours = getattr(liftmods, sub)
    assert module.__name__ == f'flax.linen.{sub}'
    assert module.__liftmods_module__ is ours
    assert found in (module, ours)
    assert sorted(_public(LINEN[sub]) - set(dir(module))
                  - set(NOT_PROVIDED.get(sub, {}))) == []
    for name in _public(ours):
      assert getattr(module, name) is getattr(ours, name), (sub, name)
