"""Variable trees as a tool: filters, split / merge / update, partial
training and model surgery, as small pure functions over nested dicts.

liftmods keeps a model's variables in plain nested dicts
(``{collection: {module: {name: value}}}``). This package works on any such
tree (or a FrozenDict, or any sub-tree such as ``variables['params']``),
inside ``jax.jit`` too, and never mutates its inputs:

* filters (:mod:`liftmods.state.filters`): path globs, regexes, collections,
  leaf types, owning module types, predicates, ``All`` / ``Any`` / ``Not``;
* :func:`split` / :func:`select` / :func:`merge` / :func:`update` /
  :func:`state_of`, with NNX's semantics where they overlap;
* :func:`mask` / :func:`labels` for ``optax.masked`` /
  ``optax.multi_transform``, and :func:`value_and_grad` over a part;
* surgery: :func:`get`, :func:`drop`, :func:`rename`, :func:`graft`,
  :func:`load` (with a :class:`LoadReport`).

See ``docs/state.md`` for a guide.

>>> import jax, jax.numpy as jnp
>>> import liftmods as nn
>>> class Net(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2, name='head')(nn.Dense(4, name='encoder')(x))
>>> variables = Net().init(jax.random.key(0), jnp.ones((1, 3)))
>>> head, trunk = nn.state.split(variables, 'params/head', ...)
>>> nn.state.paths(head)
['params/head/kernel', 'params/head/bias']
>>> nn.state.merge(head, trunk) == variables
True
"""
from liftmods.state import errors
from liftmods.state.filters import (All, Any, Collection, Everything, Filter,
                                    InModule, Not, Nothing, OfType, Path,
                                    PathContains, PathRegex, resolve,
                                    to_predicate)
from liftmods.state.modules import module_types, state_of
from liftmods.state.surgery import (LoadReport, drop, get, graft, load,
                                    rename, to_path)
from liftmods.state.training import grad, labels, mask, value_and_grad
from liftmods.state.tree import (flatten, iter_leaves, merge, paths, select,
                                 split, unflatten, update)
