"""``nn.attention``: the attention layers and functions under Linen's
module path (code in :mod:`liftmods.layers.attention` and
:mod:`liftmods.attention_fns`).

>>> import liftmods as nn
>>> nn.attention.SelfAttention is nn.SelfAttention
True
"""
# flax.linen.attention has the name ``annotations`` from this import.
from __future__ import annotations

# pylint: disable=unused-import
from liftmods.attention_fns import (combine_masks, dot_product_attention,
                                    dot_product_attention_weights,
                                    make_attention_mask, make_causal_mask)
from liftmods.dtypes import promote_dtype
from liftmods.layers.attention import (MultiHeadAttention,
                                       MultiHeadDotProductAttention,
                                       SelfAttention)
from liftmods.layers.linear import DenseGeneral, default_kernel_init
from liftmods.layers.normalization import LayerNorm
from liftmods.module import Module, compact, merge_param

# Type aliases Linen code imports from this module (flax.linen.attention).
from liftmods.typing import (  # pylint: disable=unused-import
    Array, DotGeneralT, Dtype, Initializer, PRNGKey, PrecisionLike, Shape)

# The other names of flax.linen.attention: the library and typing names it
# imports, as code written for Linen reaches them there.
import functools  # pylint: disable=g-bad-import-order
import inspect
import warnings
from collections.abc import Callable
from typing import Any, overload

import jax
import jax.numpy as jnp
from jax import lax, random

from liftmods import initializers
