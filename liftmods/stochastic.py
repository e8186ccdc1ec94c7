"""``nn.stochastic``: Dropout under Linen's module path.

>>> import liftmods as nn
>>> nn.stochastic.Dropout is nn.Dropout
True
"""
# pylint: disable=unused-import
from liftmods.layers.stochastic import Dropout
from liftmods.module import Module, compact, merge_param
