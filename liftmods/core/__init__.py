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
from typing import Any as _Any, Union as _Union

import jax as _jax

from liftmods.core.filters import DenyList, in_filter
from liftmods.core.frozen_dict import (FrozenDict, copy, freeze, pop,
                                       pretty_repr, unfreeze)
from liftmods.core import meta, spmd
from liftmods.core.rngs import LazyKey
from liftmods.core.scope import (Scope, Variable, apply, bind, init,
                                 lazy_init)
from liftmods.core.lift import (broadcast, custom_vjp, jit, jvp, remat,
                                remat_scan, scan, vjp, vmap, while_loop)
from liftmods.core.meta import AxisMetadata, map_axis_meta, unbox
from liftmods.core import tracers
from liftmods.core.tracers import check_trace_level, current_trace
from liftmods.core.filters import (filter_to_set, intersect, is_empty,
                                   subtract, union)

__all__ = [
    'DenyList', 'in_filter', 'FrozenDict', 'copy', 'freeze', 'pop',
    'pretty_repr', 'unfreeze', 'meta', 'LazyKey', 'Scope', 'Variable',
    'apply', 'bind', 'init', 'lazy_init', 'broadcast', 'custom_vjp', 'jit', 'jvp',
    'remat', 'remat_scan', 'scan', 'vjp', 'vmap', 'while_loop',
    'AxisMetadata', 'map_axis_meta', 'unbox', 'filter_to_set', 'intersect',
    'is_empty', 'subtract', 'union', 'Array', 'tracers', 'current_trace',
    'check_trace_level',
]

Array = _Union[_jax.Array, _Any]
