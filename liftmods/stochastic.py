"""``nn.stochastic``: Dropout under Linen's module path.

>>> import liftmods as nn
>>> nn.stochastic.Dropout is nn.Dropout
True
"""
# pylint: disable=unused-import
from liftmods.layers.stochastic import Dropout
from liftmods.module import Module, compact, merge_param

# Type aliases Linen code imports from this module (flax.linen.stochastic).
from liftmods.typing import (  # pylint: disable=unused-import
    PRNGKey)

# The other names of flax.linen.stochastic (the modules it imports).
from collections.abc import Sequence  # pylint: disable=g-bad-import-order

import jax.numpy as jnp
from jax import lax, random
