"""``nn.linear``: the linear layers under Linen's module path (the code
lives in :mod:`liftmods.layers.linear`).

>>> import liftmods as nn
>>> nn.linear.Dense is nn.Dense
True
"""
# pylint: disable=unused-import
from liftmods.dtypes import promote_dtype
from liftmods.layers.linear import (Conv, ConvLocal, ConvTranspose, Dense,
                                    DenseGeneral, Einsum, Embed,
                                    PromoteDtypeFn, canonicalize_padding,
                                    default_embed_init, default_kernel_init)
from liftmods.module import Module, compact

# Type aliases Linen code imports from this module (flax.linen.linear).
from liftmods.typing import (  # pylint: disable=unused-import
    Array, ConvGeneralDilatedT, DotGeneralT, Dtype, Initializer,
    LaxPadding, PRNGKey, PaddingLike, PrecisionLike, Shape)

# The other names of flax.linen.linear: the library and typing names it
# imports and its own modules, as code written for Linen reaches them
# (``from flax.linen.linear import initializers``).
from collections.abc import Iterable, Sequence  # pylint: disable=g-bad-import-order
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum  # a dependency of jax
from jax import eval_shape, lax
from jax.core import ShapedArray

from liftmods import initializers, module
from liftmods.core import meta
