"""Normalization layers: LayerNorm, RMSNorm, BatchNorm, GroupNorm, InstanceNorm.

Every layer computes statistics (mean and variance, in at least float32 unless
``force_float32_reductions=False``) over its *reduction axes*, normalizes with
them, then applies a learned ``scale`` and ``bias`` shaped like the *feature
axes*. The layers differ only in which axes they reduce. Argument names,
defaults, variable names and the arithmetic are Flax Linen's, so the same key
gives the same parameters and the same outputs.

>>> import jax, jax.numpy as jnp
>>> from liftmods.layers.normalization import LayerNorm
>>> x = jnp.arange(6.0).reshape(2, 3)
>>> variables = LayerNorm().init(jax.random.key(0), x)
>>> jax.tree_util.tree_map(jnp.shape, variables)
{'params': {'bias': (3,), 'scale': (3,)}}
>>> LayerNorm().apply(variables, x).round(3)
Array([[-1.225,  0.   ,  1.225],
       [-1.225,  0.   ,  1.225]], dtype=float32)
"""
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from liftmods import dtypes, initializers
from liftmods.core import explicit
from liftmods.module import Module, compact, merge_param, nowrap

Array = Any
Dtype = Any
Axes = int | Sequence[int]
Initializer = Callable[..., Any]


def _where(mdl: Module) -> str:
  """``'BatchNorm at /Block_0/BatchNorm_0'``: names a module in messages."""
  return f'{type(mdl).__name__} at {mdl.scope.path_text}'


# -- statistics ----------------------------------------------------------------


def canonicalize_axes(rank: int, axes: Axes) -> tuple[int, ...]:
  """Non-negative, de-duplicated axes.

  The tuple is built from a set, which is the order Linen uses; it decides
  the order of the dimensions of ``scale``/``bias`` for unusual axes.

  Args:
    rank: the array's number of dimensions.
    axes: an axis or axes, negative ones counting from the end.

  Returns:
    The axes.
  """
  if not isinstance(axes, Iterable):
    axes = (axes,)
  return tuple(set(a + rank if a < 0 else a for a in axes))


def _abs_sq(x):
  """``|x| ** 2`` elementwise, without a square root for complex ``x``."""
  if jnp.iscomplexobj(x):
    return lax.square(lax.real(x)) + lax.square(lax.imag(x))
  return lax.square(x)


def _stats_dtype(x, dtype, force_float32_reductions):
  dtype = jnp.result_type(x) if dtype is None else dtype
  if force_float32_reductions:
    dtype = jnp.promote_types(dtype, jnp.float32)
  return dtype


def _means(xs, axes, mask, axis_name, axis_index_groups):
  """Means of each of ``xs`` over ``axes`` (where ``mask``), averaged over
  the named axis ``axis_name`` with a single ``pmean`` when one is given."""
  where = None if mask is None else jnp.asarray(mask, dtype=bool)
  mus = tuple(v.mean(axes, where=where) for v in xs)
  if axis_name is None:
    return mus
  if len(mus) == 1:
    return (lax.pmean(mus[0], axis_name, axis_index_groups=axis_index_groups),)
  stacked = lax.pmean(jnp.stack(mus, axis=0), axis_name,
                      axis_index_groups=axis_index_groups)
  return tuple(stacked[i] for i in range(len(mus)))


def _compute_stats(x: Array, axes: Axes, dtype: Dtype | None,
                   axis_name: str | None = None, axis_index_groups: Any = None,
                   use_mean: bool = True, use_fast_variance: bool = True,
                   mask: Array | None = None,
                   force_float32_reductions: bool = True):
  """``(mean, var)`` of ``x`` over ``axes``.

  With ``use_fast_variance`` the variance is ``E[|x|^2] - |E[x]|^2`` (clipped
  at 0), otherwise ``E[|x - E[x]|^2]``. With ``use_mean=False`` the mean is
  zero and the "variance" is the mean square (RMSNorm).
  """
  dtype = _stats_dtype(x, dtype, force_float32_reductions)
  x = x.astype(dtype) if isinstance(x, jax.Array) else jnp.asarray(x, dtype)
  axes = canonicalize_axes(x.ndim, axes)
  means = lambda *xs: _means(xs, axes, mask, axis_name, axis_index_groups)
  if not use_mean:
    (var,) = means(_abs_sq(x))
    return jnp.zeros_like(var), var
  if use_fast_variance:
    mu, mu2 = means(x, _abs_sq(x))
    return mu, jnp.maximum(0.0, mu2 - _abs_sq(mu))
  (mu,) = means(x)
  (var,) = means(_abs_sq(x - jnp.expand_dims(mu, axes)))
  return mu, var


# -- normalizing and the learned affine map ------------------------------------


def _feature_shapes(x, feature_axes):
  """(broadcastable shape, parameter shape) for ``feature_axes`` of ``x``."""
  broadcast = [1] * x.ndim
  for ax in feature_axes:
    broadcast[ax] = x.shape[ax]
  return broadcast, tuple(x.shape[ax] for ax in feature_axes)


def _affine_param(mdl, name, init_fn, shape, broadcast, param_dtype,
                  force_float32_reductions, x):
  value = mdl.param(name, init_fn, shape, param_dtype).reshape(broadcast)
  if not force_float32_reductions:
    value = jnp.asarray(value, param_dtype)
  return explicit.match(value, x)


def _normalize(mdl: Module, x: Array, mean: Array, var: Array,
               reduction_axes: Axes, feature_axes: Axes, dtype: Dtype | None,
               param_dtype: Dtype, epsilon: float, use_bias: bool,
               use_scale: bool, bias_init: Initializer,
               scale_init: Initializer, force_float32_reductions: bool = True):
  """``(x - mean) / sqrt(var + epsilon) * scale + bias`` in ``dtype``
  (default: inferred from ``x`` and the parameters); ``scale`` and ``bias``
  are parameters of ``mdl`` shaped like ``feature_axes``."""
  reduction_axes = canonicalize_axes(x.ndim, reduction_axes)
  feature_axes = canonicalize_axes(x.ndim, feature_axes)
  broadcast, shape = _feature_shapes(x, feature_axes)
  # Both expanded before use, in Linen's order: the same program, so an
  # executable one library compiled serves the other from the cache.
  mean = explicit.match(jnp.expand_dims(mean, reduction_axes), x)
  var = explicit.match(jnp.expand_dims(var, reduction_axes), x)
  y = x - mean
  mul = lax.rsqrt(var + epsilon)
  used = [x]
  if use_scale:
    scale = _affine_param(mdl, 'scale', scale_init, shape, broadcast,
                          param_dtype, force_float32_reductions, x)
    mul = mul * scale
    used.append(scale)
  y = y * mul
  if use_bias:
    bias = _affine_param(mdl, 'bias', bias_init, shape, broadcast,
                         param_dtype, force_float32_reductions, x)
    y = y + bias
    used.append(bias)
  return jnp.asarray(y, dtypes.canonicalize_dtype(*used, dtype=dtype))


# Public names for the helpers above, which liftmods.normalization also gives
# Linen's private names (_compute_stats, ...) that code such as sbx imports.
abs_sq = _abs_sq
compute_stats = _compute_stats
normalize = _normalize


# -- the layers ----------------------------------------------------------------


class BatchNorm(Module):
  """Batch normalization: statistics over every axis but ``axis``.

  Training (``use_running_average=False``) normalizes with the statistics of
  the batch and, outside ``init``, folds them into the running averages
  ``batch_stats/mean`` and ``batch_stats/var`` (pass
  ``mutable=['batch_stats']``). Evaluation (``use_running_average=True``)
  normalizes with the running averages. ``use_running_average`` is given to
  the constructor or at call time, exactly once. With ``axis_name`` the batch
  statistics are averaged over that named (pmap/vmap/shard_map) axis.

  Attributes:
    use_running_average: normalize with the running averages (evaluation)
      rather than the batch statistics (training); given here or at call time,
      exactly once.
    axis: the feature axis; statistics are computed over all the others.
    momentum: decay of the running averages: ``new = momentum * old + (1 -
      momentum) * batch``.
    epsilon: small number added to the variance before the square root.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    use_bias: whether to add a learned bias.
    use_scale: whether to multiply by a learned ``scale``.
    bias_init: initializer of the bias.
    scale_init: initializer of the scale.
    axis_name: a named axis (pmap, vmap, shard_map) over which the statistics
      are averaged too.
    axis_index_groups: groups of indices along ``axis_name`` to average within
      (as for ``jax.lax.pmean``).
    use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass)
      rather than ``E[(x - E[x])^2]``.
    force_float32_reductions: compute the statistics (and apply scale and bias)
      in at least float32, whatever the input dtype.

  >>> import jax, jax.numpy as jnp
  >>> bn = BatchNorm(momentum=0.9)
  >>> x = jnp.array([[0.0, 2.0], [2.0, 6.0]])
  >>> variables = bn.init(jax.random.key(0), x, use_running_average=False)
  >>> y, updates = bn.apply(variables, x, use_running_average=False,
  ...                       mutable=['batch_stats'])
  >>> updates['batch_stats']['mean']
  Array([0.1, 0.4], dtype=float32)
  >>> bn.apply(variables, x, use_running_average=True).shape
  (2, 2)
  """

  use_running_average: bool | None = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Initializer = initializers.zeros
  scale_init: Initializer = initializers.ones
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True

  @compact
  def __call__(self, x, use_running_average: bool | None = None, *,
               mask: jax.Array | None = None):
    """Normalizes ``x``; ``mask`` (broadcastable to ``x``) selects the
    entries that count towards the batch statistics."""
    use_running_average = self._use_running_average(use_running_average)
    feature_axes = canonicalize_axes(x.ndim, self.axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    ra_mean, ra_var = self._running_averages(
        [x.shape[ax] for ax in feature_axes])
    if use_running_average:
      mean, var = self._stored_stats(ra_mean, ra_var)
    else:
      mean, var = self._batch_stats(x, reduction_axes, mask)
      if not self.is_initializing():
        m = self.momentum
        ra_mean.value = m * ra_mean.value + (1 - m) * mean
        ra_var.value = m * ra_var.value + (1 - m) * var
    return _normalize(self, x, mean, var, reduction_axes, feature_axes,
                      self.dtype, self.param_dtype, self.epsilon,
                      self.use_bias, self.use_scale, self.bias_init,
                      self.scale_init, self.force_float32_reductions)

  @nowrap
  def _use_running_average(self, call_value):
    try:
      return merge_param('use_running_average', self.use_running_average,
                         call_value)
    except ValueError as e:
      raise ValueError(
          f'{e} ({_where(self)}: use True to normalize with the stored '
          'batch_stats (evaluation), False to use and update the batch '
          'statistics (training).)') from None

  @nowrap
  def _stats_dtype(self):
    return jnp.float32 if self.force_float32_reductions else self.param_dtype

  @nowrap
  def _running_averages(self, feature_shape):
    dtype = self._stats_dtype()
    ra_mean = self.variable('batch_stats', 'mean',
                            lambda s: jnp.zeros(s, dtype), feature_shape)
    ra_var = self.variable('batch_stats', 'var',
                           lambda s: jnp.ones(s, dtype), feature_shape)
    return ra_mean, ra_var

  @nowrap
  def _stored_stats(self, ra_mean, ra_var):
    if self.force_float32_reductions:
      return ra_mean.value, ra_var.value
    return (jnp.asarray(ra_mean.value, self.param_dtype),
            jnp.asarray(ra_var.value, self.param_dtype))

  @nowrap
  def _batch_stats(self, x, reduction_axes, mask):
    # During init the named axis need not exist, so no cross-axis mean.
    axis_name = None if self.is_initializing() else self.axis_name
    return _compute_stats(
        x, reduction_axes, dtype=self.dtype, axis_name=axis_name,
        axis_index_groups=self.axis_index_groups,
        use_fast_variance=self.use_fast_variance, mask=mask,
        force_float32_reductions=self.force_float32_reductions)


class LayerNorm(Module):
  """Layer normalization: statistics per example over ``reduction_axes``
  (default: the last axis); ``scale``/``bias`` over ``feature_axes``.

  Attributes:
    epsilon: small number added to the variance before the square root.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    use_bias: whether to add a learned bias.
    use_scale: whether to multiply by a learned ``scale``.
    bias_init: initializer of the bias.
    scale_init: initializer of the scale.
    reduction_axes: the axes the statistics are computed over.
    feature_axes: the axes that ``scale`` and ``bias`` have entries for.
    axis_name: a named axis (pmap, vmap, shard_map) over which the statistics
      are averaged too.
    axis_index_groups: groups of indices along ``axis_name`` to average within
      (as for ``jax.lax.pmean``).
    use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass)
      rather than ``E[(x - E[x])^2]``.
    force_float32_reductions: compute the statistics (and apply scale and bias)
      in at least float32, whatever the input dtype.

  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.key(0), (2, 3, 4))
  >>> ln = LayerNorm(reduction_axes=(1, 2))
  >>> variables = ln.init(jax.random.key(1), x)
  >>> y = ln.apply(variables, x)
  >>> bool(jnp.allclose(y.mean((1, 2)), 0.0, atol=1e-6))
  True
  """

  epsilon: float = 1e-6
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Initializer = initializers.zeros
  scale_init: Initializer = initializers.ones
  reduction_axes: Axes = -1
  feature_axes: Axes = -1
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True

  @compact
  def __call__(self, x, *, mask: jax.Array | None = None):
    """Normalizes ``x``; ``mask`` selects the entries that count."""
    mean, var = _compute_stats(
        x, self.reduction_axes, self.dtype, self.axis_name,
        self.axis_index_groups, use_fast_variance=self.use_fast_variance,
        mask=mask, force_float32_reductions=self.force_float32_reductions)
    return _normalize(self, x, mean, var, self.reduction_axes,
                      self.feature_axes, self.dtype, self.param_dtype,
                      self.epsilon, self.use_bias, self.use_scale,
                      self.bias_init, self.scale_init,
                      self.force_float32_reductions)


class RMSNorm(Module):
  """Root-mean-square normalization: like LayerNorm but without centering
  and without a bias; divides by ``sqrt(mean(x**2) + epsilon)``.

  Attributes:
    epsilon: small number added to the mean square before the square root.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    use_scale: whether to multiply by a learned ``scale``.
    scale_init: initializer of the scale.
    reduction_axes: the axes the statistics are computed over.
    feature_axes: the axes that ``scale`` has entries for.
    axis_name: a named axis (pmap, vmap, shard_map) over which the statistics
      are averaged too.
    axis_index_groups: groups of indices along ``axis_name`` to average within
      (as for ``jax.lax.pmean``).
    use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass)
      rather than ``E[(x - E[x])^2]``.
    force_float32_reductions: compute the statistics (and apply scale and bias)
      in at least float32, whatever the input dtype.

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.array([[1.0, 7.0]])
  >>> variables = RMSNorm().init(jax.random.key(0), x)
  >>> variables
  {'params': {'scale': Array([1., 1.], dtype=float32)}}
  >>> y = RMSNorm().apply(variables, x)  # divides by sqrt(mean(x**2)) = 5
  >>> [round(v, 4) for v in y[0].tolist()]
  [0.2, 1.4]
  """

  epsilon: float = 1e-6
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  use_scale: bool = True
  scale_init: Initializer = initializers.ones
  reduction_axes: Axes = -1
  feature_axes: Axes = -1
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True

  @compact
  def __call__(self, x, *, mask: jax.Array | None = None):
    """Normalizes ``x``; ``mask`` selects the entries that count."""
    mean, var = _compute_stats(
        x, self.reduction_axes, self.dtype, self.axis_name,
        self.axis_index_groups, use_mean=False,
        use_fast_variance=self.use_fast_variance, mask=mask,
        force_float32_reductions=self.force_float32_reductions)
    return _normalize(self, x, mean, var, self.reduction_axes,
                      self.feature_axes, self.dtype, self.param_dtype,
                      self.epsilon, False, self.use_scale, initializers.zeros,
                      self.scale_init, self.force_float32_reductions)


class GroupNorm(Module):
  """Group normalization: the last axis holds the channels, split into
  ``num_groups`` groups (or groups of ``group_size``; set ``num_groups=None``
  then); statistics per example and group over ``reduction_axes`` (default:
  every axis but the first, the batch axis).

  Attributes:
    num_groups: number of groups the channels are split into (None: use
      ``group_size``).
    group_size: number of channels per group; give it with ``num_groups=None``.
    epsilon: small number added to the variance before the square root.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    use_bias: whether to add a learned bias.
    use_scale: whether to multiply by a learned ``scale``.
    bias_init: initializer of the bias.
    scale_init: initializer of the scale.
    reduction_axes: the axes the statistics are computed over; must include the
      last (None: every axis but the first).
    axis_name: a named axis (pmap, vmap, shard_map) over which the statistics
      are averaged too.
    axis_index_groups: groups of indices along ``axis_name`` to average within
      (as for ``jax.lax.pmean``).
    use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass)
      rather than ``E[(x - E[x])^2]``.
    force_float32_reductions: compute the statistics (and apply scale and bias)
      in at least float32, whatever the input dtype.

  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.key(0), (2, 5, 6))
  >>> gn = GroupNorm(num_groups=3)
  >>> variables = gn.init(jax.random.key(1), x)
  >>> jax.tree_util.tree_map(jnp.shape, variables)
  {'params': {'bias': (6,), 'scale': (6,)}}
  >>> gn.apply(variables, x).shape
  (2, 5, 6)
  """

  num_groups: int | None = 32
  group_size: int | None = None
  epsilon: float = 1e-6
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Initializer = initializers.zeros
  scale_init: Initializer = initializers.ones
  reduction_axes: Axes | None = None
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True

  @compact
  def __call__(self, x, *, mask: jax.Array | None = None):
    """Normalizes ``x`` of shape ``(batch, ..., channels)``; ``mask`` (shaped
    like ``x`` in its last axis) selects the entries that count."""
    reduction_axes = self._reduction_axes(x.ndim)
    num_groups = self._num_groups(x.shape[-1])
    group_size = x.shape[-1] // num_groups
    grouped = x.shape[:-1] + (num_groups, group_size)
    if mask is not None:
      mask = mask.reshape(mask.shape[:-1] + (num_groups, group_size))
    mean, var = _compute_stats(
        x.reshape(grouped), list(reduction_axes[:-1]) + [-1], self.dtype,
        self.axis_name, self.axis_index_groups,
        use_fast_variance=self.use_fast_variance, mask=mask,
        force_float32_reductions=self.force_float32_reductions)
    mean = jnp.repeat(mean, group_size, axis=-1)
    var = jnp.repeat(var, group_size, axis=-1)
    return _normalize(self, x, mean, var, reduction_axes[:-1], (-1,),
                      self.dtype, self.param_dtype, self.epsilon,
                      self.use_bias, self.use_scale, self.bias_init,
                      self.scale_init, self.force_float32_reductions)

  @nowrap
  def _reduction_axes(self, ndim):
    axes = self.reduction_axes
    if axes is None:
      axes = list(range(1, ndim - 1)) + [-1]
    axes = canonicalize_axes(ndim, axes)
    if axes[-1] != ndim - 1:
      raise ValueError(
          'The reduction axes must include the final dimension as this is '
          f'assumed to be the feature axis. ({_where(self)}: expected axis '
          f'{ndim - 1} for inputs of rank {ndim}, got '
          f'{self.reduction_axes!r}.)')
    return axes

  @nowrap
  def _num_groups(self, channels):
    if (self.num_groups is None) == (self.group_size is None):
      raise ValueError(
          'Either `num_groups` or `group_size` should be specified. If '
          '`group_size` is to be specified, pass `num_groups=None` as '
          'argument to override the default `num_groups` value of 32. '
          f'({_where(self)}: got num_groups={self.num_groups!r}, '
          f'group_size={self.group_size!r}.)')
    if self.group_size is not None:
      if channels % self.group_size != 0:
        raise ValueError(
            f'Number of channels ({channels}) is not multiple of the group '
            f'size ({self.group_size}). ({_where(self)})')
      return channels // self.group_size
    if not isinstance(self.num_groups, int):
      raise TypeError(f'{_where(self)}: num_groups must be an int, got '
                      f'{self.num_groups!r}.')
    if self.num_groups <= 0 or channels % self.num_groups != 0:
      raise ValueError(
          f'Number of groups ({self.num_groups}) does not divide the number '
          f'of channels ({channels}). ({_where(self)}: num_groups must be a '
          'positive divisor of the channels.)')
    return self.num_groups


class InstanceNorm(Module):
  """Instance normalization: statistics per example and per feature over
  every axis but the first (batch) axis and ``feature_axes``.

  Attributes:
    epsilon: small number added to the variance before the square root.
    dtype: dtype of the computation (None: inferred from the inputs and
      parameters).
    param_dtype: dtype of the parameters.
    use_bias: whether to add a learned bias.
    use_scale: whether to multiply by a learned ``scale``.
    bias_init: initializer of the bias.
    scale_init: initializer of the scale.
    feature_axes: the axes that get statistics (and ``scale``/``bias`` entries)
      of their own.
    axis_name: a named axis (pmap, vmap, shard_map) over which the statistics
      are averaged too.
    axis_index_groups: groups of indices along ``axis_name`` to average within
      (as for ``jax.lax.pmean``).
    use_fast_variance: compute the variance as ``E[x^2] - E[x]^2`` (one pass)
      rather than ``E[(x - E[x])^2]``.
    force_float32_reductions: compute the statistics (and apply scale and bias)
      in at least float32, whatever the input dtype.

  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.key(0), (2, 3, 4, 5))
  >>> variables = InstanceNorm().init(jax.random.key(1), x)
  >>> y = InstanceNorm().apply(variables, x)
  >>> bool(jnp.allclose(y.mean((1, 2)), 0.0, atol=1e-6))
  True
  """

  epsilon: float = 1e-6
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Initializer = initializers.zeros
  scale_init: Initializer = initializers.ones
  feature_axes: Axes = -1
  axis_name: str | None = None
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True

  @compact
  def __call__(self, x, *, mask: jax.Array | None = None):
    """Normalizes ``x``; ``mask`` selects the entries that count."""
    feature_axes = canonicalize_axes(x.ndim, self.feature_axes)
    if 0 in feature_axes:
      raise ValueError(
          'The channel axes cannot include the leading dimension as this is '
          f'assumed to be the batch axis. ({_where(self)}: got feature_axes='
          f'{self.feature_axes!r} for inputs of rank {x.ndim}.)')
    reduction_axes = [i for i in range(1, x.ndim) if i not in feature_axes]
    mean, var = _compute_stats(
        x, reduction_axes, self.dtype, self.axis_name, self.axis_index_groups,
        use_fast_variance=self.use_fast_variance, mask=mask,
        force_float32_reductions=self.force_float32_reductions)
    return _normalize(self, x, mean, var, reduction_axes, feature_axes,
                      self.dtype, self.param_dtype, self.epsilon,
                      self.use_bias, self.use_scale, self.bias_init,
                      self.scale_init, self.force_float32_reductions)
