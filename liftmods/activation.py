"""Activation functions exported by the Linen API.

They are the ``jax.nn`` functions themselves (plus ``jax.numpy.tanh``), so
results are identical to Linen's. ``normalize`` is kept as the old alias of
``standardize``. The parametric ``PReLU`` layer is a Module and lives with the
other layers.

>>> import jax.numpy as jnp
>>> from liftmods import activation
>>> activation.relu(jnp.array([-1.0, 0.5]))
Array([0. , 0.5], dtype=float32)
>>> activation.one_hot(jnp.array([2, 0]), 3)
Array([[0., 0., 1.],
       [1., 0., 0.]], dtype=float32)
"""
from jax.nn import celu as celu
from jax.nn import elu as elu
from jax.nn import gelu as gelu
from jax.nn import glu as glu
from jax.nn import hard_sigmoid as hard_sigmoid
from jax.nn import hard_silu as hard_silu
from jax.nn import hard_swish as hard_swish
from jax.nn import hard_tanh as hard_tanh
from jax.nn import leaky_relu as leaky_relu
from jax.nn import log_sigmoid as log_sigmoid
from jax.nn import log_softmax as log_softmax
from jax.nn import logsumexp as logsumexp
from jax.nn import one_hot as one_hot
from jax.nn import relu as relu
from jax.nn import relu6 as relu6
from jax.nn import selu as selu
from jax.nn import sigmoid as sigmoid
from jax.nn import silu as silu
from jax.nn import soft_sign as soft_sign
from jax.nn import softmax as softmax
from jax.nn import softplus as softplus
from jax.nn import standardize as standardize
from jax.nn import swish as swish
from jax.numpy import tanh as tanh

# Deprecated spelling kept for compatibility with older Linen code.
normalize = standardize

# Linen's nn.activation also holds the parametric PReLU module.
from liftmods.layers.activation_modules import PReLU as PReLU  # pylint: disable=g-import-not-at-top,wrong-import-position

# Type aliases Linen code imports from this module (flax.linen.activation).
from liftmods.typing import (  # pylint: disable=unused-import
    Array, Dtype)

# The other names of flax.linen.activation, which imports them for PReLU;
# code written for Linen reaches them there (brax builds its table of
# activations from nn.activation, ``compact`` included).
from typing import Any, Optional  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import,g-bad-import-order

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import

from liftmods.layers.linear import Dense  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
from liftmods.module import Module, compact  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
