"""liftmods: a Flax-Linen-compatible module system for JAX built around
lifted transforms. ``import liftmods as nn`` runs Linen model code.

>>> import jax, jax.numpy as jnp
>>> import liftmods as nn
>>> class MLP(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))
>>> variables = MLP().init(jax.random.key(0), jnp.ones((1, 3)))
>>> sorted(variables['params'])
['Dense_0', 'Dense_1']
"""
from liftmods import traceback_util  # hides liftmods frames; import first
from liftmods import batch_apply, config, core, errors, initializers
from liftmods.batch_apply import BatchApply
from liftmods import fp8_ops
from liftmods.fp8_ops import (Fp8DirectDotGeneralOp, Fp8DotGeneral,
                              Fp8DotGeneralOp, Fp8Einsum,
                              NANOOFp8DotGeneralOp)
from liftmods.activation import (celu, elu, gelu, glu, hard_sigmoid,
                                 hard_silu, hard_swish, hard_tanh, leaky_relu,
                                 log_sigmoid, log_softmax, logsumexp,
                                 normalize, one_hot, relu, relu6, selu,
                                 sigmoid, silu, soft_sign, softmax, softplus,
                                 standardize, swish, tanh)
from liftmods.attention_fns import (combine_masks, dot_product_attention,
                                    dot_product_attention_weights,
                                    make_attention_mask, make_causal_mask)
from liftmods.attention_fns import (FusedAttentionError,
                                    FusedAttentionWarning,
                                    fused_dot_product_attention)
from liftmods.core import DenyList, FrozenDict, freeze, meta, unfreeze
from liftmods.core.meta import (PARTITION_NAME, AxisMetadata, Partitioned,
                                get_partition_spec, unbox,
                                get_sharding, with_partitioning)
from liftmods.core.scope import Variable
from liftmods.dtypes import canonicalize_dtype, promote_dtype
from liftmods.initializers import ones, ones_init, zeros, zeros_init
from liftmods.layers.activation_modules import PReLU
from liftmods.layers.attention import (MultiHeadAttention,
                                       MultiHeadDotProductAttention,
                                       SelfAttention)
from liftmods.layers.combinators import Sequential
from liftmods.layers.linear import (Conv, ConvLocal, ConvTranspose, Dense,
                                    DenseGeneral, Einsum, Embed)
from liftmods.layers.normalization import (BatchNorm, GroupNorm, InstanceNorm,
                                           LayerNorm, RMSNorm)
from liftmods.layers.recurrent import (RNN, Bidirectional, ConvLSTMCell,
                                       GRUCell, LSTMCell, MGUCell,
                                       OptimizedLSTMCell, RNNCellBase,
                                       SimpleCell, flip_sequences)
from liftmods.layers.stochastic import Dropout
from liftmods.layers.weight_norms import SpectralNorm, WeightNorm
from liftmods.module import (Module, apply, compact, compact_name_scope,
                             disable_named_call, enable_named_call, init,
                             init_with_output, intercept_methods,
                             override_named_call, merge_param, nowrap,
                             share_scope)
from liftmods.pooling import avg_pool, max_pool, min_pool, pool
from liftmods.precision import (Precision, PrecisionPolicyError,
                                PrecisionPolicyWarning, precision_policy)
from liftmods.summary import tabulate

__version__ = '0.1.0'
# Linen's submodule namespaces (nn.linear, nn.attention, ...).
from liftmods import (activation, attention, combinators, dtypes,
                      kw_only_dataclasses, linear, module, normalization,
                      pooling, precision, recurrent, stochastic, summary,
                      transforms, traverse_util)
from liftmods.core.lift import broadcast
from liftmods.transforms import (add_metadata_axis, checkpoint, cond,
                                 custom_vjp, fold_rngs, grad, jit, jvp,
                                 map_variables,
                                 named_call, remat, remat_scan, scan, switch,
                                 value_and_grad, vjp, vmap, while_loop)
from liftmods import state
from liftmods import partitioning, spmd
from liftmods.sharded_init import LogicalNamesWarning, init_sharded
from liftmods.shard_map_transform import shard_map
from liftmods.spmd import (LogicallyPartitioned, get_logical_axis_rules,
                           logical_axis_rules, logical_to_mesh,
                           logical_out_sharding, logical_to_mesh_axes,
                           logical_to_mesh_sharding,
                           set_logical_axis_rules, with_logical_constraint,
                           with_logical_partitioning)
from liftmods.pipeline import Pipeline, PipelineError
from liftmods.stack import (Stack, StackOffloadWarning, StackPolicy,
                            stack_layers, unstack_layers)
from jax.ad_checkpoint import checkpoint_name

# Names Linen's submodules hold for modules that sit above them in liftmods'
# layer map (docs/architecture.md), bound here: flax.linen.module.nn and
# flax.linen.partitioning.nn are the package itself, and
# flax.linen.module.serialization and flax.linen.transforms.serialization
# are flax.serialization, whose counterpart is liftmods.serialization.
import liftmods as _package  # pylint: disable=g-import-not-at-top,wrong-import-position,import-self
from liftmods import serialization as _serialization  # pylint: disable=g-import-not-at-top,wrong-import-position
module.nn = partitioning.nn = _package
module.serialization = transforms.serialization = _serialization
del _package, _serialization
