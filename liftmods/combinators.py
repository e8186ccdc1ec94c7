"""``nn.combinators``: Sequential under Linen's module path.

>>> import liftmods as nn
>>> nn.combinators.Sequential is nn.Sequential
True
"""
# pylint: disable=unused-import
from liftmods.layers.combinators import Sequential
from liftmods.module import Module, compact

# The typing names flax.linen.combinators imports, as code reaches them there.
from collections.abc import Callable, Sequence
from typing import Any
