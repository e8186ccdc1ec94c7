"""liftmods: a Flax-Linen-compatible module system for JAX built around
lifted transforms. ``import liftmods as nn`` runs Linen model code."""
from liftmods import core, errors
from liftmods.core import DenyList, FrozenDict, freeze, unfreeze

__version__ = '0.1.0'
