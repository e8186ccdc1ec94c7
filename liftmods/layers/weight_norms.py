"""Reparameterizing wrappers: WeightNorm and SpectralNorm.

Both wrap a layer *instance* and run it under :func:`liftmods.map_variables`
with its ``params`` rewritten on the way in: WeightNorm divides each selected
parameter by its L2 norm over the non-feature axes (times a learned
``scale``); SpectralNorm divides each matrix by an estimate of its largest
singular value, kept up to date by power iteration. Their own variables live
next to the wrapped layer's and are named ``{layer}/{param path}/...`` as in
Linen.

>>> import jax, jax.numpy as jnp
>>> from liftmods.layers.linear import Dense
>>> wn = WeightNorm(Dense(3))
>>> variables = wn.init(jax.random.key(0), jnp.ones((1, 2)))
>>> jax.tree_util.tree_map(jnp.shape, variables["params"])  # doctest: +NORMALIZE_WHITESPACE
{'layer_instance': {'bias': (3,), 'kernel': (2, 3)},
 'layer_instance/kernel/scale': (3,)}
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from liftmods import dtypes, initializers, transforms
from liftmods.layers.normalization import canonicalize_axes
from liftmods.module import Module, compact

__all__ = ['WeightNorm', 'SpectralNorm']

Array = Any
Dtype = Any
Initializer = Any


def _l2_normalize(x, axis=None, eps=1e-12):
  """``x`` divided by its L2 norm over ``axis`` (all axes when None)."""
  return x * jax.lax.rsqrt((x * x).sum(axis=axis, keepdims=True) + eps)


# Public name for liftmods.normalization, which gives it Linen's (_l2_normalize).
l2_normalize = _l2_normalize


def _param_path(layer: Module, path) -> str:
  """``layer_name/a/b`` for the parameter at ``path`` (collection first)."""
  keys = [getattr(k, 'key', getattr(k, 'name', k)) for k in path[1:]]
  return '/'.join([layer.name] + [str(k) for k in keys])


def _run_mapped(mdl: Module, args, kwargs, trans_in_fn, mutable: bool):
  """Calls ``mdl.layer_instance(*args, **kwargs)`` with its variables
  passed through ``trans_in_fn``."""

  def layer_forward(layer):
    return layer(*args, **kwargs)

  return transforms.map_variables(
      layer_forward, trans_in_fn=trans_in_fn, init=mdl.is_initializing(),
      mutable=mutable)(mdl.layer_instance)


class SpectralNorm(Module):
  """Divides every matrix parameter of ``layer_instance`` by its spectral
  norm, estimated with ``n_steps`` power-iteration steps per call.

  The iteration vector ``u`` (``(1, n)``, drawn from the ``params`` rng when
  first created) and the last ``sigma`` are kept in ``collection_name`` under
  ``{layer}/{param}/u`` and ``/sigma``; they are only written when
  ``update_stats`` is true. Parameters of more than two dimensions are
  reshaped to ``(-1, last)`` (or rejected with ``error_on_non_matrix``);
  vectors and scalars are left alone.

  Attributes:
    layer_instance: the wrapped layer.
    n_steps: power-iteration steps per call.
    epsilon: added inside the norms.
    dtype: output dtype of the normalized parameters (None: inferred).
    param_dtype: dtype of ``u`` and ``sigma``.
    error_on_non_matrix: raise on parameters with more than 2 dimensions.
    collection_name: where ``u`` and ``sigma`` live.

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers.linear import Dense
  >>> sn = SpectralNorm(Dense(3))
  >>> x = jnp.ones((1, 2))
  >>> variables = sn.init(jax.random.key(0), x, update_stats=True)
  >>> sorted(variables['batch_stats'])
  ['layer_instance/kernel/sigma', 'layer_instance/kernel/u']
  >>> y, updates = sn.apply(variables, x, update_stats=True,
  ...                       mutable=['batch_stats'])
  >>> y.shape
  (1, 3)
  """

  layer_instance: Module
  n_steps: int = 1
  epsilon: float = 1e-12
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  error_on_non_matrix: bool = False
  collection_name: str = 'batch_stats'

  @compact
  def __call__(self, *args, update_stats: bool, **kwargs):
    """Calls the wrapped layer on spectrally normalized parameters."""
    normalize = functools.partial(self._spectral_normalize,
                                  update_stats=update_stats)
    return _run_mapped(
        self, args, kwargs,
        lambda vs: jax.tree_util.tree_map_with_path(normalize, vs),
        mutable=True)

  def _spectral_normalize(self, path, vs, update_stats):
    value = jnp.asarray(vs)
    shape = value.shape
    if value.ndim <= 1 or self.n_steps < 1:
      return value
    if value.ndim > 2:
      if self.error_on_non_matrix:
        raise ValueError(
            f'Input is {value.ndim}D but error_on_non_matrix is True')
      value = jnp.reshape(value, (-1, value.shape[-1]))
    prefix = _param_path(self.layer_instance, path)
    u_name, sigma_name = prefix + '/u', prefix + '/sigma'
    col = self.collection_name
    key = (None if self.has_variable(col, u_name)
           else self.make_rng('params'))
    u_var = self.variable(col, u_name, jax.random.normal, key,
                          (1, value.shape[-1]), self.param_dtype)
    sigma_var = self.variable(col, sigma_name, jnp.ones, (),
                              self.param_dtype)
    u = u_var.value
    for _ in range(self.n_steps):
      v = _l2_normalize(jnp.matmul(u, value.transpose([1, 0])),
                        eps=self.epsilon)
      u = _l2_normalize(jnp.matmul(v, value), eps=self.epsilon)
    u = jax.lax.stop_gradient(u)
    v = jax.lax.stop_gradient(v)
    sigma = jnp.matmul(jnp.matmul(v, value), jnp.transpose(u))[0, 0]
    value /= jnp.where(sigma != 0, sigma, 1)
    if update_stats:
      u_var.value = u
      sigma_var.value = sigma
    dtype = dtypes.canonicalize_dtype(vs, u, v, sigma, dtype=self.dtype)
    return jnp.asarray(value.reshape(shape), dtype)


class WeightNorm(Module):
  """Weight normalization (Salimans & Kingma, 2016) of ``layer_instance``.

  Each parameter whose path contains a name of ``variable_filter`` (all
  parameters when the filter is empty or None) is divided by its L2 norm
  over the axes that are not ``feature_axes`` (over all axes when
  ``feature_axes`` is None) and, with ``use_scale``, multiplied by a learned
  ``{layer}/{param}/scale`` of the feature shape.

  Attributes:
    layer_instance: the wrapped layer.
    epsilon: added inside the norm.
    dtype: output dtype of the normalized parameters (None: inferred).
    param_dtype: dtype of the scales.
    use_scale: learn a scale per feature.
    scale_init: initializer of the scales.
    feature_axes: axes that keep their own norm.
    variable_filter: substrings selecting the parameters to normalize.

  >>> import jax, jax.numpy as jnp
  >>> from liftmods.layers.linear import Dense
  >>> wn = WeightNorm(Dense(2, use_bias=False), use_scale=False)
  >>> variables = wn.init(jax.random.key(0), jnp.eye(3))
  >>> columns = wn.apply(variables, jnp.eye(3))  # the normalized kernel
  >>> jnp.linalg.norm(columns, axis=0).round(4)
  Array([1., 1.], dtype=float32)
  """

  layer_instance: Module
  epsilon: float = 1e-12
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  use_scale: bool = True
  scale_init: Initializer = initializers.ones
  feature_axes: Any = -1
  variable_filter: Iterable | None = dataclasses.field(
      default_factory=lambda: {'kernel'})

  @compact
  def __call__(self, *args, **kwargs):
    """Calls the wrapped layer on weight-normalized parameters."""
    return _run_mapped(
        self, args, kwargs,
        lambda vs: jax.tree_util.tree_map_with_path(self._l2_normalize, vs),
        mutable=False)

  def _l2_normalize(self, path, vs):
    value = jnp.asarray(vs)
    name = _param_path(self.layer_instance, path)
    if self.variable_filter and not any(
        v in name for v in self.variable_filter):
      return value
    if self.feature_axes is None:
      feature_axes = ()
    else:
      feature_axes = canonicalize_axes(value.ndim, self.feature_axes)
    reduction_axes = tuple(i for i in range(value.ndim)
                           if i not in feature_axes)
    feature_shape = [1] * value.ndim
    for ax in feature_axes:
      feature_shape[ax] = value.shape[ax]
    normalized = _l2_normalize(value, axis=reduction_axes, eps=self.epsilon)
    args = [vs]
    if self.use_scale:
      scale = self.param(name + '/scale', self.scale_init,
                         [value.shape[ax] for ax in feature_axes],
                         self.param_dtype).reshape(feature_shape)
      normalized *= scale
      args.append(scale)
    dtype = dtypes.canonicalize_dtype(*args, dtype=self.dtype)
    return jnp.asarray(normalized, dtype)
