"""Which module type sits at which path of a model.

:class:`~liftmods.state.InModule` filters need ``{module_path: type}``.
A bound module knows the submodules it has created: those of ``setup``
(created on first access) and those its ``@compact`` methods created when it
was called. :func:`module_types` reads them, or, given example inputs,
traces one call abstractly (``jax.eval_shape``, no FLOPs) and records every
module that runs.

>>> import jax, jax.numpy as jnp
>>> import liftmods as nn
>>> from liftmods import state
>>> class Net(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2, name='head')(nn.LayerNorm()(x))
>>> x = jnp.ones((1, 3))
>>> variables = Net().init(jax.random.key(0), x)
>>> types = state.module_types(Net().bind(variables), x)
>>> {'/'.join(p): t.__name__ for p, t in types.items()}
{'': 'Net', 'LayerNorm_0': 'LayerNorm', 'head': 'Dense'}
"""
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from liftmods.module import Module, record_calls
from liftmods.state import errors, filters
from liftmods.state.filters import FilterLike, needs_modules, resolve
from liftmods.state.tree import iter_leaves, select


def module_types(module: Module, *args: Any,
                 method: Callable[..., Any] | str | None = None,
                 rngs: Any = None, **kwargs: Any) -> dict:
  """``{module_path: type}`` for a bound ``module`` and its submodules.

  Without ``args``/``kwargs`` the submodules the bound module already has
  are walked (``setup`` runs if it has not). With them, ``method`` is also
  traced once on an unbound copy of the module (``jax.eval_shape``, every
  collection mutable) and the modules that run are recorded; use this for
  ``@compact`` models that were never called.

  Args:
    module: a bound module (``model.bind(variables)``).
    *args: arguments of ``method`` for the traced run.
    method: the method to trace (default ``__call__``).
    rngs: rngs passed to ``apply`` for the traced run.
    **kwargs: keyword arguments of ``method``.

  Returns:
    ``{path tuple: Module class}``; the root's path is ``()``.

  Raises:
    StateError: ``module`` is not a bound module.
  """
  _require_bound('module_types', module)
  found = {}
  _walk(module, (), found)
  if args or kwargs:
    found.update(_traced(module, args, kwargs, method, rngs))
  return found


def _require_bound(fn: str, module) -> None:
  if not isinstance(module, Module) or module.scope is None:
    unbound = ' (unbound)' if isinstance(module, Module) else ''
    raise errors.StateError(
        f'{fn}() needs a bound module (model.bind(variables)); got '
        f'{type(module).__name__}{unbound}.')


def _walk(module: Module, path: tuple, found: dict):
  found[path] = type(module)
  module._try_setup()
  for name, child in module._state.children.items():
    if isinstance(child, Module):
      _walk(child, path + (name,), found)


def _traced(bound: Module, args, kwargs, method, rngs) -> dict:
  module, variables = bound.unbind()

  def run(variables):
    return module.apply(variables, *args, method=method, rngs=rngs,
                        mutable=True, **kwargs)

  with record_calls() as calls:
    jax.eval_shape(run, variables)
  return {tuple(c.path): type(c.module) for c in calls}


filters.set_model_reader(module_types)


def check_known(modules: dict, tree_paths: Iterable[tuple]) -> None:
  """Checks that every leaf's module is known.

  Args:
    modules: a :func:`module_types` mapping.
    tree_paths: the leaf paths of a ``{collection: ...}`` tree.

  Raises:
    UnknownModuleError: a leaf lies below a known module that has no known
      submodules: the sign of a ``@compact`` module that was never called,
      whose children do not exist yet.
  """
  has_children = {p[:-1] for p in modules if p}
  for path in tree_paths:
    mpath = tuple(path[1:-1])
    known = max(n for n in range(len(mpath) + 1)
                if n == 0 or mpath[:n] in modules)
    if known < len(mpath) and mpath[:known] not in has_children:
      raise errors.UnknownModuleError(mpath[:known + 1], path)


def state_of(module: Module, *filters: FilterLike,
             modules: Mapping[tuple, type] | None = None) -> Mapping | tuple:
  """The variables of a bound ``module``, picked by ``filters``.

  Like NNX's ``nnx.state``. Module-type filters (``nn.Dense``,
  :class:`InModule`) are resolved through ``module``, or through
  ``modules`` when given.

  Args:
    module: a bound module (``model.bind(variables)``).
    *filters: anything :func:`to_predicate` accepts.
    modules: a :func:`module_types` mapping to resolve module-type filters
      with.

  Returns:
    With no filter the whole ``{collection: ...}`` tree, with one filter the
      tree of its leaves, with several a tuple (first match wins); leaves no
      filter matches are left out.

  Raises:
    StateError: ``module`` is not a bound module.
    UnknownModuleError: a module-type filter meets a ``@compact`` module
      that was never called (pass ``modules`` from a traced
      :func:`module_types`).

  >>> import jax, jax.numpy as jnp
  >>> import liftmods as nn
  >>> from liftmods import state
  >>> class Net(nn.Module):
  ...   def setup(self):
  ...     self.norm = nn.LayerNorm()
  ...     self.head = nn.Dense(2)
  ...   def __call__(self, x):
  ...     return self.head(self.norm(x))
  >>> variables = Net().init(jax.random.key(0), jnp.ones((1, 3)))
  >>> state.paths(state.state_of(Net().bind(variables), nn.Dense))
  ['params/head/kernel', 'params/head/bias']
  """
  _require_bound('state_of', module)
  variables = module.variables
  if any(needs_modules(f) for f in filters):
    if modules is None:
      modules = module_types(module)
      check_known(modules, (p for p, _ in iter_leaves(variables)))
    filters = tuple(resolve(f, modules) for f in filters)
  return select(variables, *filters)
