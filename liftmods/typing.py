"""Type aliases of Linen code, as ``flax.typing`` names them.

Third-party Linen code annotates with these names (``from flax.typing import
Array``, ``from flax.linen.linear import PrecisionLike``); liftmods' layer
modules make the same names available, so such imports resolve under
:mod:`liftmods.compat`. They are aliases: nothing checks them at run time.
flax.typing's helper classes ``HashableMapping``, ``PytreeDeque``,
``SizeBytes`` and ``BaseConfigContext`` are not provided.

>>> import jax.numpy as jnp
>>> from liftmods import typing as lt
>>> from collections.abc import Sequence
>>> lt.Shape == Sequence[int]
True
>>> lt.is_key_like('kernel'), lt.is_key_like(['not', 'hashable'])
(True, False)
>>> lt.has_shape_dtype(jnp.zeros(2)), lt.has_shape_dtype(3)
(True, False)
"""
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Optional, Protocol, TypeGuard, TypeVar, Union

import jax

from liftmods.core.frozen_dict import FrozenDict
from liftmods.core.lift import In, Out

T = TypeVar('T')
K = TypeVar('K')
A = TypeVar('A')
F = TypeVar('F', bound=Callable[..., Any])
HA = TypeVar('HA', bound=Hashable)
HB = TypeVar('HB')
TupleArg = TypeVar('TupleArg', bound=tuple)

Array = Union[jax.Array, Any]
PRNGKey = jax.Array
RNGSequences = dict[str, PRNGKey]
Dtype = Union[jax.typing.DTypeLike, Any]
Shape = Sequence[int]
Leaf = Any
Path = str


class Key(Hashable, Protocol):
  """A dictionary key of a variable tree (anything hashable and ordered)."""

  def __lt__(self, other) -> bool:
    ...


def is_key_like(x: Any) -> TypeGuard[Key]:
  """Whether ``x`` can be a key of a variable tree."""
  return isinstance(x, Hashable) and hasattr(x, '__lt__')


PathParts = tuple[Key, ...]

PrecisionLike = Union[None, str, jax.lax.Precision,
                      tuple[str, str], tuple[jax.lax.Precision,
                                             jax.lax.Precision]]
DotGeneralT = Callable[..., Array]
ConvGeneralDilatedT = Callable[..., Array]
EinsumT = Callable[..., Array]
PaddingLike = Union[str, int, Sequence[Union[int, tuple[int, int]]]]
LaxPadding = Union[str, Sequence[tuple[int, int]]]
Initializer = Union[jax.nn.initializers.Initializer, Callable[..., Any]]

Collection = Mapping[str, Any]
MutableCollection = dict[str, Any]
VariableDict = Mapping[str, Collection]
FrozenVariableDict = FrozenDict[str, Collection]
MutableVariableDict = dict[str, MutableCollection]
PRNGFoldable = Union[int, str]

CollectionFilter = Any
PRNGSequenceFilter = Any


Axis = Optional[int]
InOutAxis = Union[Axis, In[Axis], Out[Axis]]
ScanAxis = int
InOutScanAxis = Union[ScanAxis, In[ScanAxis], Out[ScanAxis]]
Axes = Union[int, Sequence[int]]

LogicalNames = tuple[Union[str, None], ...]
AxisName = str | tuple[str, ...] | None
LogicalRules = Sequence[tuple[str, AxisName]]
ArrayPytree = Any
LogicalPartitionSpec = Any
LogicalPartitionSpecPytree = Any
PartitionSpecPytree = Any
Sharding = tuple[AxisName, ...]


class Missing:
  """Type of :data:`MISSING`, a placeholder for "no value given"."""


MISSING = Missing()


class ShapeDtype(Protocol):
  """Anything with a ``shape`` and a ``dtype`` (arrays, ShapeDtypeStructs)."""
  shape: Shape
  dtype: Dtype


def has_shape_dtype(x: Any) -> TypeGuard[ShapeDtype]:
  """Whether ``x`` has both a ``shape`` and a ``dtype``."""
  return hasattr(x, 'shape') and hasattr(x, 'dtype')


class PromoteDtypeFn(Protocol):
  """Signature of ``promote_dtype``-like functions that layers accept."""

  def __call__(self, args: tuple, *, dtype: Any = None,
               inexact: bool = True) -> tuple:
    ...
