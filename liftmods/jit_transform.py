"""``nn.jit`` and ``nn.fold_rngs``: the lifted jit and its compile caches.

A jitted method runs under ``core.lift.jit``, whose compile cache is keyed
by a ``ModuleKey``: what determines the module's computation (class, field
values, naming state, active interceptors), not its name or position, so
identical modules share one trace. Two shortcuts skip the lifted path:

* a plain ``apply`` of a class made by ``nn.jit`` (``fast_apply_for``) runs
  one ``jax.jit`` of ``apply`` keyed by the module's configuration;
* a method called on an unbound module (``unbound_jit``) runs ``jax.jit``
  with the module as a static argument.

Classes are lifted by ``transforms.lift_class``; this module supplies the
method each lifted class gets.

>>> import jax, jax.numpy as jnp, liftmods as nn
>>> ModuleKey(nn.Dense(3, name='a')) == ModuleKey(nn.Dense(3, name='b'))
True
"""
import dataclasses
import functools
import inspect
import types
from collections.abc import Sequence
from typing import Any, Callable

import jax

from liftmods import errors
from liftmods.call_context import active_interceptors, calls
from liftmods.core import caching, lift
from liftmods.core.lifted_jit import shift_argnums
from liftmods.core.frozen_dict import FrozenDict
from liftmods.module import DECLINED, Module, wrap_method
from liftmods.traceback_util import api_boundary
from liftmods.transforms import (Methods, Target, call_on_scopes, field_attrs,
                                 get_module_scopes, is_module_class,
                                 lift_class, method_args, needs_walk)
from liftmods.typing import CollectionFilter, PRNGSequenceFilter

# -- the cache key -------------------------------------------------------------


class _Identity:
  """Stands for a value that cannot be hashed: equal only to itself. It
  holds the value, so a cached key never outlives it (no reuse of ids)."""

  __slots__ = ('value',)

  def __init__(self, value):
    self.value = value

  def __hash__(self):
    return id(self.value)

  def __eq__(self, other):
    return isinstance(other, _Identity) and other.value is self.value


def _fingerprint(value):
  """A hashable stand-in for a field value: modules by class and fields
  (not their names: the name does not change the computation), containers
  element-wise, unhashable dataclasses by their fields, anything else that
  cannot be hashed by identity. The value's own ``__hash__``/``__eq__`` are
  only used when hashing succeeds."""
  if isinstance(value, Module):
    return (type(value), tuple((n, _fingerprint(v))
                               for n, v in field_attrs(value).items()
                               if n != 'name'))
  if isinstance(value, (list, tuple)):
    return (type(value), tuple(_fingerprint(v) for v in value))
  if isinstance(value, (dict, FrozenDict)):
    return (dict, tuple((k, _fingerprint(v)) for k, v in value.items()))
  try:
    hash(value)
  except Exception:  # pylint: disable=broad-except
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      return (type(value), tuple(
          (f.name, _fingerprint(getattr(value, f.name, None)))
          for f in dataclasses.fields(value)))
    return _Identity(value)
  return value


def _state_key(module: Module):
  """What of a module's naming state a trace depends on: setup/compact
  flags, the auto-name counters, and the names already taken in its scope."""
  state = module._state
  key = (state.in_compact, state.in_setup, bool(state.setup_called),
         tuple(state.autoname.items()) if state.autoname else ())
  scope = module.scope
  if scope is not None and scope.reservations:
    key += (tuple((n, frozenset(c)) for n, c in scope.reservations.items()),)
  return key


class ModuleKey:
  """A module, hashable by what determines its computation.

  Equal keys mean equal class, configuration and naming state, and the same
  method interceptors active in this thread (e.g. a precision policy); the
  module's name and position do not count. The key carries the module so
  that a trace can rebuild it.

  Attributes:
    module: the module (None once the key only serves as a cache key).
    key: the tuple that is hashed and compared.
  """

  __slots__ = ('module', 'key', '_hash')

  def __init__(self, module: Module, fingerprint: Any = None):
    """``fingerprint``: ``_fingerprint(module)`` when the caller has it."""
    self.module = module
    if fingerprint is None:
      fingerprint = _fingerprint(module)
    self.key = (fingerprint, _state_key(module), active_interceptors())
    self._hash = hash(self.key)

  @property
  def interceptors(self) -> tuple:
    """The method interceptors that were active when the key was made."""
    return self.key[2]

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, ModuleKey) and self.key == other.key


# Field value types that are their own fingerprint and can hold no bound
# module or Variable (a function or a class is never a pytree node): numbers,
# strings, initializers, and dtypes given as classes (``jnp.float32``).
_KEY_LEAF_TYPES = frozenset((type(None), str, int, float, bool,
                             types.FunctionType, type, type(jax.numpy.float32)))


def _leaf_fingerprint(module: Module):
  """``_fingerprint(module)`` in one pass when every field is its own
  fingerprint (the usual case: numbers, strings, initializer functions);
  None when some field could hold a module or a Variable."""
  d = module.__dict__
  fields = []
  for n in module._init_field_names:
    if n == 'parent':
      continue
    v = d[n]
    if type(v) not in _KEY_LEAF_TYPES:
      return None
    if n != 'name':
      fields.append((n, v))
  return (type(module), tuple(fields))


def _scopes_and_key(module: Module, args, kwargs):
  """``get_module_scopes`` and ``ModuleKey`` of a bound module, in one pass
  when neither its fields nor the arguments can hold a module. Fields that
  are all plain values are fingerprinted by that one pass either way."""
  module._try_setup(shallow=True)
  fingerprint = _leaf_fingerprint(module)
  if fingerprint is not None and not needs_walk(args, kwargs):
    key = ModuleKey(module, fingerprint)
    return [module.scope], args, kwargs or {}, key
  scopes, args, kwargs = get_module_scopes(module, args, kwargs)
  return scopes, args, kwargs, ModuleKey(module, fingerprint)


# -- the shortcuts -------------------------------------------------------------


def fast_apply_for(cls: type[Module],
                   trafo_kwargs: dict[str, Any]) -> Callable[..., Any]:
  """A ``Module._fast_apply`` for ``cls``, a class made by ``nn.jit``.

  A plain ``apply`` of such a class (no rngs, nothing mutable, no capture)
  traces to the same program as ``apply`` of the class it lifts, so one
  ``jax.jit`` of that apply serves it, keyed by the module's configuration:
  a repeated call costs about what ``jax.jit(Model().apply)`` costs. The key
  is built once per module (its fields cannot change after construction)
  and rebuilt only when the active interceptors change.

  Args:
    cls: the class ``nn.jit`` made.
    trafo_kwargs: ``nn.jit``'s arguments for ``__call__``.

  Returns:
    ``fast_apply(module, variables, args, kwargs)``, which returns
      ``DECLINED`` for subclasses of ``cls``, modules whose fields or
      arguments may hold modules, and inside another module's call, a
      recording or a capture.
  """
  def run(module_key, variables, *args, **kwargs):
    # method='__call__' is what method=None means, minus this fast path.
    return module_key.module.clone(parent=None).apply(
        variables, *args, method='__call__', **kwargs)

  jitted = _module_keyed_jit(run, trafo_kwargs, before_args=1)

  def fast_apply(module, variables, args, kwargs):
    if (type(module) is not cls or type(variables) not in (dict, FrozenDict)
        or calls.module_stack[-1] is not None or calls.capture_stack
        or calls.records or needs_walk(args, kwargs)):
      return DECLINED
    key = module.__dict__.get('_fast_apply_key')
    if key is None or key.interceptors != tuple(calls.interceptors):
      fingerprint = _leaf_fingerprint(module)
      if fingerprint is None:
        return DECLINED
      key = module.__dict__['_fast_apply_key'] = ModuleKey(module,
                                                           fingerprint)
    return jitted(key, variables, *args, **kwargs)

  return fast_apply


def _module_keyed_jit(run, trafo_kwargs, before_args=0):
  """``jax.jit`` of ``run(module_key, *before, *args)`` with the module key
  static: nn.jit's argument numbers (``self`` is 0) moved past the
  ``before_args`` arguments that ``run`` takes ahead of the user's."""
  extra = {k: trafo_kwargs[k] for k in ('device', 'backend')
           if trafo_kwargs.get(k) is not None}
  static = shift_argnums(trafo_kwargs.get('static_argnums', ()), before_args)
  return jax.jit(
      run, static_argnums=(0,) + static,
      static_argnames=trafo_kwargs.get('static_argnames', ()),
      donate_argnums=shift_argnums(trafo_kwargs.get('donate_argnums', ()),
                                   before_args), **extra)


def unbound_jit(fn: Callable[..., Any],
                trafo_kwargs: dict[str, Any]) -> Callable[..., Any]:
  """``jax.jit`` of ``fn(module, *args)`` for an unbound module.

  Used e.g. for an ``init_with_output`` override: the module is a static
  argument, keyed by its configuration (``unbound_key``), and a clone of it
  runs inside.

  Args:
    fn: the method's function.
    trafo_kwargs: ``nn.jit``'s arguments.

  Returns:
    The jitted ``f(module_key, *args, **kwargs)``, taking a ``ModuleKey``.
  """
  def run(module_key, *args, **kwargs):
    return fn(module_key.module.clone(parent=None), *args, **kwargs)

  return _module_keyed_jit(run, trafo_kwargs)


def unbound_key(module: Module) -> ModuleKey:
  """``ModuleKey(module)`` for an unbound module, kept in its ``__dict__``.

  When every field of the module is its own fingerprint (numbers, strings,
  functions, classes: ``_leaf_fingerprint``), the fields cannot change (a
  Module is frozen) and hold nothing that can, so the key is made once and
  reused while the naming state and the active interceptors, the parts of
  the key that can change, are those it was made with. Otherwise (a field
  may hold a module, a list, a dict) the key is made afresh each time.

  Args:
    module: an unbound module.

  Returns:
    Its key.
  """
  d = module.__dict__
  key = d.get('_unbound_jit_key')
  if key is None:
    fingerprint = _leaf_fingerprint(module)
    if fingerprint is None:
      return ModuleKey(module)
  elif (key.interceptors == active_interceptors()
        and key.key[1] == _state_key(module)):
    return key
  else:
    fingerprint = key.key[0]
  key = d['_unbound_jit_key'] = ModuleKey(module, fingerprint)
  return key


caching.register('jit_transform.fast_apply_for', caching.Policy(
    holds='`nn.jit` fast apply: one `jax.jit` per lifted class, and '
          "`_fast_apply_key` in each module's `__dict__`",
    keyed_on='`ModuleKey` of the module (static argument)',
    bound="JAX's jit cache",
    cleared="as JAX's jit cache evicts; the key when the module is "
            'collected'))
caching.register('jit_transform.unbound_jit', caching.Policy(
    holds='traces of `nn.jit` called unbound, and `_unbound_jit_key` in '
          "each such module's `__dict__` (when its fields are all plain "
          'values)',
    keyed_on='`ModuleKey` (static argument)',
    bound="JAX's jit cache",
    cleared="as JAX's jit cache evicts; the key when the module is "
            'collected'))


# -- lifting -------------------------------------------------------------------


def static_names(fn: Callable[..., Any],
                 trafo_kwargs: dict[str, Any]) -> dict[str, Any]:
  """``nn.jit``'s arguments with ``static_argnames`` completed as
  ``jax.jit`` completes them: given only ``static_argnums``, the parameters
  of ``fn`` at those positions (``self`` is 0) are static when passed by
  keyword too (Linen traces them then: flax#3171).

  Args:
    fn: the method's function, ``self`` first.
    trafo_kwargs: ``nn.jit``'s arguments.

  Returns:
    ``trafo_kwargs``, or a copy with the names added.
  """
  nums = trafo_kwargs.get('static_argnums', ())
  nums = (nums,) if isinstance(nums, int) else tuple(nums)
  if not nums or trafo_kwargs.get('static_argnames'):
    return trafo_kwargs
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):  # no signature to read
    return trafo_kwargs
  by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD,)
  names = tuple(params[i].name for i in nums
                if 0 <= i < len(params) and params[i].kind in by_keyword)
  return {**trafo_kwargs, 'static_argnames': names} if names else trafo_kwargs


def _jit_lift(fn, fn_name, cls, trafo_kwargs, transform=lift.jit):
  """``fn(module, *args)`` under a lifted jit whose compile cache is keyed
  by the module's configuration (so repeated applies hit it). With
  ``transform=lift.fold_rngs``: the same rng handling, without compiling."""
  core = unbound = None
  if transform is lift.jit:
    trafo_kwargs = static_names(fn, trafo_kwargs)

  def scope_fn(scopes, module_key, *args, **kwargs):
    return call_on_scopes(module_key.module, fn, fn_name, scopes, args,
                          kwargs, cls=cls)

  @api_boundary
  def lifted(self, *args, **kwargs):
    nonlocal core, unbound
    if self.scope is None and transform is lift.jit:
      if unbound is None:
        unbound = unbound_jit(fn, trafo_kwargs)
      return unbound(unbound_key(self), *args, **kwargs)
    if core is None:
      core = transform(scope_fn, **trafo_kwargs)
    # Each rng sequence is replaced by a fresh key made from it (as Linen's
    # jit does) for the call, and restored afterwards.
    scope = self.scope
    saved = scope.rngs
    if saved:
      scope.rngs = {name: lift.LazyKey(scope.make_rng(name)) for name in saved}
    try:
      scopes, args, kwargs, key = _scopes_and_key(self, args, kwargs)
      try:
        return core(scopes, key, *args, **kwargs)
      finally:
        key.module = None  # the cache keeps the key: not the bound module
    finally:
      scope.rngs = saved

  return lifted


def _jit_class_method(transform, fn, fn_name, trafo_args, trafo_kwargs,
                      cls):
  """``lift_class``'s method hook for jit: ``_jit_lift`` takes no positional
  transform arguments."""
  del trafo_args
  return _jit_lift(fn, fn_name, cls, trafo_kwargs, transform)


def _lift_jit(target, methods, kwargs, name, transform):
  """A Module class (its ``methods``) or a function of a module, lifted with
  ``_jit_lift`` over ``transform``; a class made by ``nn.jit`` that compiles
  ``__call__`` also gets the fast ``apply``."""
  if is_module_class(target):
    lifted = lift_class(transform, name, target, methods=methods,
                        lift_method=_jit_class_method, **kwargs)
    call = method_args(methods, (), kwargs).get('__call__')
    if transform is lift.jit and call is not None:
      cls = lifted.func if isinstance(lifted, functools.partial) else lifted
      cls._fast_apply = fast_apply_for(
          cls, static_names(target.__call__, call[1]))
    return lifted
  if callable(target) and not isinstance(target, Module):
    fn = wrap_method(target)
    fn_name = getattr(target, '__name__', 'fn')
    return functools.wraps(fn)(_jit_lift(fn, fn_name, None, kwargs,
                                         transform))
  raise errors.TransformTargetError(target)


def jit(target: Target, variables: CollectionFilter = True,
        rngs: PRNGSequenceFilter = True,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (), device: Any = None,
        backend: str | None = None, methods: Methods = None) -> Target:
  """Compiles ``target`` with ``jax.jit``.

  Calls with the same module configuration, shapes and rng state hit one
  compile cache.

  Args:
    target: a Module class, or a function ``fn(module, *args)``.
    variables: the collections the compiled function sees.
    rngs: the rng sequences it sees; each is forked into a fresh key for
      the call.
    static_argnums: static arguments; ``self`` counts as argument 0.
    static_argnames: static keyword arguments.
    donate_argnums: arguments whose buffers may be reused; ``self`` is 0.
    device: passed to ``jax.jit``.
    backend: passed to ``jax.jit``.
    methods: for a Module class, the methods to compile (None: only
      ``__call__``; a list of names; or ``{name: transform kwargs}``).

  Returns:
    A subclass of ``target`` whose methods are compiled, or the compiled
      function.

  Raises:
    TransformTargetError: ``target`` is neither a Module class nor callable.

  >>> import jax, jax.numpy as jnp, liftmods as nn
  >>> JitDense = nn.jit(nn.Dense)
  >>> variables = JitDense(3).init(jax.random.key(0), jnp.ones((1, 2)))
  >>> JitDense(3).apply(variables, jnp.ones((1, 2))).shape
  (1, 3)
  """
  kwargs = dict(variables=variables, rngs=rngs, static_argnums=static_argnums,
                static_argnames=static_argnames,
                donate_argnums=donate_argnums, device=device, backend=backend)
  return _lift_jit(target, methods, kwargs, 'jit', lift.jit)


def fold_rngs(target: Target, variables: CollectionFilter = True,
              rngs: PRNGSequenceFilter = True) -> Target:
  """Handles rngs as ``nn.jit`` does, without compiling.

  Each rng sequence is forked into a fresh key first and the inside starts
  from bare keys, so random numbers match those of the jitted module.

  Args:
    target: a Module class, or a function ``fn(module, *args)``.
    variables: the collections ``target`` sees.
    rngs: the rng sequences ``target`` sees.

  Returns:
    A subclass of ``target``, or the lifted function.

  Raises:
    TransformTargetError: ``target`` is neither a Module class nor callable.

  >>> import jax, jax.numpy as jnp, liftmods as nn
  >>> FoldedDense = nn.fold_rngs(nn.Dense)
  >>> variables = FoldedDense(3).init(jax.random.key(0), jnp.ones((1, 2)))
  >>> jit_variables = nn.jit(nn.Dense)(3).init(jax.random.key(0), jnp.ones((1, 2)))
  >>> bool((variables['params']['kernel'] == jit_variables['params']['kernel']).all())
  True
  """
  return _lift_jit(target, None, dict(variables=variables, rngs=rngs),
                   'fold_rngs', lift.fold_rngs)
