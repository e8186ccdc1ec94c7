"""What a wrapped module method call consults besides its module: this
thread's stack of running modules, the ``capture_intermediates`` filters of
the ``init``/``apply`` calls in progress, the two hooks on every call, and
whether calls are wrapped in ``jax.named_scope`` (Linen's named call).

* **Interceptors** (Linen's ``nn.intercept_methods``) may change a call: each
  one receives the next function to call and decides what to pass and
  return.
* **Recording** (:func:`record_calls`) only watches: it lists the calls made
  inside its ``with`` body, with the shapes of their inputs and outputs.
  ``tabulate``, ``Module.module_paths`` and ``state.module_types`` read
  models this way.

The same recorder (:func:`record`, :func:`note`) gathers the other events
a tool may want from one run of a model, each of a named
:class:`EventKind`: the logical names ``with_logical_constraint`` is called
with (``spmd.record_constraint_names``) and the pipelined stacks
(``pipeline.record_stage_axes``); ``nn.init_sharded`` reads both.

``liftmods.module`` re-exports the public names, as Linen's
``flax.linen.module`` has them.

>>> import jax, jax.numpy as jnp, liftmods as nn
>>> from liftmods import call_context
>>> model = nn.Dense(2)
>>> with call_context.record_calls() as calls:
...   _ = model.init(jax.random.key(0), jnp.ones((1, 3)))
>>> [(c.path, type(c.module).__name__, c.method, c.outputs) for c in calls]
[((), 'Dense', '__call__', ShapeDtypeStruct(shape=(1, 2), dtype=float32))]
"""
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import jax
import numpy as np

from liftmods import config

_use_named_call = config.FLAG_VALUES['flax_profile']


def enable_named_call() -> None:
  """Wraps every module method call in ``jax.named_scope`` (the default).

  The names then show in profiles and in the compiled program.
  """
  global _use_named_call
  _use_named_call = True


def disable_named_call() -> None:
  """Stops wrapping module method calls in ``jax.named_scope``."""
  global _use_named_call
  _use_named_call = False


def named_call_enabled() -> bool:
  """Whether module method calls are wrapped in ``jax.named_scope`` now."""
  return _use_named_call


class override_named_call:
  """Context manager setting named-call wrapping for its body.

  The previous setting is restored on exit.

  Args:
    enable: wrap calls in ``jax.named_scope`` inside the ``with`` body.
  """

  def __init__(self, enable: bool = True):
    self.enable = enable

  def __enter__(self):
    global _use_named_call
    self.saved, _use_named_call = _use_named_call, self.enable

  def __exit__(self, *exc):
    global _use_named_call
    _use_named_call = self.saved


class ThreadCalls(threading.local):
  """One thread's call state.

  * ``module_stack``: the modules whose wrapped methods are running,
    innermost last, above a bottom ``None``;
  * ``capture_stack``: the ``capture_intermediates`` filter of each
    ``init``/``apply`` in progress, innermost last;
  * ``interceptors``: the registered interceptors, outermost first;
  * ``records``: for each :class:`EventKind` with a :func:`record` block
    open, the list or dict of the innermost such block;
  * ``recording`` (read-only): the list the innermost :func:`record_calls`
    block fills, or None.
  """

  def __init__(self):
    self.module_stack = [None]
    self.capture_stack = []
    self.interceptors = []
    self.records = {}

  @property
  def recording(self) -> list | None:
    """The module calls being recorded in this thread, or None."""
    return self.records.get(MODULE_CALLS)


calls = ThreadCalls()


def current_module():
  """The module whose wrapped method is running in this thread, or None
  outside every module method."""
  return calls.module_stack[-1]


# -- interceptors ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InterceptorContext:
  """What an interceptor sees of the intercepted call.

  Attributes:
    module: the module whose method is called.
    method_name: the method's name.
    orig_method: the bound method itself; calling it skips the remaining
      interceptors.
  """

  module: Any
  method_name: str
  orig_method: Callable[..., Any]


@contextlib.contextmanager
def intercept_methods(
    interceptor: Callable[..., Any]) -> Iterator[None]:
  """Routes this thread's module method calls through ``interceptor``.

  Inside the ``with`` body, every wrapped method call runs as
  ``interceptor(next_fun, args, kwargs, context)``. Interceptors nest: the
  one registered first runs first. Methods marked ``nowrap``, dunder
  methods other than ``__call__``, fields and descriptors are not
  intercepted.

  Args:
    interceptor: ``interceptor(next_fun, args, kwargs, context)``, where
      ``next_fun(*args, **kwargs)`` runs the rest of the chain and
      ``context`` is an ``InterceptorContext``; returns the call's result.

  Yields:
    None; the interceptor is active until the body exits.

  >>> import jax.numpy as jnp, liftmods as nn
  >>> class Foo(nn.Module):
  ...   def __call__(self, x):
  ...     return x
  >>> def double(next_fun, args, kwargs, context):
  ...   return 2 * next_fun(*args, **kwargs)
  >>> with nn.intercept_methods(double):
  ...   print(Foo()(jnp.ones(1)))
  [2.]
  """
  stack = calls.interceptors
  stack.append(interceptor)
  try:
    yield
  finally:
    stack.pop()


def run_interceptors(orig_method: Callable[..., Any], module: Any,
                     *args: Any, **kwargs: Any) -> Any:
  """Calls a module method through this thread's interceptors.

  The outermost (first registered) interceptor runs first.

  Args:
    orig_method: the method's function, ``orig_method(module, *args)``.
    module: the module.
    *args: the call's arguments.
    **kwargs: the call's keyword arguments.

  Returns:
    What the chain of interceptors returns.
  """
  bound = functools.partial(orig_method, module)
  context = InterceptorContext(module, _fn_name(orig_method), bound)
  fun = bound
  for interceptor in reversed(calls.interceptors):
    fun = _intercepted(interceptor, fun, context)
  return fun(*args, **kwargs)


def active_interceptors() -> tuple:
  """The interceptors registered in this thread, outermost first. They are
  part of what a trace computes, so trace caches key on them."""
  return tuple(calls.interceptors)


def _intercepted(interceptor, fun, context):

  @functools.wraps(fun)
  def call(*args, **kwargs):
    return interceptor(fun, args, kwargs, context)

  return call


def _fn_name(fun) -> str:
  if isinstance(fun, functools.partial):
    return _fn_name(fun.func)
  return getattr(fun, '__name__', 'unnamed')


# -- recording ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class EventKind:
  """A kind of event the recorder gathers.

  Kinds compare by identity: use the constants of this module
  (:data:`MODULE_CALLS`, :data:`CONSTRAINT_NAMES`, :data:`STAGE_AXES`).

  Attributes:
    name: what the events are, for reading.
    keyed: events are ``(key, value)`` pairs gathered in a dict (a key
      seen again keeps its first place and takes the later value), and
      when a :func:`record` block of the kind ends, its dict is added to
      the enclosing block's, so every block sees the events of the blocks
      inside it. When False, events are gathered in a list, in the order
      they happen, and only the innermost block sees an event.
  """

  name: str
  keyed: bool

  def __repr__(self):
    return f'EventKind({self.name!r})'


# A wrapped module method call starting: a ModuleCall (record_calls).
MODULE_CALLS = EventKind('module calls', keyed=False)
# A logical name passed to with_logical_constraint: ``(name, None)``, the
# dict being an ordered set (spmd.record_constraint_names).
CONSTRAINT_NAMES = EventKind('logical constraint names', keyed=True)
# A pipelined stack called: ``(module path, stage mesh axis)``
# (pipeline.record_stage_axes).
STAGE_AXES = EventKind('pipelined stacks', keyed=True)


@contextlib.contextmanager
def record(kind: EventKind) -> Iterator[list | dict]:
  """Gathers the events of ``kind`` this thread notes in the ``with`` body.

  Blocks nest: an event goes to the innermost open block of its kind, and
  for a ``keyed`` kind each block passes what it gathered to the
  enclosing one when it ends. Other threads are not affected, and blocks
  of other kinds neither.

  Args:
    kind: the kind of event to gather.

  Yields:
    A fresh dict (``kind.keyed``) or list, filled as the body runs.

  >>> with record(STAGE_AXES) as outer:
  ...   note(STAGE_AXES, (('a',), 'stage'))
  ...   with record(STAGE_AXES) as inner:
  ...     note(STAGE_AXES, (('b',), 'pipe'))
  ...   with record(CONSTRAINT_NAMES) as names:
  ...     note(CONSTRAINT_NAMES, ('embed', None))
  >>> inner, outer, names
  ({('b',): 'pipe'}, {('a',): 'stage', ('b',): 'pipe'}, {'embed': None})
  """
  open_records = calls.records
  outer = open_records.get(kind)
  mine = {} if kind.keyed else []
  open_records[kind] = mine
  try:
    yield mine
  finally:
    if outer is None:
      del open_records[kind]
    else:
      open_records[kind] = outer
      if kind.keyed:
        outer.update(mine)


def open_record(kind: EventKind) -> list | dict | None:
  """The container of the innermost :func:`record` block of ``kind`` open
  in this thread, or None when none is open.

  One lookup: a caller with several events, or with events costly to
  build, asks once and fills the container itself (``update`` for a keyed
  kind, ``extend`` otherwise), skipping the work when it gets None.

  Args:
    kind: the kind of event.

  Returns:
    The dict (``kind.keyed``) or list the block yielded, or None.
  """
  return calls.records.get(kind)


def note(kind: EventKind, event: Any) -> None:
  """Hands ``event`` to the innermost open :func:`record` block of ``kind``
  in this thread; does nothing when none is open.

  Args:
    kind: the kind of event.
    event: the event; a ``(key, value)`` pair for a keyed kind.
  """
  found = calls.records.get(kind)
  if found is None:
    return
  if kind.keyed:
    key, value = event
    found[key] = value
  else:
    found.append(event)


@dataclasses.dataclass
class ModuleCall:
  """One recorded call of a module method.

  Array leaves of the arguments and output are replaced by their
  ``jax.ShapeDtypeStruct``.

  Attributes:
    path: the module's scope path.
    module: the (bound) module.
    method: the method's name.
    args: the positional arguments.
    kwargs: the keyword arguments.
    outputs: the output; None until the call returns.
  """

  path: tuple
  module: Any
  method: str
  args: tuple
  kwargs: dict
  outputs: Any = None

  @classmethod
  def enter(cls, into: list, module, method: str, args: tuple,
            kwargs: dict):
    """Appends the call ``module`` is starting to ``into`` (the list of the
    open :data:`MODULE_CALLS` block, which the caller looked up) and
    returns it; the caller sets ``outputs`` when the call returns."""
    call = cls(module.scope.path, module, method, abstract_arrays(args),
               abstract_arrays(kwargs))
    into.append(call)
    return call


def record_calls() -> contextlib.AbstractContextManager[list[ModuleCall]]:
  """Records the module method calls of a ``with`` body.

  The list it yields fills with a :class:`ModuleCall` for every wrapped
  method call this thread makes in the body, in the order the calls start
  (so a parent comes before the children it calls): :func:`record` of
  :data:`MODULE_CALLS`.

  Calls of ``setup`` and of unbound modules are left out, and so are
  methods that are never wrapped (see :func:`intercept_methods`). Only the
  innermost of nested ``record_calls`` blocks records; other threads are
  not affected. Run the model under ``jax.eval_shape`` to record without
  computing anything.

  Returns:
    A context manager yielding the list.
  """
  return record(MODULE_CALLS)


def is_array(x: Any) -> bool:
  """Whether ``x`` is an array leaf.

  Args:
    x: any value.

  Returns:
    True for a JAX or NumPy array or a ``jax.ShapeDtypeStruct``.
  """
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def abstract_arrays(tree: Any) -> Any:
  """``tree`` with its array leaves replaced by ShapeDtypeStructs.

  The result holds no tracer and no device buffer.

  Args:
    tree: a pytree.

  Returns:
    The abstract tree.
  """
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array(x) else x,
      tree, is_leaf=lambda x: x is None)


def split_arrays(tree: Any) -> tuple[list, Callable[[Sequence[Any]], Any]]:
  """Separates the array leaves of ``tree`` from its static structure.

  Lets a call whose arguments mix arrays and plain values go through
  ``jax.eval_shape`` or ``jax.jit``, e.g. to re-run a recorded call.

  Args:
    tree: a pytree.

  Returns:
    ``(array_leaves, rebuild)``; ``rebuild(new_leaves)`` is ``tree`` with
      its array leaves replaced by ``new_leaves``, every other leaf staying
      the static Python value it was.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  where = [i for i, x in enumerate(leaves) if is_array(x)]

  def rebuild(arrays):
    new = list(leaves)
    for i, x in zip(where, arrays):
      new[i] = x
    return treedef.unflatten(new)

  return [leaves[i] for i in where], rebuild
