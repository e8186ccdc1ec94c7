"""Module: the Linen-style base class.

Subclasses are dataclasses; ``parent`` and ``name`` are added as keyword-only
fields. A module is *bound* when it has a scope: at the top through
``init``/``apply``/``bind``, below through its parent. Submodules are created
inline in a ``@compact`` method (auto-named ``ClassName_N``) or assigned in
``setup`` (named after the attribute).

>>> import jax, jax.numpy as jnp
>>> import liftmods as nn
>>> class Affine(nn.Module):
...   features: int
...   @nn.compact
...   def __call__(self, x):
...     w = self.param('w', nn.initializers.lecun_normal(),
...                    (x.shape[-1], self.features))
...     return x @ w + self.param('b', nn.initializers.zeros, (self.features,))
>>> variables = Affine(4).init(jax.random.key(0), jnp.ones((1, 3)))
>>> jax.tree_util.tree_map(jnp.shape, variables)
{'params': {'b': (4,), 'w': (3, 4)}}
"""
import dataclasses
import enum
import functools
import inspect
import itertools
import threading
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from liftmods import call_context, config, errors
from liftmods.call_context import MODULE_CALLS, ModuleCall, run_interceptors
# The call hooks under their flax.linen.module names (and record_calls).
from liftmods.call_context import (  # pylint: disable=unused-import
    InterceptorContext, active_interceptors, current_module,
    disable_named_call, enable_named_call, intercept_methods,
    named_call_enabled, override_named_call, record_calls)
from liftmods.core import caching, partial_eval
from liftmods.core import scope as scope_lib
from liftmods.core.filters import DenyList, union
from liftmods.core.frozen_dict import FrozenDict, freeze
from liftmods.core.rngs import as_lazy
from liftmods.core.scope import Scope
from liftmods.descriptors import local_descriptors, wrap_descriptor
from liftmods.traceback_util import api_boundary
# Type aliases Linen code imports from this module (flax.linen.module).
from liftmods.typing import (  # pylint: disable=unused-import
    CollectionFilter, F, FrozenVariableDict, K, PRNGKey, RNGSequences,
    VariableDict)


# This thread's running modules, capture filters, interceptors and recording.
_calls = call_context.calls
# Linen's name for the same per-thread state. Tools written against Linen's
# internals read ``flax.linen.module._context.module_stack[-1]`` to find the
# running module (qwix does); under ``liftmods.compat`` they get this object,
# whose ``module_stack`` and ``capture_stack`` mean what Linen's do.
_context = _calls


# The modules whose own ``__post_init__`` override is running, innermost last
# (per thread): they may still set plain attributes after
# ``super().__post_init__()``.
_post_initializing = threading.local()


def _in_post_init(module) -> bool:
  stack = getattr(_post_initializing, 'stack', None)
  return bool(stack) and stack[-1] is module


def _tracks_post_init(post_init: Callable) -> Callable:
  """Wraps a class's own ``__post_init__`` so that ``__setattr__`` knows it
  runs (InitVar arguments pass through)."""

  @functools.wraps(post_init)
  def wrapped(self, *args, **kwargs):
    if args:  # InitVar values, kept for clone() to pass again
      object.__setattr__(self, '_init_var_values',
                         dict(zip(_init_var_names(type(self)), args)))
    stack = _post_initializing.__dict__.setdefault('stack', [])
    stack.append(self)
    try:
      return post_init(self, *args, **kwargs)
    finally:
      stack.pop()

  wrapped.tracks_post_init = True
  return wrapped


def _init_var_names(cls) -> list[str]:
  """The ``dataclasses.InitVar`` pseudo-fields of ``cls``, in ``__init__``
  order (the order ``__post_init__`` receives them)."""
  return [f.name for f in cls.__dataclass_fields__.values()
          if f._field_type is dataclasses._FIELD_INITVAR]  # pylint: disable=protected-access


class _Unspecified:
  """The default of ``parent``: take the module being run as the parent.
  A singleton, kept identical by copy, deepcopy and pickle."""

  def __repr__(self):
    return '<unspecified parent>'

  def __copy__(self):
    return self

  def __deepcopy__(self, memo):
    return self

  def __reduce__(self):
    return _get_unspecified_parent, ()


def _get_unspecified_parent():
  return _unspecified_parent


_unspecified_parent = _Unspecified()
_ids = itertools.count()


class SetupState(enum.IntEnum):
  """How far ``setup`` has run for a module, with Linen's names and values:
  ``NEW``, not yet; ``TRANSFORMED``, on the module outside a transform (a
  clone made across the boundary starts from there); ``DONE``, on this
  module."""
  NEW = 0
  TRANSFORMED = 1
  DONE = 2


NEW, TRANSFORMED, DONE = SetupState


class _State:
  """Per-instance bookkeeping reset after every compact/setup call."""

  __slots__ = ('in_compact', 'in_setup', 'setup_called', 'initialized',
               'autoname', 'children', 'fields_bound')

  def __init__(self):
    self.fields_bound = False
    self.in_compact = False
    self.in_setup = False
    self.setup_called = NEW
    self.initialized = False
    self.autoname = {}
    self.children = {}

  def reset(self):
    self.in_compact = False
    self.in_setup = False
    self.autoname = {}

  def export(self) -> '_State':
    """The state a clone across a transform boundary starts from."""
    out = _State()
    out.in_compact = self.in_compact
    out.in_setup = self.in_setup
    out.setup_called = TRANSFORMED if self.setup_called else NEW
    out.initialized = self.initialized
    out.autoname = dict(self.autoname)
    return out

  def reimport(self, other: '_State'):
    self.in_compact = other.in_compact
    self.in_setup = other.in_setup
    self.initialized = other.initialized
    self.autoname = dict(other.autoname)


_UNINITIALIZED = _State()


# -- decorators ----------------------------------------------------------------


def compact(fun: F) -> F:
  """Marks a method that may define submodules and variables inline.

  A module may have several compact methods (as in Linen): automatic names
  continue across the ones that run within one outer call.

  Args:
    fun: the method.

  Returns:
    ``fun`` itself, marked.
  """
  fun.compact = True
  return fun


def compact_name_scope(fun: F) -> F:
  """Puts a method's inline submodules under a child named after the method.

  Haiku-style name scopes, e.g. ``up/Dense_0``. The method runs inside a
  ``CompactNameScope`` child created when the module is set up; it can
  also be the ``method=`` of init/apply.

  Args:
    fun: the method.

  Returns:
    The wrapped method. Calling it on a module that is not set up (not
      bound) raises ``ValueError``.

  >>> import jax, jax.numpy as jnp, liftmods as nn
  >>> class Foo(nn.Module):
  ...   @nn.compact_name_scope
  ...   def up(self, x):
  ...     return nn.Dense(3)(x)
  ...   def __call__(self, x):
  ...     return self.up(x)
  >>> params = Foo().init(jax.random.key(0), jnp.ones((1, 2)))['params']
  >>> list(params['up'])
  ['Dense_0']
  """

  @functools.wraps(fun)
  def name_scope_method(self, *args, **kwargs):
    name = fun.__name__
    if not hasattr(self, '_compact_name_scope_modules'):
      raise ValueError(
          f'Cannot call compact_name_scope method {name!r} on a Module that '
          'has not been setup: it only works inside init/apply (or on a '
          f'bound module); got an unbound {type(self).__name__}.')
    return self._compact_name_scope_modules[name](*args, **kwargs)

  name_scope_method.compact_name_scope = True
  name_scope_method.inner_fun = fun
  name_scope_method.nowrap = True
  return name_scope_method


def nowrap(fun: F) -> F:
  """Marks a helper method that is not wrapped with module-state handling.

  For methods that, e.g., only build submodules for a caller.

  Args:
    fun: the method.

  Returns:
    ``fun`` itself, marked.
  """
  fun.nowrap = True
  return fun


# -- method wrapping ----------------------------------------------------------


def wrap_method(fun: F) -> F:
  """Makes ``fun`` a module method with liftmods' call handling.

  Called on a Module, it runs through ``Module._call_wrapped_method`` (lazy
  setup, compact bookkeeping, the module stack, interceptors, call
  recording, named scopes, intermediates capture). Wrapping twice is a
  no-op.

  Args:
    fun: a function taking the module first.

  Returns:
    The wrapped function.
  """
  if getattr(fun, 'method_handler_wrapped', False):
    return fun
  is_compact = getattr(fun, 'compact', False)
  fun_name = getattr(fun, '__name__', 'unnamed')

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    if args and isinstance(args[0], Module):
      return args[0]._call_wrapped_method(fun, fun_name, is_compact,
                                          args[1:], kwargs)
    return fun(*args, **kwargs)

  wrapped.method_handler_wrapped = True
  return wrapped


# Linen's name for :func:`wrap_method`, kept for tools that re-wrap a method
# they unwrapped through ``__wrapped__`` (qwix's model quantization does).
wrap_method_once = wrap_method


# -- trees of submodules -------------------------------------------------------


_LEAF_TYPES = frozenset((int, float, bool, str, type(None), type, complex,
                         types.FunctionType, types.BuiltinFunctionType,
                         functools.partial))


def any_nested(val: Any, pred: Callable[[Any], bool]) -> bool:
  """Whether ``pred`` holds for ``val`` or anything nested in it.

  Lists, tuples and dicts are searched; plain scalars and functions are
  skipped fast.

  Args:
    val: the value.
    pred: the test.

  Returns:
    True when some nested value passes.
  """
  if type(val) in _LEAF_TYPES:
    return False
  if pred(val):
    return True
  if isinstance(val, (list, tuple)):
    return any(any_nested(v, pred) for v in val)
  if isinstance(val, (dict, FrozenDict)):
    return any(any_nested(v, pred) for v in val.values())
  return False


def _is_module(x) -> bool:
  return isinstance(x, Module)


def _has_module(val) -> bool:
  return any_nested(val, _is_module)


def _map_modules(fn, val, suffix=''):
  """Maps ``fn(suffix, module)`` over modules nested in lists/tuples/dicts;
  suffixes are ``_0``, ``_key``, ``_0_key``... as Linen names them."""
  if isinstance(val, Module):
    return fn(suffix, val)
  if isinstance(val, (dict, FrozenDict)):
    return {k: _map_modules(fn, v, f'{suffix}_{k}') for k, v in val.items()}
  if isinstance(val, (list, tuple)) and not hasattr(val, '_fields'):
    return type(val)(_map_modules(fn, v, f'{suffix}_{i}')
                     for i, v in enumerate(val))
  return val


def _module_items(val, path=()):
  """``[(path, module)]`` for the modules nested in lists/tuples/dicts; path
  entries are strings (list positions too), as Linen names them."""
  if isinstance(val, Module):
    return [(path, val)]
  if isinstance(val, (dict, FrozenDict)):
    items = val.items()
  elif isinstance(val, (list, tuple)) and not hasattr(val, '_fields'):
    items = enumerate(val)
  else:
    return []
  out = []
  for k, v in items:
    out += _module_items(v, path + (str(k),))
  return out


def _adopt_shared_first(adopt, val):
  """When one module instance sits at several places of ``val``, adopts it
  at the first place in sorted path order (as Linen does), so that it is
  shared under that one name."""
  items = _module_items(val)
  if len({id(m) for _, m in items}) == len(items):
    return
  for path, sub in sorted(items, key=lambda item: item[0]):
    adopt('_' + '_'.join(path), sub)


def _freeze_attr(val):
  if isinstance(val, (dict, FrozenDict)):
    return FrozenDict({k: _freeze_attr(v) for k, v in val.items()},
                      __unsafe_skip_copy__=True)
  if isinstance(val, list) or (type(val) is tuple):
    return tuple(_freeze_attr(v) for v in val)
  return val


# root scope -> {module id: adopted clone}, so one outside module shared by
# two fields is adopted once. Both levels are weak: an adopted clone refers to
# its root scope, and a strong value would keep the root (and the arrays or
# tracers it holds) alive for good.
_adoptions: 'weakref.WeakKeyDictionary[Scope, weakref.WeakValueDictionary]' = (
    weakref.WeakKeyDictionary())
caching.register('module._adoptions', caching.Policy(
    holds='the clones of modules held in fields, adopted as children '
          '(one per outside module)',
    keyed_on='root scope, then the adopted module\'s id',
    bound='weak at both levels',
    cleared='when the root scope is collected'))

_COPY_PICKLE = frozenset(('__getstate__', '__setstate__', '__getnewargs_ex__',
                          '__reduce__', '__reduce_ex__', '__copy__',
                          '__deepcopy__'))


def tuple_reduce(xs: tuple, x: Any) -> tuple:
  """The default ``reduce_fn`` of ``Module.sow``: appends ``x``.

  Args:
    xs: the values sown so far.
    x: the new value.

  Returns:
    ``xs + (x,)``.
  """
  return xs + (x,)


def tuple_init() -> tuple:
  """The default ``init_fn`` of ``Module.sow``: an empty tuple.

  Returns:
    ``()``.
  """
  return ()


def capture_call_intermediates(module: 'Module', method_name: str) -> bool:
  """The default filter of ``capture_intermediates=True``.

  Args:
    module: the module whose method returned.
    method_name: the method's name.

  Returns:
    True for ``__call__``.
  """
  return method_name == '__call__'


def named_call_label(module: 'Module', method_name: str) -> str:
  """The name a method call of ``module`` shows under in profiles.

  Args:
    module: the module whose method is called.
    method_name: the method's name.

  Returns:
    The module's name (or class name), with ``.method_name`` added for
      methods other than ``__call__``.
  """
  label = module.name or type(module).__name__
  if method_name != '__call__':
    label = f'{label}.{method_name}'
  return label


DECLINED = object()  # what a ``Module._fast_apply`` returns to decline


class Module:
  """Base class of all modules; see the module docstring.

  Subclasses declare their configuration as dataclass fields; two
  keyword-only fields are added to every subclass.

  Attributes:
    parent: the module (or scope) this one is attached to; by default the
      module whose method is running when it is constructed, None for a
      top-level module.
    name: the module's name in its parent; by default the attribute name
      (in ``setup``) or ``ClassName_N`` (in a compact method).
    scope: the scope holding the module's variables and rngs while it is
      bound; None for an unbound module.
  """

  scope: Scope | None = None
  _state = _UNINITIALIZED
  _init_field_names: tuple = ()
  _setup_overridden = False
  _compact_name_scope_methods: tuple = ()
  # A plain ``apply`` (``__call__``, no rngs, nothing mutable, no capture)
  # hands off to this when a class sets it: ``nn.jit`` does, to skip the
  # scope round trip on every call. It returns ``DECLINED`` to run as usual.
  _fast_apply: Callable | None = None

  def __init_subclass__(cls, kw_only: bool = False, **kwargs):
    super().__init_subclass__(**kwargs)
    post_init = cls.__dict__.get('__post_init__')
    if callable(post_init) and not getattr(post_init, 'tracks_post_init',
                                           False):
      cls.__post_init__ = _tracks_post_init(post_init)
    cls._dataclass_transform(kw_only)
    cls._wrap_methods()
    cls._init_field_names = tuple(
        f.name for f in dataclasses.fields(cls) if f.init)
    cls._setup_overridden = cls.setup is not Module.setup
    cls._compact_name_scope_methods = tuple(
        n for n in dir(cls)
        if getattr(getattr(cls, n, None), 'compact_name_scope', False))

  @classmethod
  def _dataclass_transform(cls, kw_only: bool):
    if '__dataclass_fields__' in cls.__dict__:
      # ``dataclass(slots=True)`` re-creating a class already transformed
      # (Linen accepts it): its fields, parent and name included, stand.
      return
    annotations = cls.__dict__.get('__annotations__', {})
    if 'parent' in annotations or ('name' in annotations and (
        annotations['name'] not in (str, 'str', 'Optional[str]', str | None))):
      raise errors.ReservedModuleAttributeError(annotations)
    if 'parent' not in getattr(cls, '__dataclass_fields__', {}):
      if '__annotations__' not in cls.__dict__:
        cls.__annotations__ = {}
      cls.__annotations__['parent'] = Any
      cls.parent = dataclasses.field(default=_unspecified_parent, repr=False,
                                     hash=False, kw_only=True)
      cls.__annotations__['name'] = str | None
      cls.name = dataclasses.field(default=None, kw_only=True)
    for f in annotations:
      field = cls.__dict__.get(f)
      if isinstance(field, dataclasses.Field) and not field.init:
        field.compare = field.hash = field.repr = False
    dataclasses.dataclass(cls, eq=True, repr=False, kw_only=kw_only,
                          unsafe_hash='__hash__' not in cls.__dict__)
    fields = cls.__dataclass_fields__
    for reserved in ('parent', 'name'):  # keep them last, as Linen does
      fields[reserved] = fields.pop(reserved)
    cls.__hash__ = _checked_hash(cls.__hash__)

  @classmethod
  def _wrap_methods(cls):
    fields = set(cls.__dataclass_fields__)
    for key, attr in list(cls.__dict__.items()):
      if key.startswith('__') and key != '__call__':
        continue
      if key in fields or not callable(attr) or inspect.isclass(attr):
        continue
      if isinstance(attr, (staticmethod, classmethod)):
        continue
      if getattr(attr, 'nowrap', False):
        continue
      setattr(cls, key, wrap_method(attr))
    for key in local_descriptors(cls, fields | {'parent', '__dict__'}):
      attr = cls.__dict__[key]
      if not getattr(attr, 'nowrap', False):
        setattr(cls, key, wrap_descriptor(attr))

  # -- construction ------------------------------------------------------------

  def __post_init__(self):
    object.__setattr__(self, '_id', next(_ids))
    object.__setattr__(self, '_state', _State())
    parent = self.parent
    if parent is _unspecified_parent:
      parent = _calls.module_stack[-1]
      object.__setattr__(self, 'parent', parent)
    if parent is None:  # a top-level module stays settable until bound
      return
    if isinstance(parent, Module):
      if not self._attach_to(parent):
        return
    elif isinstance(parent, Scope):
      object.__setattr__(self, 'scope', parent)
    else:
      raise ValueError(f'parent of {type(self).__name__} must be a Module, '
                       f'a Scope or None, got {type(parent).__name__}')
    self._bind_fields()
    self._state.initialized = True

  def _attach_to(self, parent: 'Module') -> bool:
    """Names this module and pushes its scope under ``parent``; False when
    attachment waits for a setup() attribute assignment."""
    pstate = parent._state
    if pstate.in_setup and self.name is None:
      return False
    if not parent._initialization_allowed:
      raise errors.AssignSubModuleError(
          type(self).__name__,
          f'created in {type(parent).__name__} at '
          f'{parent.scope.path_text if parent.scope else "<unbound>"}')
    if parent.scope is None:
      raise errors.CallCompactUnboundModuleError(type(parent).__name__)
    name = self.name
    if name is None:
      prefix = type(self).__name__
      cursor = pstate.autoname.get(prefix, 0)
      name = f'{prefix}_{cursor}'
      pstate.autoname[prefix] = cursor + 1
      object.__setattr__(self, 'name', name)
    reuse = pstate.in_setup and pstate.setup_called == TRANSFORMED
    if not reuse and parent.scope.name_reserved(name):
      raise errors.NameInUseError('submodule', name, type(parent).__name__,
                                  path=parent.scope.path_text)
    pstate.children[name] = self
    object.__setattr__(self, 'scope', parent.scope.push(name, reuse=reuse))
    return True

  def _bind_fields(self):
    """Adopts modules held in dataclass fields and freezes container fields
    (lists become tuples, dicts FrozenDicts), once per bound instance."""
    for n in self._init_field_names:
      v = _field_value(self, n)
      if n != 'parent' and isinstance(v, _CONTAINERS):
        self._register_submodules(n, v)
    self._state.fields_bound = True

  def _register_submodules(self, name: str, val):
    """Adopts the modules in ``val`` as children named after ``name``."""
    root = self.scope.root
    cache = _adoptions.get(root)
    if cache is None:
      cache = _adoptions[root] = weakref.WeakValueDictionary()
    queue = []
    preserve = getattr(type(self), 'preserve_adopted_names',
                       config.FLAG_VALUES['flax_preserve_adopted_names'])

    def adopt(suffix, sub):
      own_name = None
      if sub.parent is None:
        if preserve or isinstance(sub, CompactNameScope):
          own_name = sub.name
        key = sub._id
        hit = cache.get(key)
        if hit is None:
          hit = sub.clone(name=None)
          cache[key] = hit
        sub = hit
      if sub.name is None:
        object.__setattr__(sub, 'parent', self)
        object.__setattr__(sub, 'name', own_name or f'{name}{suffix}')
        queue.append(sub)
      return sub

    if _has_module(val):
      if not isinstance(val, Module):
        _adopt_shared_first(adopt, val)
      val = _map_modules(adopt, val)
    object.__setattr__(self, name, _freeze_attr(val))
    for sub in queue:
      sub.__post_init__(*sub.__dict__.get('_init_var_values', {}).values())

  def __setattr__(self, name: str, val):
    state = self._state
    if not state.in_setup:
      if (not state.initialized or name.startswith('__')
          or self._derived_in_post_init(name, val)):
        object.__setattr__(self, name, val)
        return
      raise errors.SetAttributeFrozenModuleError(type(self).__name__, name,
                                                 val)
    if name in self._init_field_names:
      raise errors.SetAttributeInModuleSetupError(type(self).__name__, name)
    self._register_submodules(name, val)

  def _derived_in_post_init(self, name: str, val) -> bool:
    """A plain attribute set by the module's own ``__post_init__`` after
    ``super().__post_init__()`` (Linen refuses it, flax#2479): not a field,
    and holding no submodule (those belong in ``setup``)."""
    return (_in_post_init(self) and name not in self.__dataclass_fields__
            and not any(isinstance(x, Module) for x in jax.tree_util.tree_leaves(
                val, is_leaf=lambda x: isinstance(x, Module))))

  def __getattr__(self, name: str):
    if name in _COPY_PICKLE or name.startswith('__'):
      raise AttributeError(name)
    self._try_setup()
    if name in self.__dict__:
      return self.__dict__[name]
    msg = f'"{type(self).__name__}" object has no attribute "{name}".'
    if self.scope is None:
      msg += (f' If "{name}" is defined in setup(), it exists only while the '
              'module is bound (inside init/apply, or after bind()).')
    raise AttributeError(msg)

  def __dir__(self):
    self._try_setup()
    return object.__dir__(self)

  def __repr__(self):
    return _module_repr(self)

  # -- setup and method calls ----------------------------------------------------

  def setup(self) -> None:
    """Override to define submodules and variables lazily.

    Runs once, on the first method call or setup-attribute access of a
    bound module.
    """

  def _try_setup(self, shallow: bool = False):
    state = self._state
    if state.setup_called == DONE or state.in_setup or self.scope is None:
      return
    try:
      state.in_setup = True
      if not state.fields_bound:
        self._bind_fields()
      if not shallow:
        self.setup()
        if self._compact_name_scope_methods:
          self._make_name_scopes()
    finally:
      state.in_setup = False
      if not shallow:
        state.setup_called = DONE

  def _make_name_scopes(self):
    """One ``CompactNameScope`` child per ``@compact_name_scope`` method.
    Like Linen, they are built after ``setup()`` returns, so their parent is
    whichever module is running then (see docs/architecture.md)."""
    cls = type(self)
    self._compact_name_scope_modules = {
        name: CompactNameScope(getattr(cls, name).inner_fun,
                               lambda: self, name=name)
        for name in self._compact_name_scope_methods}

  @property
  def _initialization_allowed(self) -> bool:
    state = self._state
    return not state.initialized or state.in_setup or state.in_compact

  def _call_wrapped_method(self, fun, fun_name, is_compact, args, kwargs):
    state = self._state
    is_setup = fun_name == 'setup'
    context = _calls
    recorded = None
    if context.records and not is_setup and self.scope is not None:
      into = context.records.get(MODULE_CALLS)
      if into is not None:
        recorded = ModuleCall.enter(into, self, fun_name, args, kwargs)
    if is_setup:
      if self.scope is None:
        raise errors.CallSetupUnboundModuleError(type(self).__name__)
      recurrent = state.in_setup
      state.in_setup = True
    else:
      if state.setup_called != DONE:
        self._try_setup()
    if is_compact:
      if self.scope is None:
        raise errors.CallCompactUnboundModuleError(type(self).__name__)
      recurrent = state.in_compact
      state.in_compact = True
    stack = context.module_stack
    stack.append(self)
    try:
      run = (functools.partial(run_interceptors, fun) if context.interceptors
             else fun)
      if call_context.named_call_enabled() and self.scope is not None:
        with jax.named_scope(named_call_label(self, fun_name)):
          y = run(self, *args, **kwargs)
      else:
        y = run(self, *args, **kwargs)
      capture = context.capture_stack
      if capture and capture[-1] and capture[-1](self, fun_name):
        self.sow('intermediates', fun_name, y)
      if recorded is not None:
        recorded.outputs = call_context.abstract_arrays(y)
      return y
    finally:
      stack.pop()
      if is_compact:
        object.__setattr__(self, 'scope', self.scope.rewound())
      if (is_compact or is_setup) and not recurrent:
        state.reset()

  # -- cloning ---------------------------------------------------------------------

  def clone(self, *, parent: Any = None,
            _deep_clone: bool | dict = False, _reset_names: bool = False,
            **updates: Any) -> 'Module':
    """A copy of the module with some fields replaced.

    Args:
      parent: the parent of the copy (default: none, unattached).
      _deep_clone: also clone the submodules held in fields (True, or a
        cache dict shared between calls).
      _reset_names: with ``_deep_clone``, clear the submodules' names.
      **updates: new values of fields.

    Returns:
      The new module, of the same class.
    """
    attrs = {n: _field_value(self, n) for n in self._init_field_names}
    attrs.update(self.__dict__.get('_init_var_values', {}))
    attrs['parent'] = parent
    attrs.update(updates)
    if _deep_clone is not False:
      cache = {} if _deep_clone is True else _deep_clone

      def clone_sub(_, m):
        hit = cache.get(m._id)
        if hit is None:
          extra = {'name': None} if _reset_names else {}
          hit = cache[m._id] = m.clone(_deep_clone=cache,
                                       _reset_names=_reset_names, **extra)
        return hit

      for n, v in attrs.items():
        if n != 'parent' and _has_module(v):
          attrs[n] = _map_modules(clone_sub, v)
    return type(self)(**attrs)

  def copy(self, *, parent: Any = _unspecified_parent,
           name: str | None = None, **updates: Any) -> 'Module':
    """A deep copy (submodules too), attached to a new parent.

    Args:
      parent: the parent of the copy (default: the running module).
      name: the copy's name (default: a new automatic name).
      **updates: new values of fields.

    Returns:
      The new module, of the same class.
    """
    return self.clone(parent=parent, name=name, _deep_clone=True, **updates)

  # -- variables and rngs ------------------------------------------------------------

  def _require_scope(self, linen_wording: str) -> Scope:
    if self.scope is None:
      raise errors.UnboundModuleError(type(self).__name__, linen_wording)
    return self.scope

  def _reserve_check(self, scope: Scope, kind: str, name: str, col: str):
    if scope.name_reserved(name, col):
      raise errors.NameInUseError(kind, name, type(self).__name__,
                                  path=scope.path_text)

  def param(self, name: str, init_fn: Callable[..., Any], *init_args: Any,
            unbox: bool = True, **init_kwargs: Any) -> Any:
    """Declares parameter ``name`` in the ``params`` collection.

    During init it is created as ``init_fn(rng, *init_args,
    **init_kwargs)`` with a key of the ``params`` rng sequence; afterwards
    the stored value is returned.

    Args:
      name: the parameter's name in this module.
      init_fn: the initializer, ``init_fn(key, *init_args, **init_kwargs)``.
      *init_args: further arguments of ``init_fn`` (usually shape, dtype).
      unbox: return the value inside an axis-metadata box (e.g.
        ``Partitioned``) rather than the box.
      **init_kwargs: keyword arguments of ``init_fn``.

    Returns:
      The parameter's value.

    Raises:
      ValueError: called outside ``setup`` or a compact method.
      NameInUseError: ``name`` is already taken in this module.
    """
    if not self._initialization_allowed:
      raise ValueError('Parameters must be initialized in `setup()` or in a '
                       'method wrapped in `@compact` '
                       f'({type(self).__name__}.{name}).')
    scope = self._require_scope(_NO_VARIABLES)
    self._reserve_check(scope, 'param', name, 'params')
    value = scope.param(name, init_fn, *init_args, unbox=unbox, **init_kwargs)
    self._state.children[name] = 'params'
    return value

  def variable(self, col: str, name: str,
               init_fn: Callable[..., Any] | None = None, *init_args: Any,
               unbox: bool = True, **init_kwargs: Any) -> scope_lib.Variable:
    """Declares variable ``name`` of collection ``col``.

    Args:
      col: the collection, e.g. ``'batch_stats'``.
      name: the variable's name in this module.
      init_fn: makes the initial value, ``init_fn(*init_args,
        **init_kwargs)`` (no key is passed), when the variable is missing.
      *init_args: arguments of ``init_fn``.
      unbox: ``.value`` unboxes axis metadata.
      **init_kwargs: keyword arguments of ``init_fn``.

    Returns:
      A reference whose ``.value`` can be read and, if ``col`` is mutable,
        written.

    Raises:
      ValueError: called outside ``setup`` or a compact method.
      NameInUseError: ``name`` is already taken in this module.
    """
    if not self._initialization_allowed:
      raise ValueError('Variables must be initialized in `setup()` or in a '
                       'method wrapped in `@compact` '
                       f'({type(self).__name__}.{name}).')
    scope = self._require_scope(_NO_VARIABLES)
    self._reserve_check(scope, 'variable', name, col)
    v = scope.variable(col, name, init_fn, *init_args, unbox=unbox,
                       **init_kwargs)
    self._state.children[name] = col
    return v

  def has_variable(self, col: str, name: str) -> bool:
    """Whether this module has variable ``name`` in collection ``col``.

    Args:
      col: the collection.
      name: the variable's name.

    Returns:
      True when the variable exists.
    """
    return self._require_scope(_NO_VARIABLES).has_variable(col, name)

  def get_variable(self, col: str, name: str, default: Any = None) -> Any:
    """The value of variable ``name`` of collection ``col``.

    Args:
      col: the collection.
      name: the variable's name.
      default: returned when the variable does not exist.

    Returns:
      The value, or ``default``.
    """
    return self._require_scope(_NO_VARIABLES).get_variable(col, name,
                                                               default)

  def put_variable(self, col: str, name: str, value: Any) -> None:
    """Sets variable ``name`` of collection ``col`` (creating it if needed).

    Args:
      col: the collection; it must be mutable.
      name: the variable's name.
      value: the new value.
    """
    self._require_scope(_NO_VARIABLES).put_variable(col, name, value)

  def is_mutable_collection(self, col: str) -> bool:
    """Whether collection ``col`` may be written in this call.

    Args:
      col: the collection.

    Returns:
      True when ``col`` is mutable.
    """
    return self._require_scope("Can't check mutability on unbound modules").is_mutable_collection(col)

  def has_rng(self, name: str) -> bool:
    """Whether rng sequence ``name`` was given to this call.

    Args:
      name: the rng sequence, e.g. ``'dropout'``.

    Returns:
      True when keys of ``name`` can be made.
    """
    return self._require_scope("Can't query for RNGs on unbound modules").has_rng(name)

  def make_rng(self, name: str = 'params') -> PRNGKey:
    """A new key from rng sequence ``name``.

    Every call returns a different key; a sequence that was not given falls
    back to ``'params'``.

    Args:
      name: the rng sequence.

    Returns:
      A PRNG key.
    """
    return self._require_scope("Can't use RNGs on unbound modules").make_rng(name)

  def is_initializing(self) -> bool:
    """Whether the module runs under ``init`` / ``init_with_output``.

    Returns:
      True during initialization.
    """
    return bool(self._require_scope("Can't check if running under init() on unbound modules").get_flag(
        'initializing', False))

  @property
  def variables(self) -> dict:
    found = self._require_scope(_NO_VARIABLES).variables()
    if config.FLAG_VALUES['flax_return_frozendict']:
      return freeze(found)
    return found

  @property
  def path(self) -> tuple:
    return self._require_scope("Can't access module paths on unbound modules.").path

  def sow(self, col: str, name: str, value: Any,
          reduce_fn: Callable[[Any, Any], Any] = tuple_reduce,
          init_fn: Callable[[], Any] = tuple_init) -> bool:
    """Stores an intermediate value in collection ``col``.

    A no-op when ``col`` is not mutable.

    Args:
      col: the collection, e.g. ``'intermediates'``.
      name: the variable's name.
      value: the value to store.
      reduce_fn: combines the stored value with ``value`` (by default,
        appends to a tuple).
      init_fn: makes the stored value before the first ``value`` (by
        default, an empty tuple).

    Returns:
      True when the value was stored, False when ``col`` is not mutable.
    """
    scope = self._require_scope(_NO_STORE)
    if not scope.is_mutable_collection(col):
      return False
    if scope.has_variable(col, name):
      xs = scope.get_variable(col, name)
    else:
      scope.reserve(name, col)
      self._state.children[name] = col
      xs = init_fn()
    scope.put_variable(col, name, reduce_fn(xs, value))
    return True

  def perturb(self, name: str, value: Any,
              collection: str = 'perturbations') -> Any:
    """Adds a zero variable to ``value``, to take gradients with respect to it.

    During init (with ``collection`` mutable) the zeros are created; when
    ``collection`` is passed to apply, its entry is added to ``value``, so
    the gradient with respect to it is the gradient with respect to
    ``value``.

    Args:
      name: the variable's name.
      value: the intermediate value (any pytree of arrays).
      collection: the collection holding the perturbations.

    Returns:
      ``value``, plus the perturbation when there is one.

    Raises:
      ValueError: ``collection`` is given but lacks ``name``.
    """
    scope = self._require_scope(_NO_STORE)
    if scope.is_mutable_collection(collection) and not scope.has_variable(
        collection, name):
      scope.reserve(name, collection)
      self._state.children[name] = collection
      scope.put_variable(collection, name,
                         jax.tree_util.tree_map(jnp.zeros_like, value))
    if collection in scope.root._variables:
      if not scope.has_variable(collection, name):
        raise ValueError(f'Collection "{collection}" is present but has no '
                         f'perturbation "{name}" at {scope.path_text}.')
      value = jax.tree_util.tree_map(jnp.add, value,
                                     scope.get_variable(collection, name))
    return value

  # -- entry points -----------------------------------------------------------------

  def _module_checks(self):
    if not isinstance(self, Module):
      raise errors.InvalidInstanceModuleError()
    if '_id' not in self.__dict__:
      raise errors.IncorrectPostInitOverrideError()

  def _resolve_method(self, method):
    if isinstance(method, str):
      attr = getattr(self, method)
      if isinstance(attr, Module):
        return lambda m, *a, **k: getattr(m, method)(*a, **k)
      if not callable(attr):
        raise TypeError(f"'{type(self).__name__}.{method}' must be a callable, "
                        f'got {type(attr)}.')
      method = attr
    elif method is None:
      method = self.__call__
    return unbound_method(method)

  @api_boundary
  def apply(self, variables: VariableDict, *args: Any,
            rngs: PRNGKey | RNGSequences | None = None,
            method: Callable[..., Any] | str | None = None,
            mutable: CollectionFilter = False,
            capture_intermediates: bool | Callable[['Module', str], bool] = False,
            **kwargs: Any) -> Any:
    """Runs a method of the module with the given variables.

    Args:
      variables: ``{collection: {...}}``, e.g. the output of ``init``.
      *args: the method's arguments.
      rngs: a key (for ``'params'``) or ``{sequence name: key}``.
      method: the method to run, a function of the module or a method name
        (default ``__call__``).
      mutable: the collections the method may change (True: all).
      capture_intermediates: True stores every method's output in
        ``intermediates``; a function ``(module, method_name) -> bool``
        chooses which.
      **kwargs: the method's keyword arguments.

    Returns:
      The output, or ``(output, mutated_collections)`` when ``mutable``.

    Raises:
      InvalidRngError: ``rngs`` is not a key or a dict of keys.
    """
    Module._module_checks(self)
    if (self._fast_apply is not None and method is None and rngs is None
        and mutable is False and capture_intermediates is False):
      y = self._fast_apply(variables, args, kwargs)
      if y is not DECLINED:
        return y
    if rngs is not None:
      _check_key(self, rngs)
    fn = self._resolve_method(method)
    capture, mutable = _with_capture(capture_intermediates, mutable)
    return scope_lib.run(
        lambda scope: _call_bound(scope, fn, self, capture, args, kwargs),
        variables, (), {}, rngs, mutable)

  @api_boundary
  def init_with_output(self, rngs: PRNGKey | RNGSequences, *args: Any,
                       method: Callable[..., Any] | str | None = None,
                       mutable: CollectionFilter = DenyList('intermediates'),
                       capture_intermediates: bool | Callable[['Module', str], bool] = False,
                       **kwargs: Any) -> tuple[Any, dict]:
    """Initializes the variables by running a method.

    Args:
      rngs: a key (for ``'params'``) or ``{sequence name: key}``.
      *args: the method's arguments.
      method: the method to run (default ``__call__``).
      mutable: the collections created (by default all but
        ``intermediates``).
      capture_intermediates: as for ``apply``.
      **kwargs: the method's keyword arguments.

    Returns:
      ``(output, variables)``.

    Raises:
      InvalidRngError: ``rngs`` is not a key or a dict of keys.
    """
    Module._module_checks(self)
    _check_key(self, rngs)
    fn = self._resolve_method(method)
    return init_with_output(fn, self, mutable=mutable,
                            capture_intermediates=capture_intermediates)(
                                rngs, *args, **kwargs)

  @api_boundary
  def init(self, rngs: PRNGKey | RNGSequences, *args: Any,
           method: Callable[..., Any] | str | None = None,
           mutable: CollectionFilter = DenyList('intermediates'),
           capture_intermediates: bool | Callable[['Module', str], bool] = False,
           **kwargs: Any) -> dict:
    """Initializes the variables by running a method.

    Args:
      rngs: a key (for ``'params'``) or ``{sequence name: key}``.
      *args: the method's arguments.
      method: the method to run (default ``__call__``).
      mutable: the collections created (by default all but
        ``intermediates``).
      capture_intermediates: as for ``apply``.
      **kwargs: the method's keyword arguments.

    Returns:
      The variables, ``{collection: {...}}``.

    Raises:
      InvalidRngError: ``rngs`` is not a key or a dict of keys.
    """
    Module._module_checks(self)
    return self.init_with_output(
        rngs, *args, method=method, mutable=mutable,
        capture_intermediates=capture_intermediates, **kwargs)[1]

  @api_boundary
  def lazy_init(self, rngs: PRNGKey | RNGSequences, *args: Any,
                method: Callable[..., Any] | str | None = None,
                mutable: CollectionFilter = DenyList('intermediates'),
                **kwargs: Any) -> dict:
    """Initializes the variables without computing on the inputs.

    Inputs may be ``jax.ShapeDtypeStruct``s (only their shapes and dtypes
    are used).

    Args:
      rngs: a key (for ``'params'``) or ``{sequence name: key}``.
      *args: the method's arguments (arrays or ShapeDtypeStructs).
      method: the method to run (default ``__call__``).
      mutable: the collections created.
      **kwargs: the method's keyword arguments.

    Returns:
      The variables, ``{collection: {...}}``.

    Raises:
      LazyInitError: a variable's value depends on an input.

    >>> import jax, jax.numpy as jnp, liftmods as nn
    >>> big = jax.ShapeDtypeStruct((1 << 28, 1024), jnp.float32)  # 1 TB
    >>> variables = nn.Dense(2).lazy_init(jax.random.key(0), big)
    >>> variables['params']['kernel'].shape
    (1024, 2)
    """
    Module._module_checks(self)

    def init_variables(rngs, *args, **kwargs):
      return self.init(rngs, *args, method=method, mutable=mutable, **kwargs)

    return partial_eval.lazy_init(init_variables)(rngs, *args, **kwargs)

  @api_boundary
  def module_paths(self, rngs: PRNGKey | RNGSequences, *args: Any,
                   show_repeated: bool = False,
                   mutable: CollectionFilter = DenyList('intermediates'),
                   **kwargs: Any) -> dict:
    """The modules that ``init`` calls, by path.

    Runs under ``jax.eval_shape``, so nothing is computed.

    Args:
      rngs: a key (for ``'params'``) or ``{sequence name: key}``.
      *args: the arguments of ``__call__``.
      show_repeated: list a module called several times once per call.
      mutable: the collections init creates.
      **kwargs: keyword arguments of ``__call__``.

    Returns:
      ``{path: unbound copy of the module called there}``; the root's path
        is ``''``.

    >>> import jax, jax.numpy as jnp, liftmods as nn
    >>> class Foo(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     h = nn.Dense(4)(x)
    ...     return nn.Dense(2)(h)
    >>> paths = Foo().module_paths(jax.random.key(0), jnp.ones((16, 9)))
    >>> {p: type(m).__name__ for p, m in paths.items()}
    {'': 'Foo', 'Dense_0': 'Dense', 'Dense_1': 'Dense'}
    """
    from liftmods.summary import module_calls  # summary imports this module
    calls = module_calls(self, rngs, args, {'mutable': mutable, **kwargs},
                         show_repeated)
    return {'/'.join(c.path): c.module.copy(parent=None) for c in calls}

  def bind(self, variables: VariableDict, *args: Any,
           rngs: PRNGKey | RNGSequences | None = None,
           mutable: CollectionFilter = False) -> 'Module':
    """A copy of the module bound to ``variables``, for interactive use.

    Args:
      variables: ``{collection: {...}}``.
      *args: ignored (accepted for Linen compatibility).
      rngs: a key or ``{sequence name: key}`` for ``make_rng``.
      mutable: the collections the bound module may change.

    Returns:
      The bound copy; its methods can be called directly.
    """
    Module._module_checks(self)
    del args
    return self.clone(
        parent=scope_lib.bind(variables, rngs=rngs, mutable=mutable),
        _deep_clone=True)

  def unbind(self) -> tuple['Module', dict]:
    """Splits a bound module into an unbound copy and its variables.

    Returns:
      ``(unbound_copy, variables)``.

    Raises:
      CallUnbindOnUnboundModuleError: the module is not bound.
    """
    if self.scope is None:
      raise errors.CallUnbindOnUnboundModuleError(type(self).__name__)
    module = self.clone(_deep_clone=True, _reset_names=True, name=None)
    return module, _copy_dicts(self.variables)

  @api_boundary
  def tabulate(self, rngs: PRNGKey | RNGSequences, *args: Any,
               **kwargs: Any) -> str:
    """A table of submodules, shapes and parameter counts.

    Args:
      rngs: a key (for ``'params'``) or ``{sequence name: key}``.
      *args: the arguments of ``__call__``.
      **kwargs: keyword arguments of ``__call__``, and the table options of
        ``liftmods.tabulate`` (``depth``, ``console_kwargs``, ...).

    Returns:
      The table, as text.
    """
    from liftmods import summary  # summary imports this module
    table_kwargs = {k: kwargs.pop(k) for k in list(kwargs)
                    if k in summary.TABULATE_OPTIONS}
    return summary.tabulate(self, rngs, **table_kwargs)(*args, **kwargs)


_CONTAINERS = (Module, list, tuple, dict, FrozenDict)
_NO_VARIABLES = "Can't access variables on unbound modules"
_NO_STORE = "Can't store variables on unbound modules"


def _copy_dicts(tree):
  """New dicts all the way down (leaves shared), so that a returned tree
  aliases none of the containers the caller passed in or the module holds."""
  if isinstance(tree, dict):
    return {k: _copy_dicts(v) for k, v in tree.items()}
  return tree


def _check_key(module: Module, rngs):
  """A bare (non-dict) rng given to init/apply must be a PRNG key."""
  if isinstance(rngs, Mapping):
    return
  try:
    as_lazy('params', rngs)
  except errors.InvalidRngError:
    raise errors.InvalidRngError(
        'RNGs should be of shape (2,) or PRNGKey in Module '
        f'{type(module).__name__}, but rngs are: {rngs} (expected '
        'jax.random.key(seed) or jax.random.PRNGKey(seed), or a dict '
        '{sequence_name: key}).') from None


def _checked_hash(hash_fn):

  @functools.wraps(hash_fn)
  def wrapped(self):
    if self.scope is not None:
      raise TypeError("Can't call __hash__ on modules that hold variables. "
                      f'({type(self).__name__} is bound; hash an unbound '
                      'module instead.)')
    try:
      return hash_fn(self)
    except TypeError as e:
      raise TypeError('Failed to hash Flax Module.  The module probably '
                      f'contains unhashable attributes.  Module={self} '
                      f'({e})') from e

  return wrapped


_VALID_METHODS: 'weakref.WeakKeyDictionary' = weakref.WeakKeyDictionary()
caching.register('module._VALID_METHODS', caching.Policy(
    holds='methods `unbound_method` has checked',
    keyed_on='the method function',
    bound='weak',
    cleared='when the function is collected'), clear=_VALID_METHODS.clear)


def unbound_method(method: Callable[..., Any]) -> Callable[..., Any]:
  """The plain function behind ``method`` (a Module's bound method is unwrapped).

  Args:
    method: a function or a bound method of a Module.

  Returns:
    The function, which takes the module as its first argument.

  Raises:
    ApplyModuleInvalidMethodError: ``method`` is not callable or takes no
      argument.
  """
  if inspect.ismethod(method) and isinstance(method.__self__, Module):
    method = method.__func__
  try:
    if method in _VALID_METHODS:
      return method
  except TypeError:  # unhashable or not weakly referenceable
    pass
  if not callable(method):
    raise errors.ApplyModuleInvalidMethodError(method)
  try:
    n_params = len(inspect.signature(method).parameters)
  except (TypeError, ValueError):
    n_params = 1
  if n_params < 1:
    raise errors.ApplyModuleInvalidMethodError(method)
  try:
    _VALID_METHODS[method] = True
  except TypeError:
    pass
  return method


def _field_value(module: Module, name: str):
  """A dataclass field's value, in the instance dict or, for a class
  rebuilt by ``dataclass(slots=True)``, in its slot."""
  try:
    return module.__dict__[name]
  except KeyError:
    return object.__getattribute__(module, name)


def _module_repr(module: Module, indent: int = 0) -> str:
  cls = type(module)
  fields = [f for f in dataclasses.fields(cls)
            if f.name not in ('parent', 'name') and f.repr]
  if not fields:
    return f'{cls.__name__}()'
  pad = ' ' * (indent + 4)
  lines = []
  for f in fields:
    v = _field_value(module, f.name)
    text = _module_repr(v, indent + 4) if isinstance(v, Module) else repr(v)
    lines.append(f'{pad}{f.name} = {text}')
  return f'{cls.__name__}(\n' + '\n'.join(lines) + '\n' + ' ' * indent + ')'


# -- functional entry points --------------------------------------------------------


def _with_capture(capture_intermediates, mutable):
  if capture_intermediates is True:
    capture_intermediates = capture_call_intermediates
  if capture_intermediates:
    mutable = union(mutable, 'intermediates')
  return capture_intermediates, mutable


def _call_bound(scope, fn, module, capture, args, kwargs):
  """``fn`` on a clone of ``module`` bound to ``scope``."""
  _calls.capture_stack.append(capture)
  try:
    return fn(module.clone(parent=scope, _deep_clone=True), *args, **kwargs)
  finally:
    _calls.capture_stack.pop()


def _scope_fn(fn, module, capture):

  @functools.wraps(fn)
  def scope_fn(scope, *args, **kwargs):
    return _call_bound(scope, fn, module, capture, args, kwargs)

  return scope_fn


def apply(fn: Callable[..., Any], module: Module,
          mutable: CollectionFilter = False,
          capture_intermediates: bool | Callable[[Module, str], bool] = False
          ) -> Callable[..., Any]:
  """Turns ``fn(bound_module, *args)`` into ``f(variables, *args, rngs=None)``.

  Args:
    fn: a function taking the bound module first.
    module: the module to bind.
    mutable: the collections ``fn`` may change.
    capture_intermediates: as for ``Module.apply``.

  Returns:
    ``f(variables, *args, rngs=None, **kwargs)``, returning ``fn``'s output,
      or ``(output, mutated_collections)`` when ``mutable``.

  >>> import jax, jax.numpy as jnp, liftmods as nn
  >>> dense = nn.Dense(2)
  >>> variables = dense.init(jax.random.key(0), jnp.ones((1, 3)))
  >>> nn.apply(lambda m, x: m(x) * 2, dense)(variables, jnp.ones((1, 3))).shape
  (1, 2)
  """
  capture, mutable = _with_capture(capture_intermediates, mutable)
  return scope_lib.apply(_scope_fn(fn, module, capture), mutable=mutable)


def init_with_output(fn: Callable[..., Any], module: Module,
                     mutable: CollectionFilter = DenyList('intermediates'),
                     capture_intermediates: bool | Callable[[Module, str], bool] = False
                     ) -> Callable[..., tuple[Any, dict]]:
  """Turns ``fn(bound_module, *args)`` into ``f(rngs, *args) -> (out, variables)``.

  Args:
    fn: a function taking the bound module first.
    module: the module to initialize.
    mutable: the collections created.
    capture_intermediates: as for ``Module.apply``.

  Returns:
    The initializing function.
  """
  capture, mutable = _with_capture(capture_intermediates, mutable)
  return scope_lib.init(_scope_fn(fn, module, capture), mutable=mutable)


def init(fn: Callable[..., Any], module: Module,
         mutable: CollectionFilter = DenyList('intermediates'),
         capture_intermediates: bool | Callable[[Module, str], bool] = False
         ) -> Callable[..., dict]:
  """Turns ``fn(bound_module, *args)`` into ``f(rngs, *args) -> variables``.

  Args:
    fn: a function taking the bound module first.
    module: the module to initialize.
    mutable: the collections created.
    capture_intermediates: as for ``Module.apply``.

  Returns:
    The initializing function.
  """
  with_output = init_with_output(fn, module, mutable, capture_intermediates)

  @functools.wraps(with_output)
  def wrapper(rngs, *args, **kwargs):
    return with_output(rngs, *args, **kwargs)[1]

  return wrapper


def merge_param(name: str, a: Any, b: Any) -> Any:
  """Picks a setting given either to the constructor or at call time.

  Args:
    name: the setting's name, for the error message.
    a: the constructor's value (None: not given).
    b: the call's value (None: not given).

  Returns:
    Whichever of ``a`` and ``b`` is not None.

  Raises:
    ValueError: both or neither is given.
  """
  if a is None and b is None:
    raise ValueError(f'Parameter "{name}" must be passed to the constructor '
                     'or at call time.')
  if a is not None and b is not None:
    raise ValueError(f'Parameter "{name}" was passed to the constructor and '
                     'at call time. Should be passed just once.')
  return a if a is not None else b


# -- name scopes and shared scopes -----------------------------------------------

class CompactNameScope(Module):
  """The child that runs a ``@compact_name_scope`` method.

  ``fn`` is called on the owning module while this child is the running
  compact module, so inline submodules are named under it.

  Attributes:
    fn: the undecorated method.
    module_fn: returns the owning module.
  """

  fn: Callable
  module_fn: Callable

  @compact
  def __call__(self, *args, **kwargs):
    return self.fn(self.module_fn(), *args, **kwargs)


def share_scope(module: Module, other: Module, /) -> None:
  """Makes ``module`` and ``other`` use one scope.

  Their variables then live together (e.g. a LoRA wrapper adding ``A``/``B``
  next to the kernel of the Dense it wraps). If ``other``'s scope lies
  inside ``module``'s, ``other`` moves to ``module``'s scope; otherwise
  ``module`` moves to ``other``'s. Children already created under the moved
  module follow it.

  Args:
    module: one module (usually the wrapper, ``self``).
    other: the other module.

  Raises:
    CallShareScopeOnUnboundModuleError: either module is unbound.

  >>> import jax, jax.numpy as jnp, liftmods as nn
  >>> class LoRA(nn.Module):
  ...   base: nn.Dense
  ...   def setup(self):
  ...     nn.share_scope(self, self.base)
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     a = self.param('A', nn.initializers.zeros, (x.shape[-1], 2))
  ...     return self.base(x) + x @ a @ jnp.ones((2, self.base.features))
  >>> class Model(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return LoRA(nn.Dense(3))(x)
  >>> params = Model().init(jax.random.key(0), jnp.ones((1, 4)))['params']
  >>> sorted(params['Dense_0'])
  ['A', 'bias', 'kernel']
  """
  if module.scope is None or other.scope is None:
    raise errors.CallShareScopeOnUnboundModuleError()
  if _is_within(other.scope, module.scope):
    moved, target = other, module.scope
  else:
    moved, target = module, other.scope
  old = moved.scope
  object.__setattr__(moved, 'scope', target)
  for child in moved._state.children.values():
    if isinstance(child, Module) and child.scope is not None and (
        child.scope.parent is old):
      if isinstance(child.scope.name, str):
        target.reserve(child.scope.name)
      child.scope.parent = target


def _is_within(scope: Scope, ancestor: Scope) -> bool:
  while scope is not None:
    if scope is ancestor:
      return True
    scope = scope.parent
  return False


# -- the other names of flax.linen.module --------------------------------------
# Code written for Linen reaches these as attributes of flax.linen.module
# (``nn.module.SetupState``, ``from flax.linen.module import Interceptor``):
# the library and typing names are the objects Linen imports, Linen's own
# names are bound to liftmods' counterparts. ``nn`` and ``serialization`` sit
# above this module in the layer map; liftmods/__init__.py binds them.
# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
import contextlib
import contextvars
import sys
import threading
import typing
from collections.abc import Iterable, Iterator
from types import MappingProxyType
from typing import Literal, Optional, TypeVar, Union, overload

from liftmods import core, kw_only_dataclasses, traceback_util, traverse_util
from liftmods.core import meta
from liftmods.core.scope import Variable, union_filters
from liftmods.descriptors import DescriptorProxy as DescriptorWrapper
from liftmods.descriptors import wrap_descriptor as wrap_descriptor_once
# pylint: enable=g-import-not-at-top,wrong-import-position,unused-import

# A descriptor proxy is never wrapped again, so making one and making one
# once are the same call here.
create_descriptor_wrapper = wrap_descriptor_once

T = TypeVar('T')
M = TypeVar('M', bound='Module')

# What an interceptor passed to ``intercept_methods`` is called with.
Args = tuple[Any]
Kwargs = dict[str, Any]
NextGetter = Callable[..., Any]
Interceptor = Callable[[NextGetter, Args, Kwargs, InterceptorContext], Any]

# liftmods' Module has no separate base class for static analysers; the
# name is Module itself, so isinstance/issubclass tests and annotations
# against it answer as they do with Linen.
ModuleBase = Module


class Descriptor(typing.Protocol):
  """What a descriptor in a Module class provides (for type annotations;
  ``wrap_descriptor_once`` puts such descriptors behind a proxy)."""

  def __get__(self, obj, objtype=None) -> Any:
    ...

  def __set__(self, obj, value) -> None:
    ...

  def __delete__(self, obj) -> None:
    ...

  def __set_name__(self, owner, name) -> None:
    ...


class TestScope(Scope):
  """A Scope whose every rng stream gives ``jax.random.key(0)``: binding a
  module to it runs code that draws keys without supplying any.

  >>> import liftmods as nn
  >>> with TestScope({}, rngs={}, mutable=True).temporary() as root:
  ...   print(nn.Dense(2, parent=root).make_rng('dropout').shape)
  ()
  """
  __test__ = False  # not a pytest test class

  def make_rng(self, name: str = 'params') -> jax.Array:
    """``jax.random.key(0)``, whatever the stream.

    Args:
      name: the rng stream (ignored).

    Returns:
      The key.
    """
    del name
    return jax.random.key(0)


# Names of flax.linen.module that mean nothing in liftmods, and why.
from liftmods import linen_names  # pylint: disable=g-import-not-at-top,wrong-import-position

_LINEN_ONLY = {
    **linen_names.shared('flax', 'tpe', 'FlaxId'),
    'uuid': "flax.ids.uuid, the object that hands out Linen's module ids "
            '(not the uuid module); liftmods numbers its modules with a '
            'private counter',
    'ParentDescriptor': "the descriptor that keeps a Linen module's parent "
                        'behind a weak reference; in liftmods parent is a '
                        'plain field, and init/apply release the scopes '
                        'they used when they return',
    'ThreadLocalStack': "the container of Linen's per-thread stacks; "
                        "liftmods keeps its per-thread state in "
                        'call_context.ThreadCalls (module._context)',
    'module_field': "a typing-only field specifier of ModuleBase's "
                    "dataclass_transform that is never called; liftmods' "
                    'Module declares no dataclass_transform',
}


__getattr__ = linen_names.not_provided(__name__, 'flax.linen.module',
                                        _LINEN_ONLY)
