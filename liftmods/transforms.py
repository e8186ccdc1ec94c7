"""Module-level lifted transforms.

A core transform (``liftmods.core.lift``) works on scope functions. To lift a
module method, the scopes it touches — the module's own, those of modules held
in its fields, and those of modules or Variables passed as arguments — are
collected into a list and replaced by placeholders; the core transform runs a
function that rebuilds clones of the modules on the inner scopes it is given
and calls the original method on them.

Applied to a Module class, a transform returns a subclass (named e.g.
``VmapBlock``) whose selected methods run under it; applied to a function
``fn(module, *args)``, it returns the lifted function.

>>> import jax, jax.numpy as jnp, liftmods as nn
>>> Stack = nn.vmap(nn.Dense, variable_axes={'params': 0},
...                 split_rngs={'params': True}, in_axes=None, axis_size=3)
>>> variables = Stack(2).init(jax.random.key(0), jnp.ones((4,)))
>>> variables['params']['kernel'].shape
(3, 4, 2)
"""
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, Union

import jax

from liftmods import errors
from liftmods.core import caching, lift, rng_counters
from liftmods.core import meta
from liftmods.core.filters import is_empty
from liftmods.core.frozen_dict import FrozenDict
from liftmods.core.scope import Scope, Variable
from liftmods.module import (Module, any_nested, named_call_enabled,
                             named_call_label, unbound_method, wrap_method)
from liftmods.traceback_util import api_boundary
# Type aliases Linen code imports from this module (flax.linen.transforms).
from liftmods.typing import (  # pylint: disable=unused-import
    CollectionFilter, InOutAxis, InOutScanAxis, PRNGSequenceFilter,
    VariableDict)


# -- collecting and restoring scopes ------------------------------------------------


class _ModuleSlot:
  """Stands for a bound module passed as an argument across a transform."""

  __slots__ = ('cls', 'attrs', 'key')

  def __init__(self, cls, attrs, key):
    self.cls, self.attrs, self.key = cls, attrs, key


class _VariableSlot:
  """Stands for a Variable passed as an argument across a transform."""

  __slots__ = ('collection', 'name', 'unbox', 'key')

  def __init__(self, collection, name, unbox, key):
    self.collection, self.name, self.unbox = collection, name, unbox
    self.key = key


for _slot in (_ModuleSlot, _VariableSlot):
  # Slots are pytrees without leaves, so that JAX transforms pass them
  # through as structure (never as arrays to map, stage or differentiate).
  jax.tree_util.register_pytree_node(_slot, lambda x: ((), x),
                                     lambda aux, _: aux)
  _slot.__hash__ = lambda self: hash((type(self), self.key))
  _slot.__eq__ = lambda self, other: (type(self) is type(other) and
                                      self.key == other.key)


def _is_slot(x):
  return isinstance(x, (_ModuleSlot, _VariableSlot))


def field_attrs(module: Module) -> dict:
  """The module's dataclass fields but ``parent``.

  Args:
    module: a module.

  Returns:
    ``{field name: value}``.
  """
  d = module.__dict__
  return {n: d[n] for n in module._init_field_names if n != 'parent'}


def _bound(x) -> bool:
  return isinstance(x, (Module, Variable)) and isinstance(x.scope, Scope)


_SCALARS = frozenset((str, int, float, bool))
_PLAIN_ARG_TYPES = set()  # types seen as call arguments that hold no module
caching.register('transforms._PLAIN_ARG_TYPES', caching.Policy(
    holds='types seen as call arguments that hold no module',
    keyed_on='argument type', bound='one entry per type',
    cleared='never'), clear=_PLAIN_ARG_TYPES.clear)


def needs_walk(args: tuple, kwargs: dict | None) -> bool:
  """Whether call arguments may hold a bound module or Variable.

  Args:
    args: the call's arguments.
    kwargs: the call's keyword arguments.

  Returns:
    False when none can. The types of array arguments are remembered, so a
      call whose only arguments are positional ones of those types is
      answered without walking them.
  """
  if not kwargs:
    for a in args:
      if type(a) not in _PLAIN_ARG_TYPES:
        break
    else:
      return False
  leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=_bound)
  if any(_bound(x) for x in leaves):
    return True
  for a in args:
    if isinstance(a, jax.Array):
      _PLAIN_ARG_TYPES.add(type(a))
  return False


def get_module_scopes(module: Module, args: tuple = (),
                      kwargs: dict | None = None) -> tuple[list, tuple, dict]:
  """Every scope ``module`` and its arguments touch.

  Args:
    module: a bound module.
    args: the call's arguments; bound modules and Variables in them are
      swapped for placeholders.
    kwargs: the call's keyword arguments, likewise.

  Returns:
    ``(scopes, args, kwargs)``; the order of ``scopes`` is the one
      ``set_module_scopes`` reads back.
  """
  kwargs = kwargs or {}
  scopes, seen = [], {}

  def arg_slot(x):
    if not _bound(x):
      return x
    key = x._id if isinstance(x, Module) else id(x)
    if key in seen:
      return seen[key]
    if isinstance(x, Variable):
      scopes.append(x.scope)
      slot = _VariableSlot(x.collection, x.name, x.unbox, key)
    else:
      x._try_setup(shallow=True)
      scopes.append(x.scope)
      attrs = jax.tree_util.tree_map(arg_slot, field_attrs(x), is_leaf=_bound)
      slot = _ModuleSlot(type(x), attrs, key)
    seen[key] = slot
    return slot

  if needs_walk(args, kwargs):
    args, kwargs = jax.tree_util.tree_map(arg_slot, (args, kwargs),
                                          is_leaf=_bound)

  def module_scopes(m: Module):
    if m._id in seen:
      return
    seen[m._id] = m
    m._try_setup(shallow=True)
    for v in field_attrs(m).values():
      if v is None or type(v) in _SCALARS:
        continue
      for leaf in jax.tree_util.tree_leaves(v, is_leaf=_bound):
        if isinstance(leaf, Module) and isinstance(leaf.scope, Scope):
          module_scopes(leaf)
        elif isinstance(leaf, Variable) and isinstance(leaf.scope, Scope):
          scopes.append(leaf.scope)
    scopes.append(m.scope)

  module_scopes(module)
  return scopes, args, kwargs


def set_module_scopes(module: Module, args: tuple, kwargs: dict,
                      scopes: Sequence[Scope],
                      cls: type[Module] | None = None
                      ) -> tuple[Module, tuple, dict]:
  """Inverse of ``get_module_scopes``: clones bound to the given scopes.

  Args:
    module: the module to clone.
    args: arguments with placeholders from ``get_module_scopes``.
    kwargs: keyword arguments, likewise.
    scopes: the scopes, in ``get_module_scopes``' order.
    cls: the class of the clone (default: ``module``'s).

  Returns:
    ``(clone, args, kwargs)`` with the argument modules rebuilt too.
  """
  it = iter(scopes)
  made = {}

  def from_slot(x):
    if not _is_slot(x):
      return x
    if x.key in made:
      return made[x.key]
    if isinstance(x, _VariableSlot):
      out = Variable(next(it), x.collection, x.name, x.unbox)
    else:
      scope = next(it)
      attrs = jax.tree_util.tree_map(from_slot, x.attrs, is_leaf=_is_slot)
      out = x.cls(parent=scope, **attrs)
    made[x.key] = out
    return out

  if any(_is_slot(x) for x in jax.tree_util.tree_leaves(
      (args, kwargs), is_leaf=_is_slot)):
    args, kwargs = jax.tree_util.tree_map(from_slot, (args, kwargs),
                                          is_leaf=_is_slot)

  def rebind(m: Module, as_cls=None):
    if m._id in made:
      return made[m._id]

    def field_leaf(x):
      if isinstance(x, Module) and isinstance(x.scope, Scope):
        return rebind(x)
      if isinstance(x, Variable) and isinstance(x.scope, Scope):
        return Variable(next(it), x.collection, x.name, x.unbox)
      return x

    attrs = {n: (jax.tree_util.tree_map(field_leaf, v, is_leaf=_bound)
                 if _has_bound(v) else v)
             for n, v in field_attrs(m).items()}
    out = (as_cls or type(m))(parent=next(it), **attrs)
    made[m._id] = out
    return out

  return rebind(module, cls), args, kwargs


def _has_bound(v) -> bool:
  return any_nested(v, _bound)


def _check_return(tree, method_name):
  if any(isinstance(x, (Module, Variable))
         for x in jax.tree_util.tree_leaves(tree, is_leaf=_bound)):
    raise errors.TransformedMethodReturnValueError(method_name)


# -- lifting a method, a class or a function ----------------------------------------


def _scope_fn_for(self, state, fn, fn_name, multi_scope=True, cls=None):
  """The scope function a core transform runs: rebuild ``self`` (as ``cls``)
  and its argument modules on the inner scopes, call ``fn`` on the clone,
  and hand the clone's naming state back to ``self``."""

  def scope_fn(scopes, *args, **kwargs):
    if not multi_scope:
      scopes = [scopes]
    # A fresh copy per trace: a transform may trace its body more than once.
    return _call_clone(self, state.export(), fn, fn_name, scopes, args,
                       kwargs, cls)

  return scope_fn


def _call_clone(module, state, fn, fn_name, scopes, args, kwargs, cls):
  """``fn`` on a clone of ``module`` bound to ``scopes``: the clone starts
  from the naming state ``state`` (a copy of its own), and its naming state
  afterwards is handed back to ``module``."""
  clone, args, kwargs = set_module_scopes(module, args, kwargs, scopes, cls)
  object.__setattr__(clone, '_state', state)
  out = fn(clone, *args, **kwargs)
  module._state.reimport(clone._state)
  _check_return(out, fn_name)
  return out


def call_on_scopes(module: Module, fn: Callable[..., Any], fn_name: str,
                   scopes: Sequence[Scope], args: tuple, kwargs: dict,
                   cls: type[Module] | None = None) -> Any:
  """Calls ``fn`` on a clone of ``module`` bound to ``scopes``.

  What a core transform runs inside: the clone (and the argument modules)
  are rebuilt on the inner scopes, and the clone's naming state is handed
  back to ``module`` afterwards.

  Args:
    module: the bound module whose scopes ``get_module_scopes`` collected.
    fn: the method's function, ``fn(module, *args, **kwargs)``.
    fn_name: its name, for error messages.
    scopes: the inner scopes, in ``get_module_scopes``' order.
    args: arguments with placeholders from ``get_module_scopes``.
    kwargs: keyword arguments, likewise.
    cls: the class of the clone (default: ``module``'s).

  Returns:
    ``fn``'s output.

  Raises:
    TransformedMethodReturnValueError: ``fn`` returned a module or Variable.
  """
  return _call_clone(module, module._state.export(), fn, fn_name, scopes,
                     args, kwargs, cls)


@api_boundary
def call_lifted(self: Module, transform: Callable[..., Any],
                fns: Sequence[Callable[..., Any]], names: Sequence[str],
                trafo_args: tuple, trafo_kwargs: dict, args: tuple,
                kwargs: dict, cls: type[Module] | None = None,
                multi_scope: bool = True) -> Any:
  """Runs ``fns`` (methods of ``self``) under a core ``transform``.

  Args:
    self: the bound module.
    transform: the core transform, ``transform(*scope_fns, *trafo_args,
      **trafo_kwargs)``.
    fns: the methods' functions.
    names: their names, for error messages.
    trafo_args: positional arguments of ``transform``.
    trafo_kwargs: keyword arguments of ``transform``.
    args: the call's arguments.
    kwargs: the call's keyword arguments.
    cls: the class clones are built as.
    multi_scope: allow modules passed as arguments or held in fields.

  Returns:
    The transformed call's output.

  Raises:
    NotImplementedError: ``multi_scope`` is False and more than one scope
      is involved.
  """
  state = self._state.export()
  scope_fns = [_scope_fn_for(self, state, f, n, multi_scope, cls)
               for f, n in zip(fns, names)]
  if kwargs and transform in (lift.vmap, lift.scan):
    args, kwargs = _required_keywords_to_positions(fns[0], args, kwargs)
  scopes, args, kwargs = get_module_scopes(self, args, kwargs)
  if not multi_scope:
    if len(scopes) != 1:
      raise NotImplementedError(
          f'{names[0]}: this transform does not support modules passed as '
          'arguments or fields of the transformed module.')
    scopes = scopes[0]
  return transform(*scope_fns, *trafo_args, **trafo_kwargs)(scopes, *args,
                                                            **kwargs)


def _required_keywords_to_positions(fn: Callable[..., Any], args: tuple,
                                    kwargs: dict) -> tuple[tuple, dict]:
  """Moves keyword arguments for required parameters of ``fn`` (``self``
  first) to their positions, so that vmap's and scan's ``in_axes`` apply to
  them (flax#2772). Linen drops every keyword argument of these transforms
  with a warning, so the call then lacks a required argument and fails;
  keywords for parameters with a default are still dropped, as in Linen."""
  kwargs = dict(kwargs)
  moved = list(args)
  for name in _required_positional(fn)[len(args):]:
    if name not in kwargs:
      break
    moved.append(kwargs.pop(name))
  return tuple(moved), kwargs


@functools.lru_cache(maxsize=256)
def _required_positional(fn: Callable[..., Any]) -> tuple[str, ...]:
  """The leading required positional-or-keyword parameters of ``fn`` after
  ``self`` (read once per function, not per call)."""
  try:
    params = list(inspect.signature(fn).parameters.values())[1:]
  except (TypeError, ValueError):  # no signature to read
    return ()
  names = []
  for p in params:
    if (p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD
        or p.default is not inspect.Parameter.empty):
      break
    names.append(p.name)
  return tuple(names)


caching.register('transforms._required_positional', caching.Policy(
    holds="the required positional parameters of a vmapped or scanned "
          "method",
    keyed_on='the method function', bound='256 entries',
    cleared='on eviction'), clear=_required_positional.cache_clear)


def method_args(methods: Any, trafo_args: tuple,
                trafo_kwargs: dict) -> dict[str, tuple[tuple, dict]]:
  """The transform arguments of each method a class transform lifts.

  Args:
    methods: None (``__call__``), a list of names, or ``{name: transform
      kwargs}``.
    trafo_args: positional arguments of the transform.
    trafo_kwargs: keyword arguments of the transform (unused for a dict of
      methods, whose values replace them).

  Returns:
    ``{method name: (trafo_args, trafo_kwargs)}``.

  Raises:
    ValueError: ``methods`` is none of those.
  """
  if methods is None:
    return {'__call__': (trafo_args, trafo_kwargs)}
  if isinstance(methods, (list, tuple)):
    return {m: (trafo_args, trafo_kwargs) for m in methods}
  if isinstance(methods, dict):
    return {m: ((), kw) for m, kw in methods.items()}
  raise ValueError('methods must be None, a list/tuple of names or a dict '
                   f'{{name: transform kwargs}}; got {methods!r}.')


def is_module_class(target: Any) -> bool:
  """Whether ``target`` is a Module class or a ``functools.partial`` of one.

  Args:
    target: what a transform was given.

  Returns:
    True for a Module class, possibly wrapped in partials.
  """
  if isinstance(target, functools.partial):
    return is_module_class(target.func)
  return inspect.isclass(target) and issubclass(target, Module)


def _class_method(transform, fn, fn_name, trafo_args, trafo_kwargs, cls):

  def lifted(self, *args, **kwargs):
    return call_lifted(self, transform, (fn,), (fn_name,), trafo_args,
                       trafo_kwargs, args, kwargs, cls=cls)

  return lifted


def lift_class(transform: Callable[..., Any], name: str,
               module_class: Any, *trafo_args: Any, methods: Any = None,
               lift_method: Callable[..., Any] | None = None,
               **trafo_kwargs: Any) -> Any:
  """A subclass of ``module_class`` whose ``methods`` run under ``transform``.

  Args:
    transform: the core transform.
    name: the transform's name; the class is named ``{Name}{ModuleClass}``
      like Linen's (a name starting with a capital is used as it is).
    module_class: a Module class or a ``functools.partial`` of one.
    *trafo_args: positional arguments of ``transform``.
    methods: None (``__call__``), a list of names, or ``{name: transform
      kwargs}``.
    lift_method: builds each method of the subclass, ``lift_method(
      transform, fn, fn_name, trafo_args, trafo_kwargs, module_class)``; by
      default one that runs ``fn`` under ``transform`` with
      ``call_lifted``.
    **trafo_kwargs: keyword arguments of ``transform``.

  Returns:
    The subclass (or a partial of it).
  """
  partial = None
  if isinstance(module_class, functools.partial):
    partial, module_class = module_class, module_class.func
  lift_method = lift_method or _class_method
  lifted = {}
  for fn_name, (t_args, t_kwargs) in method_args(
      methods, trafo_args, trafo_kwargs).items():
    fn = getattr(module_class, fn_name)
    lifted[fn_name] = functools.wraps(fn)(lift_method(
        transform, fn, fn_name, t_args, t_kwargs, module_class))
  prefix = name if name[:1].isupper() else name.capitalize()
  new_cls = type(prefix + module_class.__name__, (module_class,), lifted)
  if partial is not None:
    return functools.partial(new_cls, *partial.args, **partial.keywords)
  return new_cls


def lift_decorator(transform: Callable[..., Any],
                   class_fns: Callable[..., Any] | tuple,
                   *trafo_args: Any, multi_scope: bool = True,
                   **trafo_kwargs: Any) -> Callable[..., Any]:
  """Lifts method(s) ``class_fns`` (functions taking the module first).

  Args:
    transform: the core transform.
    class_fns: a function, or a tuple of functions the transform takes
      together.
    *trafo_args: positional arguments of ``transform``.
    multi_scope: allow modules passed as arguments or held in fields.
    **trafo_kwargs: keyword arguments of ``transform``.

  Returns:
    ``f(module, *args)`` running under the transform.
  """
  fns = class_fns if isinstance(class_fns, tuple) else (class_fns,)
  wrapped = [wrap_method(f) for f in fns]
  names = [getattr(f, '__name__', 'fn') for f in fns]

  def lifted(self, *args, **kwargs):
    return call_lifted(self, transform, wrapped, names, trafo_args,
                       trafo_kwargs, args, kwargs, multi_scope=multi_scope)

  return functools.wraps(wrapped[0])(lifted)


def lift_transform(transform: Callable[..., Any], name: str, target: Any,
                   *trafo_args: Any, methods: Any = None,
                   **trafo_kwargs: Any) -> Any:
  """Lifts a Module class (``lift_class``) or a function (``lift_decorator``).

  Args:
    transform: the core transform.
    name: the transform's name.
    target: a Module class or a function of a module.
    *trafo_args: positional arguments of ``transform``.
    methods: for a class, the methods to transform.
    **trafo_kwargs: keyword arguments of ``transform``.

  Returns:
    The lifted class or function.

  Raises:
    TransformTargetError: ``target`` is neither.
  """
  if is_module_class(target):
    return lift_class(transform, name, target, *trafo_args, methods=methods,
                      **trafo_kwargs)
  if callable(target) and not isinstance(target, Module):
    return lift_decorator(transform, target, *trafo_args, **trafo_kwargs)
  raise errors.TransformTargetError(target)


def lift_direct(transform: Callable[..., Any],
                targets: Sequence[Callable[..., Any]], module: Module,
                *args: Any, multi_scope: bool = True, **kwargs: Any) -> Any:
  """Applies ``transform`` to functions of ``module`` right away.

  Args:
    transform: the core transform.
    targets: functions (or bound methods) taking the module first.
    module: the bound module.
    *args: arguments of the transformed call.
    multi_scope: allow modules passed as arguments or held in fields.
    **kwargs: keyword arguments of the transformed call.

  Returns:
    The transformed call's output.

  Raises:
    TransformTargetError: a target is a Module class.
  """
  for t in targets:
    if is_module_class(t):
      raise errors.TransformTargetError(t)
  targets = tuple(unbound_method(t) for t in targets)
  return lift_decorator(lambda *fns: functools.partial(transform, *fns),
                        targets, multi_scope=multi_scope)(module, *args,
                                                          **kwargs)


# -- the transforms ------------------------------------------------------------------

# What a module-level transform takes and returns: a Module class (or a
# functools.partial of one), or a function of a module.
TransformTarget = Union[type[Module], Callable[..., Any]]
Target = TypeVar('Target', bound=TransformTarget)
# Which methods of a Module class to transform (see method_args).
Methods = Sequence[str] | Mapping[str, Mapping[str, Any]] | None


def vmap(target: Target, variable_axes: Mapping[CollectionFilter, InOutAxis] = FrozenDict(),
         split_rngs: Mapping[PRNGSequenceFilter, bool] = FrozenDict(),
         in_axes: Any = 0, out_axes: Any = 0, axis_size: int | None = None,
         axis_name: str | None = None,
         spmd_axis_name: str | tuple[str, ...] | None = None,
         metadata_params: Mapping[Any, Any] = {},
         methods: Methods = None) -> Target:
  """Vectorizes ``target`` over a batch axis (``jax.vmap`` with variables).

  Args:
    target: a Module class, or a function ``fn(module, *args)``.
    variable_axes: ``{collection filter: axis}``; a collection mapped to an
      int is stacked along that axis (one slice per element), one mapped to
      None is shared by all elements.
    split_rngs: ``{rng filter: bool}``; True gives every element a different
      key of that rng sequence, False the same key.
    in_axes: the batch axis of each positional argument (None: broadcast),
      as for ``jax.vmap``.
    out_axes: where the batch axis goes in the outputs.
    axis_size: the batch size, needed when no argument is mapped.
    axis_name: a name for the batch axis, for collectives inside.
    spmd_axis_name: mesh axis (or axes) the batch axis is sharded over.
    metadata_params: passed to the axis metadata (e.g. ``Partitioned``
      boxes) of stacked variables when the axis is added or removed, e.g.
      ``{nn.PARTITION_NAME: 'layers'}``.
    methods: for a Module class, the methods to transform: None (only
      ``__call__``), a list of names, or ``{name: transform kwargs}``.

  Returns:
    A subclass of ``target`` whose methods are vectorized, or the lifted
      function.

  Raises:
    TransformTargetError: ``target`` is neither a Module class nor callable.
  """
  return lift_transform(lift.vmap, 'vmap', target, variable_axes, split_rngs,
                        methods=methods, in_axes=in_axes, out_axes=out_axes,
                        axis_size=axis_size, axis_name=axis_name,
                        metadata_params=metadata_params,
                        spmd_axis_name=spmd_axis_name)


def scan(target: Target,
         variable_axes: Mapping[CollectionFilter, InOutScanAxis] = FrozenDict(),
         variable_broadcast: CollectionFilter = False,
         variable_carry: CollectionFilter = False,
         split_rngs: Mapping[PRNGSequenceFilter, bool] = FrozenDict(),
         in_axes: Any = 0, out_axes: Any = 0, length: int | None = None,
         reverse: bool = False, unroll: int = 1,
         data_transform: Callable[..., Any] | None = None,
         metadata_params: Mapping[Any, Any] = {}, methods: Methods = None,
         _split_transpose: bool = False,
         check_constancy_invariants: bool = True) -> Target:
  """Loops ``target(carry, *xs) -> (carry, ys)`` over an axis (``lax.scan``).

  Args:
    target: a Module class, or a function ``fn(module, carry, *xs)``.
    variable_axes: ``{collection filter: axis}``; those collections get one
      slice per iteration, stacked along the axis.
    variable_broadcast: collections shared by every iteration; they are
      created once, outside the loop, and must not change inside it.
    variable_carry: collections threaded from one iteration to the next.
    split_rngs: ``{rng filter: bool}``; True gives every iteration its own
      key of that rng sequence.
    in_axes: the scanned axis of each ``xs`` argument
      (``nn.broadcast``: passed whole to every iteration).
    out_axes: the axis along which the ``ys`` outputs are stacked.
    length: the number of iterations, needed when nothing is scanned over.
    reverse: iterate from the last element to the first.
    unroll: iterations per loop step of the compiled loop.
    data_transform: an optional function ``(variable groups, rngs) ->
      (variable groups, rngs)`` applied to what each iteration sees.
    metadata_params: passed to the axis metadata of stacked variables, e.g.
      ``{nn.PARTITION_NAME: 'layers'}``.
    methods: for a Module class, the methods to transform (None: only
      ``__call__``; a list of names; or ``{name: transform kwargs}``).
    _split_transpose: accepted for Linen compatibility; passed to the core.
    check_constancy_invariants: trace the body once more to check that
      broadcast variables do not change (as Linen does); False skips it.

  Returns:
    A subclass of ``target`` whose methods loop, or the lifted function.

  Raises:
    TransformTargetError: ``target`` is neither a Module class nor callable.
  """
  return lift_transform(
      lift.scan, 'scan', target, variable_axes=variable_axes,
      variable_broadcast=variable_broadcast, variable_carry=variable_carry,
      split_rngs=split_rngs, in_axes=in_axes, out_axes=out_axes,
      length=length, reverse=reverse, unroll=unroll,
      _split_transpose=_split_transpose, data_transform=data_transform,
      metadata_params=metadata_params, methods=methods,
      check_constancy_invariants=check_constancy_invariants)


def checkpoint(target: Target, variables: CollectionFilter = True,
               rngs: PRNGSequenceFilter = True, concrete: bool = False,
               prevent_cse: bool = True,
               static_argnums: int | tuple[int, ...] = (),
               policy: Callable[..., bool] | None = None,
               methods: Methods = None) -> Target:
  """Recomputes ``target``'s activations in the backward pass (``jax.checkpoint``).

  ``nn.remat`` is the same function.

  Args:
    target: a Module class, or a function ``fn(module, *args)``.
    variables: the collections the rematerialized function sees.
    rngs: the rng sequences it sees.
    concrete: accepted for Linen compatibility; passed to the core transform.
    prevent_cse: keep XLA from merging the recomputation with the forward
      pass (as ``jax.checkpoint``'s option).
    static_argnums: arguments treated as static; ``self`` counts as 0. The
      parameters at those positions are static when passed by keyword too
      (for ``__call__`` or a function target; Linen fails then, as
      ``jax.checkpoint`` does).
    policy: a ``jax.checkpoint_policies`` rule for which values to save.
    methods: for a Module class, the methods to transform (None: only
      ``__call__``; a list of names; or ``{name: transform kwargs}``).

  Returns:
    A subclass of ``target`` whose methods are rematerialized, or the lifted
      function.

  Raises:
    TransformTargetError: ``target`` is neither a Module class nor callable.
  """
  if isinstance(static_argnums, int):
    static_argnums = (static_argnums,)
  names = _names_at(_signature_target(target, methods), static_argnums)
  static_argnums = tuple(i - 1 for i in static_argnums)
  return lift_transform(lift.checkpoint, 'checkpoint', target,
                        variables=variables, rngs=rngs, concrete=concrete,
                        static_argnums=static_argnums, prevent_cse=prevent_cse,
                        policy=policy, methods=methods, static_argnames=names)


def _signature_target(target: Any, methods: Methods) -> Any:
  """The function whose parameters ``static_argnums`` count: ``__call__``
  of a class lifted without ``methods``, or the target function."""
  if is_module_class(target):
    return target.__call__ if methods is None else None
  return target if callable(target) else None


def _names_at(fn: Any, argnums: Sequence[int]) -> tuple[str, ...]:
  """The names of ``fn``'s parameters (``self`` or the module first) at
  ``argnums`` that may be passed by keyword."""
  if fn is None or not argnums:
    return ()
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):  # no signature to read
    return ()
  return tuple(params[i].name for i in argnums if 0 <= i < len(params)
               and params[i].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


remat = checkpoint


def remat_scan(target: Target, lengths: Sequence[int] = (),
               policy: Callable[..., bool] | None = None,
               variable_broadcast: CollectionFilter = False,
               variable_carry: CollectionFilter = False,
               variable_axes: Mapping[CollectionFilter, InOutScanAxis] = FrozenDict({True: 0}),
               split_rngs: Mapping[PRNGSequenceFilter, bool] = FrozenDict({True: True}),
               metadata_params: Mapping[Any, Any] | Sequence[Mapping[Any, Any]] = {}) -> Target:
  """Applies ``target`` ``prod(lengths)`` times as nested rematerialized scans.

  Gradient memory then grows like ``n ** (1 / len(lengths))`` for ``n``
  applications. ``target`` maps a carry to a carry; further call arguments
  (a ``train`` flag, a mask) reach every application unchanged, where
  Linen's ``remat_scan`` calls the block with the carry only.

  Args:
    target: a Module class, or a function ``fn(module, carry)``.
    lengths: the lengths of the nested loops, outermost first.
    policy: a ``jax.checkpoint_policies`` rule for which values to save.
    variable_broadcast: collections shared by every application.
    variable_carry: collections threaded through the applications.
    variable_axes: ``{collection filter: axis}`` of the stacked collections
      (by default all, on axis 0).
    split_rngs: ``{rng filter: bool}``; by default every application gets
      its own keys.
    metadata_params: the axis metadata of stacked boxed variables, e.g.
      ``{nn.PARTITION_NAME: 'layers'}`` (Linen's ``remat_scan`` lacks it,
      flax#3870): one mapping for every level, or one per level,
      outermost first, e.g. ``[{nn.PARTITION_NAME: 'stages'},
      {nn.PARTITION_NAME: None}]``.

  Returns:
    A subclass of ``target``, or the lifted function.

  Raises:
    TransformTargetError: ``target`` is neither a Module class nor callable.
    ValueError: ``metadata_params`` is a sequence whose length is not
      ``len(lengths)``.
  """
  lift.level_metadata(metadata_params, lengths)
  return lift_transform(lift.remat_scan, 'remat_scan', target,
                        lengths=lengths, variable_broadcast=variable_broadcast,
                        variable_carry=variable_carry,
                        variable_axes=variable_axes, split_rngs=split_rngs,
                        policy=policy, metadata_params=metadata_params)


def map_variables(target: Target,
                  mapped_collections: CollectionFilter = True,
                  trans_in_fn: Callable[..., Any] = lift.id_fn,
                  trans_out_fn: Callable[..., Any] = lift.id_fn,
                  init: bool = False, mutable: bool = False,
                  rngs: PRNGSequenceFilter = True,
                  variables: CollectionFilter = True,
                  methods: Methods = None) -> Target:
  """Runs ``target`` on a transformed view of some variable collections.

  Args:
    target: a Module class, or a function ``fn(module, *args)``.
    mapped_collections: the collections that are transformed.
    trans_in_fn: maps the collections (a dict) to what ``target`` sees.
    trans_out_fn: maps what ``target`` wrote back to the stored form.
    init: let ``target`` create the mapped variables (during init).
    mutable: let ``target`` change the mapped variables.
    rngs: the rng sequences ``target`` sees.
    variables: the other collections ``target`` sees.
    methods: for a Module class, the methods to transform (None: only
      ``__call__``; a list of names; or ``{name: transform kwargs}``).

  Returns:
    A subclass of ``target``, or the lifted function.

  Raises:
    TransformTargetError: ``target`` is neither a Module class nor callable.
  """
  return lift_transform(lift.map_variables, 'map_variables', target,
                        mapped_collections, trans_in_fn, trans_out_fn, init,
                        mutable, rngs, variables, methods=methods)


def vjp(fn: Callable[..., Any], mdl: Module, *primals: Any,
        has_aux: bool = False, reduce_axes: Sequence[str] = (),
        vjp_variables: CollectionFilter = 'params',
        variables: CollectionFilter = True, rngs: PRNGSequenceFilter = True,
        multi_scope: bool = False) -> tuple[Any, ...]:
  """``jax.vjp`` of ``fn(mdl, *primals)``, also with respect to variables.

  Args:
    fn: a function ``fn(module, *primals)`` (e.g. an unbound method).
    mdl: the bound module to call it on.
    *primals: the arguments to differentiate with respect to.
    has_aux: ``fn`` returns ``(output, aux)``; aux is not differentiated.
    reduce_axes: not supported; must be empty.
    vjp_variables: the collections to differentiate with respect to.
    variables: the collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.
    multi_scope: allow modules passed as arguments or held in fields.

  Returns:
    ``(output, vjp_fn)`` (``(output, vjp_fn, aux)`` with ``has_aux``);
      ``vjp_fn(cotangent)`` returns ``(variable_grads, *primal_grads)``.

  Raises:
    NotImplementedError: ``reduce_axes`` is given.
  """
  if reduce_axes:
    raise NotImplementedError('reduce_axes is not supported by vjp.')
  return lift_direct(lift.vjp, (fn,), mdl, *primals, multi_scope=multi_scope,
                     has_aux=has_aux, vjp_variables=vjp_variables,
                     variables=variables, rngs=rngs)


def value_and_grad(fn: Callable[..., Any], mdl: Module, *primals: Any,
                   has_aux: bool = False, reduce_axes: Sequence[str] = (),
                   variables: CollectionFilter = True,
                   rngs: PRNGSequenceFilter = True) -> tuple[Any, Any]:
  """The value and gradients of a scalar ``fn(mdl, *primals)``.

  Gradients are taken with respect to the ``params`` collection and the
  primals.

  Args:
    fn: a function ``fn(module, *primals)`` returning a scalar.
    mdl: the bound module to call it on.
    *primals: the arguments to differentiate with respect to.
    has_aux: ``fn`` returns ``(value, aux)``.
    reduce_axes: not supported; must be empty.
    variables: the collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.

  Returns:
    ``(value, (param_grads, *primal_grads))``, or
      ``((value, aux), grads)`` with ``has_aux``.

  Raises:
    NotImplementedError: ``reduce_axes`` is given.
    ValueError: ``fn``'s output is not a scalar.
  """
  if reduce_axes:
    raise NotImplementedError('reduce_axes is not supported by value_and_grad.')
  result = lift_direct(lift.value_and_grad, (fn,), mdl, *primals,
                       has_aux=has_aux, variables=variables, rngs=rngs)
  out = result[0]
  if jax.numpy.shape(out) != ():
    raise ValueError('value_and_grad needs a scalar output; got shape '
                     f'{jax.numpy.shape(out)}.')
  if has_aux:
    out, aux, grads = result
    return (out, aux), grads
  return result


def grad(fn: Callable[..., Any], mdl: Module, *primals: Any,
         has_aux: bool = False, reduce_axes: Sequence[str] = (),
         variables: CollectionFilter = True,
         rngs: PRNGSequenceFilter = True) -> Any:
  """The gradients of a scalar ``fn(mdl, *primals)`` (see ``value_and_grad``).

  Args:
    fn: a function ``fn(module, *primals)`` returning a scalar.
    mdl: the bound module to call it on.
    *primals: the arguments to differentiate with respect to.
    has_aux: ``fn`` returns ``(value, aux)``.
    reduce_axes: not supported; must be empty.
    variables: the collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.

  Returns:
    ``(param_grads, *primal_grads)``, or ``(grads, aux)`` with ``has_aux``.

  Raises:
    NotImplementedError: ``reduce_axes`` is given.
    ValueError: ``fn``'s output is not a scalar.
  """
  out = value_and_grad(fn, mdl, *primals, has_aux=has_aux,
                       reduce_axes=reduce_axes, variables=variables, rngs=rngs)
  if has_aux:
    (_, aux), grads = out
    return grads, aux
  return out[1]


def jvp(fn: Callable[..., Any], mdl: Module, primals: Sequence[Any],
        tangents: Sequence[Any], variable_tangents: VariableDict,
        variables: CollectionFilter = True,
        rngs: PRNGSequenceFilter = True) -> tuple[Any, Any]:
  """``jax.jvp`` of ``fn(mdl, *primals)``, with tangents for variables too.

  Args:
    fn: a function ``fn(module, *primals)``.
    mdl: the bound module to call it on.
    primals: the arguments, as a tuple.
    tangents: their tangents, a tuple of the same structure.
    variable_tangents: ``{collection: tangents}`` for the variables to push
      tangents through.
    variables: the collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.

  Returns:
    ``(output, output_tangent)``.
  """
  return lift_direct(lift.jvp, (fn,), mdl, primals, tangents,
                     variable_tangents, multi_scope=False,
                     variables=variables, rngs=rngs)


def while_loop(cond_fn: Callable[..., Any], body_fn: Callable[..., Any],
               mdl: Module, init: Any,
               carry_variables: CollectionFilter = False,
               broadcast_variables: CollectionFilter = True,
               split_rngs: Mapping[PRNGSequenceFilter, bool] = FrozenDict()) -> Any:
  """``lax.while_loop`` over ``body_fn(mdl, carry)`` with variables.

  Args:
    cond_fn: ``cond_fn(module, carry) -> bool``; may only read variables.
    body_fn: ``body_fn(module, carry) -> carry``.
    mdl: the bound module both functions run on.
    init: the initial carry.
    carry_variables: collections updated by every iteration.
    broadcast_variables: collections every iteration reads, unchanged.
    split_rngs: ``{rng filter: bool}``; True gives every iteration its own
      key.

  Returns:
    The final carry.
  """
  def loop(cond, body, scopes, carry):  # options are not call arguments
    return lift.while_loop(cond, body, scopes, carry, carry_variables,
                           broadcast_variables, split_rngs)

  return lift_direct(loop, (cond_fn, body_fn), mdl, init)


def _branches_run_first(run: Callable[[], Any],
                        branches: Sequence[Callable[..., Any]], mdl: Module,
                        operands: tuple) -> Any:
  """Runs the conditional ``run``; if its branches create different
  variables (Linen: JAX's cond ``TypeError``), runs every distinct branch
  once on ``mdl`` first and then the conditional again, as Linen's own
  documentation tells users to write it (flax#2200). The rng counters the
  rejected trace advanced are rewound first, so the values equal that
  program's."""
  scope = mdl.scope
  if scope is None or is_empty(scope.mutable):
    return run()  # nothing can be created: no snapshot on the apply path
  root = scope.root
  counters = rng_counters.snapshot(root.rng_counters)
  try:
    return run()
  except errors.CondBranchVariablesError as rejected:
    if not getattr(rejected, 'creation_only', False):
      raise
    err = rejected
  rng_counters.restore(root.rng_counters, counters)
  try:
    for branch in dict.fromkeys(unbound_method(b) for b in branches):
      branch(mdl, *operands)
  except Exception as failed:  # the branches conflict: say so, as before
    raise err from failed
  return run()


def _cond(true_fn, false_fn, scope, pred, *operands, variables, rngs):
  return lift.cond(pred, true_fn, false_fn, scope, *operands,
                   variables=variables, rngs=rngs)


def cond(pred: Any, true_fun: Callable[..., Any],
         false_fun: Callable[..., Any], mdl: Module, *operands: Any,
         variables: CollectionFilter = True,
         rngs: PRNGSequenceFilter = True) -> Any:
  """``lax.cond`` between two functions of ``mdl``.

  Both branches are traced. If they create different variables (which
  JAX's cond rejects, and Linen with it), each branch first runs once on
  ``mdl`` outside the conditional, so that all variables exist, and then
  the conditional runs: the program Linen's documentation recommends.

  Args:
    pred: a boolean scalar choosing the branch.
    true_fun: ``true_fun(module, *operands)``, run when ``pred`` is true.
    false_fun: ``false_fun(module, *operands)``, run otherwise.
    mdl: the bound module the branches run on.
    *operands: the branches' arguments.
    variables: the collections the branches see.
    rngs: the rng sequences the branches see.

  Returns:
    The chosen branch's output.
  """
  return _branches_run_first(
      lambda: lift_direct(_cond, (true_fun, false_fun), mdl, pred, *operands,
                          variables=variables, rngs=rngs),
      (true_fun, false_fun), mdl, operands)


def _switch(*args, variables, rngs, n_branches):
  branches, (scope, index, *operands) = args[:n_branches], args[n_branches:]
  return lift.switch(index, branches, scope, *operands, variables=variables,
                     rngs=rngs)


def switch(index: Any, branches: Sequence[Callable[..., Any]], mdl: Module,
           *operands: Any, variables: CollectionFilter = True,
           rngs: PRNGSequenceFilter = True) -> Any:
  """``lax.switch`` among functions of ``mdl``.

  All branches are traced. If they create different variables (which
  JAX's switch rejects, and Linen with it), each branch first runs once on
  ``mdl`` outside the switch, so that all variables exist, and then the
  switch runs: the program Linen's documentation recommends.

  Args:
    index: an integer scalar choosing the branch (clamped to the range).
    branches: functions ``branch(module, *operands)``.
    mdl: the bound module the branches run on.
    *operands: the branches' arguments.
    variables: the collections the branches see.
    rngs: the rng sequences the branches see.

  Returns:
    The chosen branch's output.
  """
  branches = tuple(branches)
  return _branches_run_first(
      lambda: lift_direct(_switch, branches, mdl, index, *operands,
                          variables=variables, rngs=rngs,
                          n_branches=len(branches)),
      branches, mdl, operands)


def _custom_vjp_split(fn, backward_fn, grad_vars='params', nondiff_argnums=()):
  """Adapts one function taking ``needs_residual`` to the core custom_vjp's
  separate primal and forward functions."""
  return lift.custom_vjp(functools.partial(fn, needs_residual=False),
                         functools.partial(fn, needs_residual=True),
                         backward_fn, grad_vars, nondiff_argnums)


def custom_vjp(fn: Callable[..., Any], forward_fn: Callable[..., Any],
               backward_fn: Callable[..., Any],
               grad_vars: CollectionFilter = 'params',
               nondiff_argnums: Sequence[int] = ()) -> Callable[..., Any]:
  """A function of a module with a custom backward rule (``jax.custom_vjp``).

  Args:
    fn: ``fn(module, *args)``, the forward computation.
    forward_fn: ``forward_fn(module, *args) -> (output, residuals)``.
    backward_fn: ``backward_fn(residuals, cotangent) -> (variable_grads,
      *arg_grads)``, with gradients for the ``grad_vars`` collections first.
    grad_vars: the collections that get gradients.
    nondiff_argnums: arguments that are not differentiated.

  Returns:
    The function ``f(module, *args)`` with the custom gradient.
  """

  def shared_forward(*args, needs_residual, **kwargs):
    return (forward_fn if needs_residual else fn)(*args, **kwargs)

  return lift_decorator(_custom_vjp_split, shared_forward,
                        backward_fn=backward_fn, grad_vars=grad_vars,
                        nondiff_argnums=nondiff_argnums, multi_scope=False)


def named_call(class_fn: Callable[..., Any],
               force: bool = True) -> Callable[..., Any]:
  """Wraps a method so that it shows as a named call in profiles.

  The name is the module's name (or class name), with ``.method`` for
  methods other than ``__call__``; calls during ``setup`` are not wrapped.

  Args:
    class_fn: a method, ``class_fn(module, *args)``.
    force: wrap even when named calls are disabled
      (``nn.disable_named_call``).

  Returns:
    The wrapped method.
  """

  @functools.wraps(class_fn)
  def wrapped(self, *args, **kwargs):
    if (not force and not named_call_enabled()) or self._state.in_setup:
      return class_fn(self, *args, **kwargs)
    name = named_call_label(self, getattr(class_fn, '__name__', ''))
    return jax.named_call(class_fn, name=name)(self, *args, **kwargs)

  return wrapped


def add_metadata_axis(target: Target,
                      variable_axes: Mapping[str, int] = FrozenDict(),
                      metadata_params: Mapping[Any, Any] = {}) -> Target:
  """Adds an axis to the axis metadata of some collections, not to the values.

  The axis is added to the metadata (e.g. ``Partitioned`` names) of what
  ``target`` writes and removed from what it reads; the arrays themselves
  are unchanged. Useful when an outer transform stacks the values.

  Args:
    target: a Module class, or a function ``fn(module, *args)``.
    variable_axes: ``{collection: axis}`` of the axis to add.
    metadata_params: passed to the metadata, e.g.
      ``{nn.PARTITION_NAME: 'layers'}``.

  Returns:
    A subclass of ``target``, or the lifted function.
  """
  def remove(x, axis):
    with lift.axis_owner('add_metadata_axis'):
      return meta.remove_axis(x, axis, metadata_params)

  def add(x, axis):
    with lift.axis_owner('add_metadata_axis'):
      return meta.add_axis(x, axis, metadata_params)

  for col, axis in variable_axes.items():
    target = map_variables(
        target, col, trans_in_fn=functools.partial(remove, axis=axis),
        trans_out_fn=functools.partial(add, axis=axis), mutable=True)
  return target


# -- jit -----------------------------------------------------------------------

# jit_transform.py lifts with the helpers above, so it is imported once they
# exist.
# pylint: disable=g-import-not-at-top,wrong-import-position
from liftmods.jit_transform import fold_rngs, jit
# pylint: enable=g-import-not-at-top,wrong-import-position


# -- the other names of flax.linen.transforms ----------------------------------
# Code written for Linen reaches these as attributes of flax.linen.transforms:
# the library and typing names are the objects Linen imports, Linen's own
# names are bound to liftmods' counterparts. ``serialization`` sits above
# this module in the layer map; liftmods/__init__.py binds it.
# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
import contextlib
import dataclasses
import weakref
from collections.abc import Iterable

from liftmods import core, traceback_util
from liftmods import module as linen_module
from liftmods.module import wrap_method_once
# pylint: enable=g-import-not-at-top,wrong-import-position,unused-import

# The placeholders get_module_scopes puts where a bound module or a Variable
# was passed, and set_module_scopes replaces.
InstancePlaceholder = _ModuleSlot
VariablePlaceholder = _VariableSlot

ModuleT = TypeVar('ModuleT', bound=Module)
C = TypeVar('C')

# Linen's names for the lifting helpers above.
decorator_lift_transform = lift_decorator
lift_direct_transform = lift_direct


def module_class_lift_transform(transform: Callable[..., Any],
                                module_class: Any, *trafo_args: Any,
                                methods: Any = None,
                                **trafo_kwargs: Any) -> Any:
  """``lift_class`` under Linen's name and arguments: the subclass is named
  after ``transform`` (``VmapFoo`` for ``lift.vmap`` over ``Foo``).

  Args:
    transform: the core transform.
    module_class: a Module class or a ``functools.partial`` of one.
    *trafo_args: positional arguments of ``transform``.
    methods: None (``__call__``), a list of names, or ``{name: transform
      kwargs}``.
    **trafo_kwargs: keyword arguments of ``transform``.

  Returns:
    The subclass (or a partial of it).
  """
  return lift_class(transform, transform.__name__, module_class, *trafo_args,
                    methods=methods, **trafo_kwargs)


_JIT_ONLY = ("a step of Linen's nn.jit, which caches the transformed function "
             "per module; liftmods' nn.jit (jit_transform.py) keys its own "
             'cache and has no such step')

# Linen's rng wrapper, which its transforms import (flax.core.scope.LazyRng).
from liftmods.core.rngs import LazyRng  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import

# Names of flax.linen.transforms that mean nothing in liftmods, and why.
from liftmods import linen_names  # pylint: disable=g-import-not-at-top,wrong-import-position

_LINEN_ONLY = {
    **linen_names.shared('struct', 'FlaxId'),
    'clean_clone': 'a helper Linen no longer calls that strips the scopes '
                   'from a module and its children in place; liftmods keeps '
                   'children in private state, and Module.unbind() or '
                   'clone() give an unbound copy',
    'fork_rngs': _JIT_ONLY,
    'decorator_lift_transform_cached': _JIT_ONLY,
    'module_class_lift_transform_cached': _JIT_ONLY,
    'lift_transform_cached': _JIT_ONLY,
}


__getattr__ = linen_names.not_provided(__name__, 'flax.linen.transforms',
                                        _LINEN_ONLY)
