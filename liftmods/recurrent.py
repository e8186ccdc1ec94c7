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
