"""``nn.recurrent``: recurrent cells and the RNN wrappers under Linen's
module path (code in :mod:`liftmods.layers.recurrent`).

>>> import liftmods as nn
>>> nn.recurrent.RNN is nn.RNN
True
"""
# pylint: disable=unused-import
from liftmods.activation import sigmoid, tanh
from liftmods.core.frozen_dict import FrozenDict
from liftmods.dtypes import promote_dtype
from liftmods.layers.linear import Conv, Dense, default_kernel_init
from liftmods.layers.recurrent import (RNN, Bidirectional, ConvLSTMCell,
                                       DenseParams, GRUCell, LSTMCell,
                                       MGUCell, OptimizedLSTMCell, RNNBase,
                                       RNNCellBase, SimpleCell,
                                       flip_sequences)
from liftmods.module import Module, compact, nowrap

# Type aliases Linen code imports from this module (flax.linen.recurrent).
from liftmods.typing import (  # pylint: disable=unused-import
    A, Array, CollectionFilter, Dtype, InOutScanAxis, Initializer,
    PRNGKey, PRNGSequenceFilter, PrecisionLike)

# The other names of flax.linen.recurrent: the library and typing names it
# imports, and its own aliases, as code written for Linen reaches them.
from collections.abc import Callable, Mapping, Sequence  # pylint: disable=g-bad-import-order
from functools import partial
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from liftmods import initializers, transforms

# Linen's names for what a cell carries, keeps per step and returns.
Carry = Any
CarryHistory = Any
Output = Any

# Names of flax.linen.recurrent that mean nothing in liftmods, and why.
_LINEN_ONLY = {
    'logging': 'absl.logging, a dependency of flax that liftmods does not '
               'have (it needs only jax, jaxlib, numpy and msgpack)',
    'Protocol': 'typing_extensions.Protocol, from a dependency of flax that '
                'liftmods does not have; typing.Protocol is the standard '
                'library\'s',
}


from liftmods import linen_names  # pylint: disable=g-import-not-at-top,wrong-import-position

__getattr__ = linen_names.not_provided(__name__, 'flax.linen.recurrent',
                                        _LINEN_ONLY)
