"""``nn.normalization``: normalization layers and the WeightNorm /
SpectralNorm wrappers under Linen's module path (code in
:mod:`liftmods.layers.normalization` and :mod:`liftmods.layers.weight_norms`).

>>> import liftmods as nn
>>> nn.normalization.SpectralNorm is nn.SpectralNorm
True
"""
# pylint: disable=unused-import
from liftmods.dtypes import canonicalize_dtype
from liftmods.layers.normalization import (BatchNorm, GroupNorm,
                                           InstanceNorm, LayerNorm, RMSNorm)
from liftmods.layers.weight_norms import SpectralNorm, WeightNorm
from liftmods.module import Module, compact, merge_param
from liftmods.transforms import map_variables

# Linen's private helpers under their Linen names, with Linen's signatures
# and results: layers written outside Linen build on them (sbx's BatchRenorm
# imports _canonicalize_axes, _compute_stats and _normalize).
from liftmods.layers.normalization import (  # pylint: disable=unused-import
    abs_sq as _abs_sq, canonicalize_axes as _canonicalize_axes,
    compute_stats as _compute_stats, normalize as _normalize)
from liftmods.layers.weight_norms import (  # pylint: disable=unused-import
    l2_normalize as _l2_normalize)

# Type aliases Linen code imports from this module (flax.linen.normalization).
from liftmods.typing import (  # pylint: disable=unused-import
    Array, Axes, Dtype, Initializer, PRNGKey, Shape)

# The other names of flax.linen.normalization: the library and typing names
# it imports and its own modules, as code written for Linen reaches them.
# Its ``initializers`` is jax.nn.initializers itself.
import dataclasses  # pylint: disable=g-bad-import-order
import functools
from collections.abc import Iterable
from dataclasses import field
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.nn import initializers

from liftmods import dtypes, module, transforms
