"""Linear layers: dense, einsum, convolutions and embeddings.

Each class takes the same constructor arguments as its Flax Linen namesake
(names, order, defaults), creates the same variables in the same order with
the same initializer calls, and computes the same function, so a checkpoint
made with one loads into the other and equal keys give equal parameters.

>>> import jax, jax.numpy as jnp
>>> from liftmods.layers import linear as nn
>>> variables = nn.Dense(3).init(jax.random.key(0), jnp.ones((2, 5)))
>>> jax.tree_util.tree_map(jnp.shape, variables)
{'params': {'bias': (3,), 'kernel': (5, 3)}}
"""
import functools
import math
import numbers
import operator
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from liftmods import initializers
from liftmods.core import explicit, meta
from liftmods.dtypes import promote_dtype
from liftmods.module import Module, compact, merge_param, nowrap

Array = Any
Dtype = Any
Initializer = initializers.Initializer
PrecisionLike = Any
PaddingLike = Any
DotGeneralT = Any
ConvGeneralDilatedT = Any

__all__ = [
    'Conv', 'ConvLocal', 'ConvTranspose', 'Dense', 'DenseGeneral', 'Einsum',
    'Embed', 'PromoteDtypeFn', 'canonicalize_padding', 'default_embed_init',
    'default_kernel_init',
]


class PromoteDtypeFn(Protocol):
  """Shape of the ``promote_dtype`` argument: arrays (or None) in, the same
  arrays cast to one dtype out."""

  def __call__(self, *args: Array | None, dtype: Any = None,
               inexact: bool = True) -> list[Array | None]:
    ...


# numpy >= 1.25 keeps it in np.exceptions; it is both a ValueError and an
# IndexError (what Linen's out-of-range axis raises).
_AxisError = getattr(np, 'exceptions', np).AxisError

default_kernel_init = initializers.lecun_normal()
default_embed_init = initializers.variance_scaling(1.0, 'fan_in', 'normal',
                                                   out_axis=0)


# -- small helpers -------------------------------------------------------------


def _where(module: Module) -> str:
  """``'Dense at /Dense_0'`` for a bound module, the class name otherwise."""
  name = type(module).__name__
  scope = module.scope
  return f'{name} at {scope.path_text}' if scope is not None else name


def _as_tuple(x) -> tuple:
  return tuple(x) if isinstance(x, Iterable) else (x,)


def _pick_fn(factory, fn, default):
  """The injected op: an instance of ``factory`` wins over ``fn``, which
  wins over ``default``."""
  if factory is not None:
    return factory()
  return fn if fn is not None else default


def _flat_init(init_fn, rng, shape, flat_shape, dtype):
  """Calls ``init_fn`` on a 2-D (or 1-D) ``flat_shape`` and reshapes the
  result (inside its metadata box, if any) to ``shape``."""
  value = init_fn(rng, flat_shape, dtype)
  if isinstance(value, meta.Partitioned):
    # The box's names describe ``shape``, not the flat value: constraining
    # the flat value to them fails in a mesh context (as it does in Linen).
    flat = value.unbox(apply_constraint=False)
    return value.replace_boxed(jnp.reshape(flat, shape))
  if isinstance(value, meta.AxisMetadata):
    return value.replace_boxed(jnp.reshape(value.unbox(), shape))
  return jnp.reshape(value, shape)


def _add_bias(y, bias, shape):
  y += explicit.match(jnp.reshape(bias, shape), y)
  return y


# -- dense layers --------------------------------------------------------------


class DenseGeneral(Module):
  """A linear map contracting any input axes, optionally batched.

  ``features`` (int or tuple) gives the output axes, ``axis`` the contracted
  input axes and ``batch_dims`` leading input axes that get a kernel of
  their own. The kernel has shape ``batch + contracted + features`` and the
  bias ``batch + features``; both are initialized as 2-D/1-D arrays and
  reshaped, so fan-in/fan-out count all contracted and all feature axes.

  Attributes:
    features: the output feature size: an int, or a tuple for several output
      axes.
    axis: the input axis or axes contracted with the kernel.
    batch_dims: leading input axes (0, 1, ...) that get a kernel of their own.
    use_bias: whether to add a learned bias.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    precision: precision of the matrix products (a ``jax.lax.Precision``, a
      string, or a pair of them), passed to the op.
    promote_dtype: casts the inputs and parameters to one dtype (``dtype``)
      before computing; replace it to change that casting.
    dot_general: the dot-product op used instead of ``lax.dot_general``.
    dot_general_cls: a class whose instance (made with no arguments at each
      call) is the dot-product op; wins over ``dot_general``.

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers import linear as nn
  >>> layer = nn.DenseGeneral(features=(2, 3), axis=(-2, -1))
  >>> out, variables = layer.init_with_output(jax.random.key(0),
  ...                                         jnp.ones((4, 5, 6)))
  >>> out.shape, variables['params']['kernel'].shape
  ((4, 2, 3), (5, 6, 2, 3))
  """

  features: int | Sequence[int]
  axis: int | Sequence[int] = -1
  batch_dims: Sequence[int] = ()
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = initializers.zeros_init()
  precision: PrecisionLike = None
  promote_dtype: PromoteDtypeFn = promote_dtype
  dot_general: DotGeneralT | None = None
  dot_general_cls: Any = None

  @nowrap
  def _checked_axes(self, ndim: int):
    """(contracted axes, batch axes), sorted and non-negative."""
    batch_dims = _as_tuple(self.batch_dims)
    leading = set(range(int(np.max(batch_dims)) + 1)) if batch_dims else set()
    if set(batch_dims) != leading:
      raise ValueError(
          f'batch_dims {batch_dims} must be consecutive leading dimensions '
          f'starting from 0. ({_where(self)}: batch_dims are the leading '
          'input axes 0, 1, ..., n-1.)')
    axis = _as_tuple(self.axis)
    for ax in axis + batch_dims:
      if not -ndim <= ax < ndim:
        raise _AxisError(
            ax, ndim, msg_prefix=f'{_where(self)}: axis/batch_dims')
    axis = tuple(sorted(ax % ndim for ax in axis))
    batch_dims = tuple(sorted(ax % ndim for ax in batch_dims))
    if len(set(axis)) != len(axis) or set(axis) & set(batch_dims):
      raise ValueError(
          f'{_where(self)}: axis {self.axis} must name distinct input axes '
          f'that are not batch_dims {self.batch_dims} (input rank {ndim}).')
    return axis, batch_dims

  @compact
  def __call__(self, inputs: Array, *, out_sharding=None) -> Array:
    """Contracts ``axis`` of ``inputs`` with the kernel.

    Args:
      inputs: the input array.
      out_sharding: the output's sharding on a mesh with Explicit axes (a
        ``PartitionSpec`` or ``NamedSharding``); None lays it out by the
        rule of ``liftmods.core.explicit`` (the batch as ``inputs``, the
        features as the kernel).
    """
    features = _as_tuple(self.features)
    axis, batch_dims = self._checked_axes(inputs.ndim)
    n_batch, n_axis, n_feat = len(batch_dims), len(axis), len(features)
    batch_shape = tuple(inputs.shape[ax] for ax in batch_dims)

    def kernel_init(rng, shape, dtype=jnp.float32):
      rows = math.prod(shape[:n_batch]) * math.prod(
          shape[n_batch:n_batch + n_axis])
      flat = (int(rows), int(math.prod(shape[-n_feat:])))
      return _flat_init(self.kernel_init, rng, shape, flat, dtype)

    def bias_init(rng, shape, dtype=jnp.float32):
      flat = (int(math.prod(shape[:n_batch]) * math.prod(shape[-n_feat:])),)
      return _flat_init(self.bias_init, rng, shape, flat, dtype)

    kernel_shape = batch_shape + tuple(inputs.shape[ax] for ax in axis)
    kernel = self.param('kernel', kernel_init, kernel_shape + features,
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param('bias', bias_init, batch_shape + features,
                        self.param_dtype)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias,
                                              dtype=self.dtype)
    dot_general = _pick_fn(self.dot_general_cls, self.dot_general,
                           lax.dot_general)
    kernel_batch = tuple(range(n_batch))
    kernel_contract = tuple(range(n_batch, n_batch + n_axis))
    y = explicit.dot_general(
        self, inputs, kernel,
        ((axis, kernel_contract), (batch_dims, kernel_batch)),
        op=dot_general, out_sharding=out_sharding, precision=self.precision)
    if self.use_bias:
      free = tuple(inputs.shape[ax] if ax in batch_dims else 1
                   for ax in range(inputs.ndim) if ax not in axis)
      y = _add_bias(y, bias, free + features)
    return y


class Dense(Module):
  """A linear map over the last input axis: ``y = x @ kernel + bias``.

  Attributes:
    features: number of output features.
    use_bias: whether to add a learned bias.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    precision: precision of the matrix products (a ``jax.lax.Precision``, a
      string, or a pair of them), passed to the op.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    promote_dtype: casts the inputs and parameters to one dtype (``dtype``)
      before computing; replace it to change that casting.
    dot_general: the dot-product op used instead of ``lax.dot_general``.
    dot_general_cls: a class whose instance (made with no arguments at each
      call) is the dot-product op; wins over ``dot_general``.

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers import linear as nn
  >>> layer = nn.Dense(features=4, use_bias=False)
  >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
  >>> jax.tree_util.tree_map(jnp.shape, variables)
  {'params': {'kernel': (3, 4)}}
  """

  features: int
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = initializers.zeros_init()
  promote_dtype: PromoteDtypeFn = promote_dtype
  dot_general: DotGeneralT | None = None
  dot_general_cls: Any = None

  @compact
  def __call__(self, inputs: Array, *, out_sharding=None) -> Array:
    """Applies the map to the last axis of ``inputs``.

    Args:
      inputs: the input array.
      out_sharding: the output's sharding on a mesh with Explicit axes (a
        ``PartitionSpec`` or ``NamedSharding``); None lays it out by the
        rule of ``liftmods.core.explicit`` (the batch as ``inputs``, the
        features as the kernel).
    """
    kernel = self.param('kernel', self.kernel_init,
                        (jnp.shape(inputs)[-1], self.features),
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param('bias', self.bias_init, (self.features,),
                        self.param_dtype)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias,
                                              dtype=self.dtype)
    dot_general = _pick_fn(self.dot_general_cls, self.dot_general,
                           lax.dot_general)
    y = explicit.dot_general(
        self, inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
        op=dot_general, out_sharding=out_sharding, precision=self.precision)
    if bias is not None:
      y = _add_bias(y, bias, (1,) * (y.ndim - 1) + (-1,))
    return y


# -- einsum --------------------------------------------------------------------


def _einsum_terms(where: str, sub: str, ndim: int) -> list:
  """The axis labels of one operand; the axes an ellipsis stands for are
  labelled ``('...', k)`` with ``k`` counted from the right, so that they
  line up across operands the way broadcasting does."""
  if '.' not in sub:
    return list(sub)
  if sub.count('.') != 3 or '...' not in sub:
    raise ValueError(f'{where}: malformed ellipsis in einsum operand "{sub}".')
  count = ndim - (len(sub) - 3) if ndim else 0
  if count < 0:
    raise ValueError(f'{where}: einsum operand "{sub}" names more axes than '
                     f'the array has ({ndim}).')
  head, tail = sub.split('...')
  return list(head) + [('...', count - i) for i in range(count)] + list(tail)


def _einsum_bias_shapes(where, einsum_str, lhs_ndim, kernel_ndim, shape):
  """(bias shape, bias shape broadcast against the output): one bias entry
  per kernel axis that survives into the output."""
  operands, result = einsum_str.split('->')
  lhs, rhs = operands.split(',')
  lhs_terms = _einsum_terms(where, lhs, lhs_ndim)
  rhs_terms = _einsum_terms(where, rhs, kernel_ndim)
  longest = max([t[1] for t in lhs_terms + rhs_terms if isinstance(t, tuple)],
                default=0)
  out_terms = _einsum_terms(where, result, longest + len(result) - 3)
  kernel_axis = {t: i for i, t in enumerate(rhs_terms)}
  if len(kernel_axis) != len(shape):
    raise ValueError(
        f'{where}: the kernel subscripts "{rhs}" must name each of the '
        f'{len(shape)} axes of kernel shape {tuple(shape)} exactly once.')
  kept = [shape[kernel_axis[t]] if t in kernel_axis else None
          for t in out_terms]
  bias_shape = [n for n in kept if n is not None]
  return bias_shape, [1 if n is None else n for n in kept]


class Einsum(Module):
  """``jnp.einsum(einsum_str, inputs, kernel)`` plus an optional bias.

  ``shape`` is the kernel shape. The equation has exactly two operands
  (input, kernel) and an explicit ``->``; it is given either here or at call
  time, not both. The bias has one axis per kernel axis that appears in the
  output.

  Attributes:
    shape: the shape of the kernel.
    einsum_str: the equation, e.g. ``'nc,cd->nd'`` (input, kernel); here or at
      call time, not both.
    use_bias: whether to add a learned bias.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    precision: precision of the matrix products (a ``jax.lax.Precision``, a
      string, or a pair of them), passed to the op.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    promote_dtype: casts the inputs and parameters to one dtype (``dtype``)
      before computing; replace it to change that casting.
    preferred_element_type: the accumulation and result dtype passed to the
      einsum (None: the default).

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers import linear as nn
  >>> layer = nn.Einsum((3, 4, 5), 'nc,cde->nde')
  >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
  >>> jax.tree_util.tree_map(jnp.shape, variables)
  {'params': {'bias': (4, 5), 'kernel': (3, 4, 5)}}
  """

  shape: Sequence[int]
  einsum_str: str | None = None
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = initializers.zeros_init()
  promote_dtype: PromoteDtypeFn = promote_dtype
  preferred_element_type: Dtype | None = None

  @nowrap
  def _equation(self, einsum_str):
    einsum_str = merge_param('einsum_str', self.einsum_str, einsum_str)
    einsum_str = einsum_str.replace(' ', '')
    if '->' not in einsum_str:
      raise ValueError('`einsum_str` equation must be explicit and include '
                       f'"->". ({_where(self)}: got "{einsum_str}"; write '
                       'the output subscripts after "->".)')
    if einsum_str.count(',') != 1:
      raise ValueError(
          '`einsum_str` equation must have exactly two operands and '
          'therefore, exactly one comma character, instead of '
          f'{einsum_str.count(",")} ({_where(self)}: got "{einsum_str}"; the '
          'operands are the input and the kernel.)')
    return einsum_str

  @compact
  def __call__(self, inputs: Array, einsum_str: str | None = None,
               *, out_sharding=None) -> Array:
    """Contracts ``inputs`` with the kernel as ``einsum_str`` says.

    Args:
      inputs: the input array.
      einsum_str: the equation, if not given as a field.
      out_sharding: the output's sharding on a mesh with Explicit axes (a
        ``PartitionSpec`` or ``NamedSharding``); None lays it out by the
        rule of ``liftmods.core.explicit``.
    """
    einsum_str = self._equation(einsum_str)
    kernel = self.param('kernel', self.kernel_init, self.shape,
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias_shape, broadcast_shape = self._get_bias_shape(einsum_str, inputs,
                                                         kernel)
      bias = self.param('bias', self.bias_init, bias_shape, self.param_dtype)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias,
                                              dtype=self.dtype)
    y = explicit.einsum(self, einsum_str, inputs, kernel,
                        out_sharding=out_sharding, precision=self.precision,
                        preferred_element_type=self.preferred_element_type)
    if bias is not None:
      y = _add_bias(y, bias, broadcast_shape)
    return y

  def _get_bias_shape(self, einsum_str: str, lhs: Array, rhs: Array):
    """(bias shape, bias shape broadcast against the output)."""
    return _einsum_bias_shapes(_where(self), einsum_str, jnp.ndim(lhs),
                               jnp.ndim(rhs), self.shape)


# -- convolutions --------------------------------------------------------------


def canonicalize_padding(padding: PaddingLike, rank: int) -> Any:
  """Turns a padding spec into what ``jax.lax`` convolutions accept.

  Args:
    padding: a string, an int, or one int or ``(low, high)`` pair per
      spatial axis.
    rank: the number of spatial axes.

  Returns:
    The string, or a list of ``(low, high)`` pairs.

  Raises:
    ValueError: ``padding`` has another form.

  Strings pass through, an int ``p`` means ``(p, p)`` on every one of the
  ``rank`` spatial axes, and a length-``rank`` sequence may mix ints and
  ``(low, high)`` tuples.

  >>> canonicalize_padding(1, 2)
  [(1, 1), (1, 1)]
  >>> canonicalize_padding([2, (0, 1)], 2)
  [(2, 2), (0, 1)]
  """
  if isinstance(padding, str):
    return padding
  if isinstance(padding, int):
    return [(padding, padding)] * rank
  if isinstance(padding, Sequence) and len(padding) == rank:
    pairs = [(p, p) if isinstance(p, int) else p for p in padding]
    if all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
      return pairs
  raise ValueError(
      f'Invalid padding format: {padding}, should be str, int, or a sequence '
      f'of len {rank} where each element is an int or pair of ints.')


def _conv_dimension_numbers(input_shape):
  """Channels-last input/output, ``spatial + (in, out)`` kernel."""
  ndim = len(input_shape)
  lhs = (0, ndim - 1) + tuple(range(1, ndim - 1))
  rhs = (ndim - 1, ndim - 2) + tuple(range(ndim - 2))
  return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def _kernel_size(module) -> tuple:
  size = module.kernel_size
  if not isinstance(size, Iterable) or isinstance(size, str):
    size = (size,)
  try:
    return tuple(operator.index(k) for k in size)
  except TypeError:
    raise TypeError(f'{_where(module)}: kernel_size must be an int or a '
                    f'sequence of ints, got {module.kernel_size!r}.') from None


def _per_axis(module, field: str, rank: int) -> tuple:
  """``module.<field>`` (None, an int, or one int per spatial axis) as a
  ``rank``-tuple; None means 1."""
  value = getattr(module, field)
  if value is None:
    value = 1
  if isinstance(value, numbers.Integral):
    return (value,) * rank
  value = tuple(value)
  if len(value) != rank:
    raise ValueError(f'{_where(module)}: {field}={value} must be an int or '
                     f'have one entry per spatial axis ({rank}).')
  return value


def _flatten_batch(module, inputs, rank: int):
  """Folds all batch axes into one leading axis (adding it when absent);
  returns the flat inputs and the batch shape to restore, or None."""
  n_batch = inputs.ndim - (rank + 1)
  if n_batch < 0:
    raise ValueError(
        f'{_where(module)}: inputs of shape {inputs.shape} are too small for '
        f'a {rank}-D convolution; expected (*batch, {rank} spatial axes, '
        'features).')
  if n_batch == 1:
    return inputs, None
  batch_shape = inputs.shape[:n_batch]
  return jnp.reshape(inputs, (-1,) + inputs.shape[n_batch:]), batch_shape


def _unflatten_batch(y, batch_shape):
  if batch_shape is None:
    return y
  return jnp.reshape(y, batch_shape + y.shape[1:])


def _padding(module, rank: int):
  try:
    return canonicalize_padding(module.padding, rank)
  except ValueError as e:
    raise ValueError(f'{e} ({_where(module)})') from None


def _pad_inputs(module, inputs, padding, kernel_size, kernel_dilation):
  """Applies the paddings lax does not know (CIRCULAR, REFLECT, CAUSAL)
  to ``inputs``; returns the inputs and the padding left for lax."""
  if padding in ('CIRCULAR', 'REFLECT'):
    spans = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
    pads = [(0, 0)] + [((s - 1) // 2, s // 2) for s in spans] + [(0, 0)]
    mode = 'wrap' if padding == 'CIRCULAR' else 'reflect'
    return jnp.pad(inputs, pads, mode=mode), 'VALID'
  if padding == 'CAUSAL':
    if len(kernel_size) != 1:
      raise ValueError('Causal padding is only implemented for 1D '
                       f'convolutions. ({_where(module)}: got kernel_size '
                       f'{kernel_size}.)')
    left = kernel_dilation[0] * (kernel_size[0] - 1)
    return jnp.pad(inputs, [(0, 0), (left, 0), (0, 0)]), 'VALID'
  return inputs, padding


def _check_mask(module, kernel_shape):
  mask = module.mask
  if mask is not None and mask.shape != kernel_shape:
    raise ValueError('Mask needs to have the same shape as weights. Shapes '
                     f'are: {mask.shape}, {kernel_shape} ({_where(module)})')


class _Conv(Module):
  """Shared code of :class:`Conv` (one kernel for all positions) and
  :class:`ConvLocal` (one kernel per output position)."""

  features: int
  kernel_size: int | Sequence[int]
  strides: None | int | Sequence[int] = 1
  padding: PaddingLike = 'SAME'
  input_dilation: None | int | Sequence[int] = 1
  kernel_dilation: None | int | Sequence[int] = 1
  feature_group_count: int = 1
  use_bias: bool = True
  mask: Array | None = None
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = initializers.zeros_init()
  promote_dtype: PromoteDtypeFn = promote_dtype
  conv_general_dilated: ConvGeneralDilatedT | None = None
  conv_general_dilated_cls: Any = None

  @property
  def shared_weights(self) -> bool:
    """True for an ordinary convolution, False for a locally connected one."""
    raise NotImplementedError(f'{type(self).__name__}.shared_weights')

  @nowrap
  def _conv_fn(self):
    return _pick_fn(self.conv_general_dilated_cls, self.conv_general_dilated,
                    lax.conv_general_dilated)

  @nowrap
  def _local_output_shape(self, inputs, kernel_size, windows):
    if self.feature_group_count != 1:
      raise NotImplementedError(
          f'{_where(self)}: a local convolution supports only '
          f'feature_group_count=1, got {self.feature_group_count}.')
    strides, padding, input_dilation, kernel_dilation, dims = windows
    conv = self._conv_fn()
    rhs = jax.ShapeDtypeStruct(kernel_size + (inputs.shape[-1], self.features),
                               inputs.dtype)
    return jax.eval_shape(
        lambda lhs, rhs: conv(lhs=lhs, rhs=rhs, window_strides=strides,
                              padding=padding, dimension_numbers=dims,
                              lhs_dilation=input_dilation,
                              rhs_dilation=kernel_dilation),
        inputs, rhs).shape

  @nowrap
  def _kernel_shape(self, inputs, kernel_size, windows):
    """(kernel shape, local output shape or None)."""
    in_features = inputs.shape[-1]
    if not self.shared_weights:
      out_shape = self._local_output_shape(inputs, kernel_size, windows)
      flat_in = math.prod(kernel_size) * in_features
      return out_shape[1:-1] + (flat_in, self.features), out_shape
    if in_features % self.feature_group_count:
      raise ValueError(
          f'{_where(self)}: input features ({in_features}) must be divisible '
          f'by feature_group_count ({self.feature_group_count}).')
    group_in = in_features // self.feature_group_count
    return kernel_size + (group_in, self.features), None

  @nowrap
  def _convolve(self, inputs, kernel, kernel_size, windows, out_sharding):
    strides, padding, input_dilation, kernel_dilation, dims = windows
    if self.shared_weights:
      conv = functools.partial(
          self._conv_fn(), window_strides=strides, padding=padding,
          lhs_dilation=input_dilation, rhs_dilation=kernel_dilation,
          dimension_numbers=dims,
          feature_group_count=self.feature_group_count,
          precision=self.precision)
    else:
      conv = functools.partial(
          lax.conv_general_dilated_local, window_strides=strides,
          padding=padding, filter_shape=kernel_size,
          lhs_dilation=input_dilation, rhs_dilation=kernel_dilation,
          dimension_numbers=dims, precision=self.precision)
    return explicit.conv(self, conv, inputs, kernel, out_sharding)

  @compact
  def __call__(self, inputs: Array, *, out_sharding=None) -> Array:
    """Convolves channels-last ``inputs`` of shape ``(*batch, *spatial,
    features)``; any number of batch axes (including none) is accepted.

    Args:
      inputs: the input array.
      out_sharding: the output's sharding (of the flattened batch) on a
        mesh with Explicit axes; None lays it out by the rule of
        ``liftmods.core.explicit``.
    """
    kernel_size = _kernel_size(self)
    rank = len(kernel_size)
    inputs, batch_shape = _flatten_batch(self, inputs, rank)
    strides = _per_axis(self, 'strides', rank)
    input_dilation = _per_axis(self, 'input_dilation', rank)
    kernel_dilation = _per_axis(self, 'kernel_dilation', rank)
    inputs, padding = _pad_inputs(self, inputs, _padding(self, rank),
                                  kernel_size, kernel_dilation)
    windows = (strides, padding, input_dilation, kernel_dilation,
               _conv_dimension_numbers(inputs.shape))
    kernel_shape, out_shape = self._kernel_shape(inputs, kernel_size, windows)
    _check_mask(self, kernel_shape)
    kernel = self.param('kernel', self.kernel_init, kernel_shape,
                        self.param_dtype)
    if self.mask is not None:
      kernel *= self.mask
    bias = None
    if self.use_bias:
      bias_shape = (self.features,) if out_shape is None else out_shape[1:]
      bias = self.param('bias', self.bias_init, bias_shape, self.param_dtype)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias,
                                              dtype=self.dtype)
    y = self._convolve(inputs, kernel, kernel_size, windows, out_sharding)
    if bias is not None:
      y = _add_bias(y, bias, (1,) * (y.ndim - bias.ndim) + bias.shape)
    return _unflatten_batch(y, batch_shape)


class Conv(_Conv):
  """A convolution (``lax.conv_general_dilated``) with channels-last inputs.

  ``padding`` is ``'SAME'``, ``'VALID'``, ``'CIRCULAR'`` (wrap around),
  ``'REFLECT'``, ``'CAUSAL'`` (1-D only: left padding, same length out), an
  int, or one int / ``(low, high)`` pair per spatial axis. The kernel has
  shape ``kernel_size + (in_features // feature_group_count, features)``.

  Attributes:
    features: number of output channels.
    kernel_size: the window size: an int, or one int per spatial axis.
    strides: the window step: an int, or one per spatial axis (None: 1).
    padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``,
      ``'CAUSAL'``, an int, or one int or ``(low, high)`` pair per spatial
      axis.
    input_dilation: dilation of the input (``lhs_dilation``): an int, or one
      per spatial axis.
    kernel_dilation: dilation of the kernel (atrous convolution): an int, or
      one per spatial axis.
    feature_group_count: number of groups the input channels are split into
      (grouped or depthwise convolution).
    use_bias: whether to add a learned bias.
    mask: an array shaped like the kernel that multiplies it (e.g. zeros for
      masked connections).
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    precision: precision of the matrix products (a ``jax.lax.Precision``, a
      string, or a pair of them), passed to the op.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    promote_dtype: casts the inputs and parameters to one dtype (``dtype``)
      before computing; replace it to change that casting.
    conv_general_dilated: the convolution op used instead of the ``lax`` one.
    conv_general_dilated_cls: a class whose instance (made with no arguments at
      each call) is the convolution op; wins over ``conv_general_dilated``.

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers import linear as nn
  >>> layer = nn.Conv(features=4, kernel_size=(3,), strides=2)
  >>> out, variables = layer.init_with_output(jax.random.key(0),
  ...                                         jnp.ones((1, 8, 2)))
  >>> out.shape, variables['params']['kernel'].shape
  ((1, 4, 4), (3, 2, 4))
  """

  @property
  def shared_weights(self) -> bool:
    return True


class ConvLocal(_Conv):
  """A locally connected layer (``lax.conv_general_dilated_local``): like
  :class:`Conv`, but with separate weights and bias for every output
  position.

  Attributes:
    features: number of output channels.
    kernel_size: the window size: an int, or one int per spatial axis.
    strides: the window step: an int, or one per spatial axis (None: 1).
    padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, ``'REFLECT'``,
      ``'CAUSAL'``, an int, or one int or ``(low, high)`` pair per spatial
      axis.
    input_dilation: dilation of the input (``lhs_dilation``): an int, or one
      per spatial axis.
    kernel_dilation: dilation of the kernel (atrous convolution): an int, or
      one per spatial axis.
    feature_group_count: number of groups the input channels are split into
      (grouped or depthwise convolution).
    use_bias: whether to add a learned bias.
    mask: an array shaped like the kernel that multiplies it (e.g. zeros for
      masked connections).
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    precision: precision of the matrix products (a ``jax.lax.Precision``, a
      string, or a pair of them), passed to the op.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    promote_dtype: casts the inputs and parameters to one dtype (``dtype``)
      before computing; replace it to change that casting.
    conv_general_dilated: the convolution op used instead of the ``lax`` one.
    conv_general_dilated_cls: a class whose instance (made with no arguments at
      each call) is the convolution op; wins over ``conv_general_dilated``.

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers import linear as nn
  >>> layer = nn.ConvLocal(features=4, kernel_size=(3,), padding='VALID')
  >>> variables = layer.init(jax.random.key(0), jnp.ones((1, 8, 2)))
  >>> jax.tree_util.tree_map(jnp.shape, variables)
  {'params': {'bias': (6, 4), 'kernel': (6, 6, 4)}}
  """

  @property
  def shared_weights(self) -> bool:
    return False


def _circular_fold(y, in_spatial, strides, transpose_kernel):
  """Wraps the transposed-convolution output periodically so that each
  spatial axis has length ``input length * stride``."""
  periods = [n * s for n, s in zip(in_spatial, strides)]
  extra = [-(n - p) % (2 * p) for n, p in zip(y.shape[1:-1], periods)]
  if transpose_kernel:
    pads = [(e // 2, (e + 1) // 2) for e in extra]
  else:
    pads = [((e + 1) // 2, e // 2) for e in extra]
  y = jnp.pad(y, [(0, 0)] + pads + [(0, 0)])
  for axis, period in enumerate(periods, start=1):
    y = y.reshape(y.shape[:axis] + (-1, period) + y.shape[axis + 1:])
    y = y.sum(axis=axis)
  return y


class ConvTranspose(Module):
  """A transposed convolution (``lax.conv_transpose``), channels-last.

  The kernel has shape ``kernel_size + (in_features, features)``, or
  ``kernel_size + (features, in_features)`` with ``transpose_kernel=True``
  (which also flips the spatial axes, giving the gradient of a
  :class:`Conv` with the same kernel). ``'CIRCULAR'`` padding wraps the
  output to ``input length * stride`` per axis.

  Attributes:
    features: number of output channels.
    kernel_size: the window size: an int, or one int per spatial axis.
    strides: the step of the transposed window (output upsampling), one per
      spatial axis (None: 1).
    padding: ``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, an int, or one int or
      ``(low, high)`` pair per spatial axis.
    kernel_dilation: dilation of the kernel, one per spatial axis (None: 1).
    use_bias: whether to add a learned bias.
    mask: an array shaped like the kernel that multiplies it.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    precision: precision of the matrix products (a ``jax.lax.Precision``, a
      string, or a pair of them), passed to the op.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    transpose_kernel: flip the spatial axes and swap the channel axes of the
      kernel, giving the gradient of a ``Conv``.
    promote_dtype: casts the inputs and parameters to one dtype (``dtype``)
      before computing; replace it to change that casting.
    preferred_element_type: the accumulation and result dtype passed to
      ``lax.conv_transpose``.

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers import linear as nn
  >>> layer = nn.ConvTranspose(features=2, kernel_size=(3,), strides=(2,))
  >>> out, variables = layer.init_with_output(jax.random.key(0),
  ...                                         jnp.ones((1, 5, 3)))
  >>> out.shape, variables['params']['kernel'].shape
  ((1, 10, 2), (3, 3, 2))
  """

  features: int
  kernel_size: int | Sequence[int]
  strides: Sequence[int] | None = None
  padding: PaddingLike = 'SAME'
  kernel_dilation: Sequence[int] | None = None
  use_bias: bool = True
  mask: Array | None = None
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = initializers.zeros_init()
  transpose_kernel: bool = False
  promote_dtype: PromoteDtypeFn = promote_dtype
  preferred_element_type: Dtype | None = None

  @compact
  def __call__(self, inputs: Array, *, out_sharding=None) -> Array:
    """Applies the transposed convolution to ``(*batch, *spatial,
    features)`` inputs; any number of batch axes (including none).

    Args:
      inputs: the input array.
      out_sharding: the output's sharding (of the flattened batch) on a
        mesh with Explicit axes; None lays it out by the rule of
        ``liftmods.core.explicit``.
    """
    kernel_size = _kernel_size(self)
    rank = len(kernel_size)
    inputs, batch_shape = _flatten_batch(self, inputs, rank)
    strides = _per_axis(self, 'strides', rank)
    kernel_dilation = _per_axis(self, 'kernel_dilation', rank)
    channels = (inputs.shape[-1], self.features)
    if self.transpose_kernel:
      channels = channels[::-1]
    _check_mask(self, kernel_size + channels)
    kernel = self.param('kernel', self.kernel_init, kernel_size + channels,
                        self.param_dtype)
    if self.mask is not None:
      kernel *= self.mask
    padding = _padding(self, rank)
    if padding == 'CIRCULAR':
      padding = 'VALID'
    bias = None
    if self.use_bias:
      bias = self.param('bias', self.bias_init, (self.features,),
                        self.param_dtype)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias,
                                              dtype=self.dtype)
    conv = functools.partial(
        lax.conv_transpose, strides=strides, padding=padding,
        rhs_dilation=kernel_dilation, transpose_kernel=self.transpose_kernel,
        precision=self.precision,
        preferred_element_type=self.preferred_element_type)
    y = explicit.conv(self, conv, inputs, kernel, out_sharding)
    if self.padding == 'CIRCULAR':
      y = _circular_fold(y, inputs.shape[1:-1], strides,
                         self.transpose_kernel)
    if bias is not None:
      y = _add_bias(y, bias, (1,) * (y.ndim - 1) + (-1,))
    return _unflatten_batch(y, batch_shape)


# -- embeddings ----------------------------------------------------------------


class Embed(Module):
  """A table of ``num_embeddings`` vectors of size ``features``, looked up
  by integer index.

  Calling it maps integer inputs of any shape to ``shape + (features,)``
  (out-of-range indices give NaN; negative ones count from the end).
  ``attend(query)`` scores queries against every row, e.g. to tie input
  embeddings and output logits.

  Attributes:
    num_embeddings: number of rows of the table (the index range).
    features: size of each embedding vector.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    embedding_init: initializer of the table.
    promote_dtype: casts the inputs and parameters to one dtype (``dtype``)
      before computing; replace it to change that casting.

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers import linear as nn
  >>> layer = nn.Embed(num_embeddings=5, features=3)
  >>> variables = layer.init(jax.random.key(0), jnp.array([[0, 4]]))
  >>> layer.apply(variables, jnp.array([[0, 4]])).shape
  (1, 2, 3)
  >>> layer.apply(variables, jnp.ones((2, 3)), method=layer.attend).shape
  (2, 5)
  """

  num_embeddings: int
  features: int
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  embedding_init: Initializer = default_embed_init
  promote_dtype: PromoteDtypeFn = promote_dtype

  def setup(self):
    self.embedding = self.param('embedding', self.embedding_init,
                                (self.num_embeddings, self.features),
                                self.param_dtype)

  def __call__(self, inputs: Array, *, out_sharding=None) -> Array:
    """Returns the embedding rows picked by the integer ``inputs``.

    Args:
      inputs: integer indices, any shape.
      out_sharding: the output's sharding on a mesh with Explicit axes;
        None lays it out by the rule of ``liftmods.core.explicit`` (the
        indices' dimensions as ``inputs``, the features as the table).
    """
    dtype = getattr(inputs, 'dtype', None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
      raise ValueError(
          'Input type must be an integer or unsigned integer. '
          f'({_where(self)}: got '
          f'{dtype if dtype is not None else type(inputs)}.)')
    (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype,
                                      inexact=False)
    if self.num_embeddings == 1:
      return jnp.broadcast_to(embedding, inputs.shape + (self.features,))
    return explicit.take(self, embedding, inputs, out_sharding)

  def attend(self, query: Array, *, out_sharding=None) -> Array:
    """Inner products of ``query`` (last axis ``features``) with every
    embedding row; the output's last axis has size ``num_embeddings``.

    Args:
      query: the queries, last axis ``features``.
      out_sharding: the output's sharding on a mesh with Explicit axes;
        None lays it out by the rule of ``liftmods.core.explicit``.
    """
    query, embedding = self.promote_dtype(query, self.embedding,
                                          dtype=self.dtype)
    if explicit.explicit_mesh(query, embedding) is None:
      return jnp.dot(query, embedding.T)
    return explicit.dot_general(
        self, query, embedding.T, (((query.ndim - 1,), (0,)), ((), ())),
        out_sharding=out_sharding)
