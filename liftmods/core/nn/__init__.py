"""Functional layers over a scope (``flax.core.nn``): each layer is a
function ``layer(scope, inputs, ...)`` that declares its parameters with
``scope.param`` and returns the output.

>>> import jax, jax.numpy as jnp
>>> from liftmods import core
>>> from liftmods.core import nn
>>> def mlp(scope, x):
...   h = nn.relu(nn.dense(scope.push('hidden'), x, 4))
...   return nn.dense(scope.push('out'), h, 1)
>>> y, variables = core.init(mlp)(jax.random.key(0), jnp.ones((2, 3)))
>>> jax.tree_util.tree_map(jnp.shape, variables['params']['out'])
{'bias': (1,), 'kernel': (4, 1)}
"""
from liftmods import activation, initializers
from liftmods.activation import (celu, elu, gelu, glu, leaky_relu,
                                 log_sigmoid, log_softmax, relu, sigmoid,
                                 silu, soft_sign, softmax, softplus, swish,
                                 tanh)
from liftmods.core.nn.attention import (dot_product_attention,
                                        multi_head_dot_product_attention)
from liftmods.core.nn.linear import (Embedding, conv, conv_transpose, dense,
                                     dense_general, embedding)
from liftmods.core.nn.normalization import (batch_norm, group_norm,
                                            layer_norm)
from liftmods.core.nn.stochastic import dropout
from liftmods.pooling import avg_pool, max_pool
