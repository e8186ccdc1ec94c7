"""liftmods: a Flax-Linen-compatible module system for JAX built around
lifted transforms. ``import liftmods as nn`` runs Linen model code."""
from liftmods import core, errors
from liftmods.core import DenyList, FrozenDict, freeze, unfreeze
from liftmods.core.scope import Variable
from liftmods.core.meta import (AxisMetadata, Partitioned, get_partition_spec,
                                get_sharding, with_partitioning)
from liftmods.core import meta
from liftmods.module import (Module, apply, compact, init, init_with_output,
                             merge_param, nowrap)

__version__ = '0.1.0'
