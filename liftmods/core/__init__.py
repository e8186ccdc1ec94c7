"""The functional core: scopes over variable collections, PRNG sequences,
filters and axis metadata. Knows nothing of Module classes.

>>> import jax, jax.numpy as jnp
>>> from liftmods import core
>>> def bias(scope, x):
...   return x + scope.param('b', jax.nn.initializers.zeros, x.shape[-1:])
>>> out, variables = core.init(bias)(jax.random.key(0), jnp.ones(3))
>>> variables
{'params': {'b': Array([0., 0., 0.], dtype=float32)}}
"""
from liftmods.core.filters import DenyList, in_filter
from liftmods.core.frozen_dict import (FrozenDict, copy, freeze, pop,
                                       pretty_repr, unfreeze)
from liftmods.core import meta
from liftmods.core.rngs import LazyKey
from liftmods.core.scope import (Scope, Variable, apply, bind, init,
                                 lazy_init)

__all__ = [
    'DenyList', 'in_filter', 'FrozenDict', 'copy', 'freeze', 'pop',
    'pretty_repr', 'unfreeze', 'meta', 'LazyKey', 'Scope', 'Variable',
    'apply', 'bind', 'init', 'lazy_init',
]
