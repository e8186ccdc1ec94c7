"""Recurrent cells: one time step ``(carry, inputs) -> (new_carry, output)``.

Each cell builds its gates from ``Dense`` submodules whose names and shapes
match Linen's (``ii``/``hi``... for the LSTMs, ``ir``/``hr``... for the GRU),
and creates its initial carry with ``initialize_carry(rng, input_shape)``.

>>> import jax, jax.numpy as jnp
>>> from liftmods.layers.recurrent import GRUCell
>>> cell = GRUCell(features=3)
>>> x = jnp.ones((2, 4))
>>> carry = cell.initialize_carry(jax.random.key(0), x.shape)
>>> variables = cell.init(jax.random.key(1), carry, x)
>>> sorted(variables['params'])
['hn', 'hr', 'hz', 'in', 'ir', 'iz']
>>> new_carry, y = cell.apply(variables, carry, x)
>>> y.shape
(2, 3)
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from liftmods import initializers, transforms
from liftmods.activation import sigmoid, tanh
from liftmods.dtypes import promote_dtype
from liftmods.layers.linear import Conv, Dense, default_kernel_init
from liftmods.core.frozen_dict import FrozenDict
from liftmods.module import Module, compact, nowrap

__all__ = ['RNNCellBase', 'LSTMCell', 'OptimizedLSTMCell', 'SimpleCell',
           'GRUCell', 'MGUCell', 'ConvLSTMCell', 'RNN', 'Bidirectional',
           'flip_sequences', 'RNNBase', 'DenseParams']

Array = Any
Carry = Any
Dtype = Any
PRNGKey = Any
PrecisionLike = Any
Initializer = Any

_LSTM_GATES = ('i', 'f', 'g', 'o')


def _with_features(input_shape, features) -> tuple:
  """``input_shape`` with its last axis replaced by ``features``."""
  return tuple(input_shape[:-1]) + (features,)


class RNNCellBase(Module):
  """Interface of a recurrent cell: ``__call__(carry, inputs)`` plus the
  carry constructor and the number of trailing feature axes of ``inputs``.

  >>> import jax
  >>> RNNCellBase().initialize_carry(jax.random.key(0), (2, 3))
  Traceback (most recent call last):
  NotImplementedError: RNNCellBase does not define initialize_carry.
  """

  @nowrap
  def initialize_carry(self, rng: PRNGKey, input_shape: tuple[int, ...]
                       ) -> Carry:
    """Returns the initial carry for inputs of shape ``input_shape``."""
    raise NotImplementedError(
        f'{type(self).__name__} does not define initialize_carry.')

  @property
  def num_feature_axes(self) -> int:
    """How many trailing axes of the inputs are features (not batch)."""
    raise NotImplementedError(
        f'{type(self).__name__} does not define num_feature_axes.')


class _TwoStateCarry:
  """``initialize_carry`` for cells whose carry is ``(c, h)``."""

  @nowrap
  def initialize_carry(self, rng: PRNGKey, input_shape: tuple[int, ...]
                       ) -> tuple[Array, Array]:
    """Returns ``(c, h)``, each ``input_shape[:-1] + (features,)``."""
    c_key, h_key = random.split(rng)
    shape = _with_features(input_shape, self.features)
    return (self.carry_init(c_key, shape, self.param_dtype),
            self.carry_init(h_key, shape, self.param_dtype))

  @property
  def num_feature_axes(self) -> int:
    return 1


class _OneStateCarry:
  """``initialize_carry`` for cells whose carry is a single array."""

  @nowrap
  def initialize_carry(self, rng: PRNGKey, input_shape: tuple[int, ...]
                       ) -> Array:
    """Returns ``h`` of shape ``input_shape[:-1] + (features,)``."""
    shape = _with_features(input_shape, self.features)
    return self.carry_init(rng, shape, self.param_dtype)

  @property
  def num_feature_axes(self) -> int:
    return 1


class LSTMCell(_TwoStateCarry, RNNCellBase):
  r"""Long short-term memory cell with one ``Dense`` per gate and input.

  ``i, f, o = gate_fn(W_i* x + W_h* h + b_h*)``,
  ``g = activation_fn(W_ig x + W_hg h + b_hg)``, ``c' = f c + i g``,
  ``h' = o activation_fn(c')``. The carry is ``(c, h)``.

  Attributes:
    features: size of the hidden state.
    gate_fn: gate nonlinearity.
    activation_fn: nonlinearity of the update and the output.
    kernel_init: initializer of the input kernels (``ii``, ``if``...).
    recurrent_kernel_init: initializer of the hidden kernels (``hi``...).
    bias_init: initializer of the hidden biases.
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.
    carry_init: initializer of the carry.

  >>> import jax, jax.numpy as jnp
  >>> cell = LSTMCell(features=2)
  >>> x = jnp.ones((1, 3))
  >>> carry = cell.initialize_carry(jax.random.key(0), x.shape)
  >>> (c, h), y = cell.apply(cell.init(jax.random.key(1), carry, x), carry, x)
  >>> c.shape, h.shape, y.shape
  ((1, 2), (1, 2), (1, 2))
  """

  features: int
  gate_fn: Callable[..., Any] = sigmoid
  activation_fn: Callable[..., Any] = tanh
  kernel_init: Initializer = default_kernel_init
  recurrent_kernel_init: Initializer = initializers.orthogonal()
  bias_init: Initializer = initializers.zeros_init()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  carry_init: Initializer = initializers.zeros_init()

  @compact
  def __call__(self, carry, inputs):
    """One step; returns ``((c', h'), h')``."""
    c, h = carry
    width = h.shape[-1]

    def gate(part, fn):
      from_x = self._dense(width, False, self.kernel_init, f'i{part}')(inputs)
      from_h = self._dense(width, True, self.recurrent_kernel_init,
                           f'h{part}')(h)
      return fn(from_x + from_h)

    i = gate('i', self.gate_fn)
    f = gate('f', self.gate_fn)
    g = gate('g', self.activation_fn)
    o = gate('o', self.gate_fn)
    new_c = f * c + i * g
    new_h = o * self.activation_fn(new_c)
    return (new_c, new_h), new_h

  @nowrap
  def _dense(self, width, use_bias, kernel_init, name):
    extra = {'bias_init': self.bias_init} if use_bias else {}
    return Dense(features=width, use_bias=use_bias, kernel_init=kernel_init,
                 dtype=self.dtype, param_dtype=self.param_dtype, name=name,
                 **extra)


class DenseParams(Module):
  """Creates (and returns) the ``kernel``/``bias`` of a ``Dense`` layer.

  It does not apply them; used by :class:`OptimizedLSTMCell`.

  Attributes:
    features: number of output features.
    use_bias: whether to create a bias.
    param_dtype: dtype of the parameters.
    precision: accepted like Dense's; unused here.
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.

  >>> import jax, jax.numpy as jnp
  >>> p = DenseParams(features=2)
  >>> v = p.init(jax.random.key(0), jnp.ones((1, 3)))
  >>> jax.tree_util.tree_map(jnp.shape, v['params'])
  {'bias': (2,), 'kernel': (3, 2)}
  """

  features: int
  use_bias: bool = True
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = initializers.zeros_init()

  @compact
  def __call__(self, inputs: Array) -> tuple[Array, Array | None]:
    """Returns ``(kernel, bias)`` (bias None without ``use_bias``)."""
    kernel = self.param('kernel', self.kernel_init,
                        (inputs.shape[-1], self.features), self.param_dtype)
    if not self.use_bias:
      return kernel, None
    return kernel, self.param('bias', self.bias_init, (self.features,),
                              self.param_dtype)


class OptimizedLSTMCell(_TwoStateCarry, RNNCellBase):
  r"""LSTM cell with the same parameters as :class:`LSTMCell` that does one
  matrix product for the four input kernels and one for the four hidden
  kernels.

  Attributes:
    features: size of the hidden state.
    gate_fn: gate nonlinearity.
    activation_fn: nonlinearity of the candidate state (and, for LSTMs, of the
      output).
    kernel_init: initializer of the input kernels.
    recurrent_kernel_init: initializer of the hidden kernels.
    bias_init: initializer of the biases.
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.
    carry_init: initializer of the carry.

  >>> import jax, jax.numpy as jnp
  >>> cell = OptimizedLSTMCell(features=2)
  >>> x = jnp.ones((1, 3))
  >>> carry = cell.initialize_carry(jax.random.key(0), x.shape)
  >>> variables = cell.init(jax.random.key(1), carry, x)
  >>> sorted(variables['params'])
  ['hf', 'hg', 'hi', 'ho', 'if', 'ig', 'ii', 'io']
  """

  features: int
  gate_fn: Callable[..., Any] = sigmoid
  activation_fn: Callable[..., Any] = tanh
  kernel_init: Initializer = default_kernel_init
  recurrent_kernel_init: Initializer = initializers.orthogonal()
  bias_init: Initializer = initializers.zeros_init()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  carry_init: Initializer = initializers.zeros_init()

  @compact
  def __call__(self, carry: tuple[Array, Array], inputs: Array
               ) -> tuple[tuple[Array, Array], Array]:
    """One step; returns ``((c', h'), h')``."""
    c, h = carry
    from_x, from_h = self._gate_params(inputs, h)
    pre_h = self._fused_dense(h, from_h, use_bias=True)
    pre_x = self._fused_dense(inputs, from_x, use_bias=False)
    i = self.gate_fn(pre_h['i'] + pre_x['i'])
    f = self.gate_fn(pre_h['f'] + pre_x['f'])
    g = self.activation_fn(pre_h['g'] + pre_x['g'])
    o = self.gate_fn(pre_h['o'] + pre_x['o'])
    new_c = f * c + i * g
    new_h = o * self.activation_fn(new_c)
    return (new_c, new_h), new_h

  @nowrap
  def _gate_params(self, inputs, h):
    """Creates ``i*``/``h*`` parameters in Linen's order (ii, hi, if, ...)."""
    from_x, from_h = {}, {}
    for part in _LSTM_GATES:
      from_x[part] = DenseParams(
          features=h.shape[-1], use_bias=False, param_dtype=self.param_dtype,
          kernel_init=self.kernel_init, bias_init=self.bias_init,
          name=f'i{part}')(inputs)
      from_h[part] = DenseParams(
          features=h.shape[-1], use_bias=True, param_dtype=self.param_dtype,
          kernel_init=self.recurrent_kernel_init, bias_init=self.bias_init,
          name=f'h{part}')(h)
    return from_x, from_h

  @nowrap
  def _fused_dense(self, x, params, use_bias):
    """Applies the concatenated kernels; returns one slice per gate."""
    kernels = [kernel for kernel, _ in params.values()]
    kernel = jnp.concatenate(kernels, axis=-1)
    bias = None
    if use_bias:
      bias = jnp.concatenate([b for _, b in params.values()], axis=-1)
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
    y = jnp.dot(x, kernel)
    if use_bias:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    cuts = np.cumsum([k.shape[-1] for k in kernels[:-1]])
    return dict(zip(params, jnp.split(y, cuts, axis=-1)))


class SimpleCell(_OneStateCarry, RNNCellBase):
  r"""Elman cell: ``h' = activation_fn(W_i x + b_i + W_h h [+ h])``.

  Attributes:
    features: size of the hidden state.
    activation_fn: output nonlinearity.
    kernel_init: initializer of the input kernel ``i``.
    recurrent_kernel_init: initializer of the hidden kernel ``h``.
    bias_init: initializer of the input bias.
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.
    carry_init: initializer of the carry.
    residual: add ``h`` before the nonlinearity.

  >>> import jax, jax.numpy as jnp
  >>> cell = SimpleCell(features=2)
  >>> x = jnp.ones((1, 3))
  >>> h = cell.initialize_carry(jax.random.key(0), x.shape)
  >>> h2, y = cell.apply(cell.init(jax.random.key(1), h, x), h, x)
  >>> bool((h2 == y).all())
  True
  """

  features: int
  activation_fn: Callable[..., Any] = tanh
  kernel_init: Initializer = default_kernel_init
  recurrent_kernel_init: Initializer = initializers.orthogonal()
  bias_init: Initializer = initializers.zeros_init()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  carry_init: Initializer = initializers.zeros_init()
  residual: bool = False

  @compact
  def __call__(self, carry, inputs):
    """One step; returns ``(h', h')``."""
    width = carry.shape[-1]
    from_x = Dense(features=width, use_bias=True, dtype=self.dtype,
                   param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                   bias_init=self.bias_init, name='i')(inputs)
    from_h = Dense(features=width, use_bias=False, dtype=self.dtype,
                   param_dtype=self.param_dtype,
                   kernel_init=self.recurrent_kernel_init, name='h')(carry)
    pre = from_x + from_h
    if self.residual:
      pre += carry
    new_h = self.activation_fn(pre)
    return new_h, new_h


class GRUCell(_OneStateCarry, RNNCellBase):
  r"""Gated recurrent unit.

  ``r = gate_fn(W_ir x + b_ir + W_hr h)``,
  ``z = gate_fn(W_iz x + b_iz + W_hz h)``,
  ``n = activation_fn(W_in x + b_in + r (W_hn h + b_hn))``,
  ``h' = (1 - z) n + z h``.

  Attributes:
    features: size of the hidden state.
    gate_fn: gate nonlinearity.
    activation_fn: nonlinearity of the candidate state (and, for LSTMs, of the
      output).
    kernel_init: initializer of the input kernels.
    recurrent_kernel_init: initializer of the hidden kernels.
    bias_init: initializer of the biases.
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.
    carry_init: initializer of the carry.

  >>> import jax, jax.numpy as jnp
  >>> cell = GRUCell(features=2)
  >>> x = jnp.ones((3,))
  >>> h = cell.initialize_carry(jax.random.key(0), x.shape)
  >>> cell.apply(cell.init(jax.random.key(1), h, x), h, x)[1].shape
  (2,)
  """

  features: int
  gate_fn: Callable[..., Any] = sigmoid
  activation_fn: Callable[..., Any] = tanh
  kernel_init: Initializer = default_kernel_init
  recurrent_kernel_init: Initializer = initializers.orthogonal()
  bias_init: Initializer = initializers.zeros_init()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  carry_init: Initializer = initializers.zeros_init()

  @compact
  def __call__(self, carry, inputs):
    """One step; returns ``(h', h')``."""
    h = carry
    width = h.shape[-1]
    x_dense = lambda name: self._dense(width, True, self.kernel_init, name)
    h_dense = lambda name, use_bias=False: self._dense(
        width, use_bias, self.recurrent_kernel_init, name)
    r = self.gate_fn(x_dense('ir')(inputs) + h_dense('hr')(h))
    z = self.gate_fn(x_dense('iz')(inputs) + h_dense('hz')(h))
    n = self.activation_fn(x_dense('in')(inputs) +
                           r * h_dense('hn', use_bias=True)(h))
    new_h = (1.0 - z) * n + z * h
    return new_h, new_h

  @nowrap
  def _dense(self, width, use_bias, kernel_init, name):
    return Dense(features=width, use_bias=use_bias, dtype=self.dtype,
                 param_dtype=self.param_dtype, kernel_init=kernel_init,
                 bias_init=self.bias_init, name=name)


class MGUCell(_OneStateCarry, RNNCellBase):
  r"""Minimal gated unit (Zhou et al., 2016).

  ``f = gate_fn(W_if x + b_if + W_hf h)``,
  ``n = activation_fn(W_in x + b_in + f (W_hn h + b_hn))`` (without the
  ``f`` factor and ``b_hn`` when ``reset_gate`` is false),
  ``h' = (1 - f) n + f h``.

  Attributes:
    features: size of the hidden state.
    gate_fn: gate nonlinearity.
    activation_fn: nonlinearity of the candidate state ``n``.
    kernel_init: initializer of the input kernels (``if``, ``in``).
    recurrent_kernel_init: initializer of the hidden kernels (``hf``,
      ``hn``).
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.
    carry_init: initializer of the carry.
    forget_bias_init: initializer of ``b_if`` (ones by default).
    activation_bias_init: initializer of ``b_in`` and ``b_hn``.
    reset_gate: whether ``f`` also gates the hidden contribution to ``n``.

  >>> import jax, jax.numpy as jnp
  >>> cell = MGUCell(features=2, reset_gate=False)
  >>> x = jnp.ones((1, 3))
  >>> h = cell.initialize_carry(jax.random.key(0), x.shape)
  >>> v = cell.init(jax.random.key(1), h, x)
  >>> sorted(v['params']['hn'])
  ['kernel']
  """

  features: int
  gate_fn: Callable[..., Any] = sigmoid
  activation_fn: Callable[..., Any] = tanh
  kernel_init: Initializer = default_kernel_init
  recurrent_kernel_init: Initializer = initializers.orthogonal()
  forget_bias_init: Initializer = initializers.ones_init()
  activation_bias_init: Initializer = initializers.zeros_init()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  carry_init: Initializer = initializers.zeros_init()
  reset_gate: bool = True

  @compact
  def __call__(self, carry, inputs):
    """One step; returns ``(h', h')``."""
    h = carry
    width = h.shape[-1]
    f = self.gate_fn(
        self._dense(width, True, self.kernel_init, 'if',
                    self.forget_bias_init)(inputs) +
        self._dense(width, False, self.recurrent_kernel_init, 'hf')(h))
    from_h = self._dense(width, self.reset_gate, self.recurrent_kernel_init,
                         'hn')(h)
    if self.reset_gate:
      from_h *= f
    n = self.activation_fn(
        self._dense(width, True, self.kernel_init, 'in')(inputs) + from_h)
    new_h = (1.0 - f) * n + f * h
    return new_h, new_h

  @nowrap
  def _dense(self, width, use_bias, kernel_init, name, bias_init=None):
    return Dense(features=width, use_bias=use_bias, dtype=self.dtype,
                 param_dtype=self.param_dtype, kernel_init=kernel_init,
                 bias_init=bias_init or self.activation_bias_init, name=name)


class ConvLSTMCell(RNNCellBase):
  r"""Convolutional LSTM cell (Shi et al., 2015).

  Two convolutions, ``ih`` on the inputs and ``hh`` on ``h``, each with
  ``4 * features`` output channels, give the pre-activations of the gates
  ``i, g, f, o`` (in that order along the channels). The forget gate gets
  ``+1`` before its sigmoid. The carry is ``(c, h)``, spatial like inputs.

  Attributes:
    features: channels of the hidden state.
    kernel_size: convolution window, one entry per spatial axis.
    strides: convolution strides (None: all ones).
    padding: ``'SAME'``, ``'VALID'`` or explicit pairs, as for ``Conv``.
    use_bias: whether the convolutions have biases.
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.
    carry_init: initializer of the carry.

  >>> import jax, jax.numpy as jnp
  >>> cell = ConvLSTMCell(features=2, kernel_size=(3,))
  >>> x = jnp.ones((1, 5, 4))
  >>> carry = cell.initialize_carry(jax.random.key(0), x.shape)
  >>> [a.shape for a in carry], cell.num_feature_axes
  ([(1, 5, 2), (1, 5, 2)], 2)
  >>> params = cell.init(jax.random.key(1), carry, x)['params']
  >>> params['ih']['kernel'].shape, params['hh']['kernel'].shape
  ((3, 4, 8), (3, 2, 8))
  """

  features: int
  kernel_size: Sequence[int]
  strides: Sequence[int] | None = None
  padding: str | Sequence[tuple[int, int]] = 'SAME'
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  carry_init: Initializer = initializers.zeros_init()

  @compact
  def __call__(self, carry, inputs):
    """One step; returns ``((c', h'), h')``."""
    c, h = carry
    pre = self._conv('ih')(inputs) + self._conv('hh')(h)
    i, g, f, o = jnp.split(pre, indices_or_sections=4, axis=-1)
    f = sigmoid(f + 1)
    new_c = f * c + sigmoid(i) * jnp.tanh(g)
    new_h = sigmoid(o) * jnp.tanh(new_c)
    return (new_c, new_h), new_h

  @nowrap
  def _conv(self, name):
    return Conv(features=4 * self.features, kernel_size=self.kernel_size,
                strides=self.strides, padding=self.padding,
                use_bias=self.use_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, name=name)

  @nowrap
  def initialize_carry(self, rng: PRNGKey, input_shape: tuple[int, ...]
                       ) -> tuple[Array, Array]:
    """Returns ``(c, h)`` shaped ``batch + spatial + (features,)``."""
    shape = _with_features(input_shape, self.features)  # batch + spatial
    c_key, h_key = random.split(rng)
    return (self.carry_init(c_key, shape, self.param_dtype),
            self.carry_init(h_key, shape, self.param_dtype))

  @property
  def num_feature_axes(self) -> int:
    return len(self.kernel_size) + 1


# -- sequence wrappers ---------------------------------------------------------------


def flip_sequences(inputs: Array, seq_lengths: Array | None,
                   num_batch_dims: int, time_major: bool) -> Array:
  """Reverses each sequence along the time axis, within its length.

  Without ``seq_lengths`` the whole time axis is reversed. With it, the
  first ``seq_lengths[b]`` steps of sequence ``b`` are reversed in place and
  the padding after them is rotated to the front, as in Linen:
  index ``t`` of the result reads input step ``(L - 1 - t) mod T``.

  Args:
    inputs: the sequences, ``(*batch, time, *features)`` or, with
      ``time_major``, ``(time, *batch, *features)``.
    seq_lengths: the length of each sequence, shaped like the batch axes
      (None: all are full length).
    num_batch_dims: the number of batch axes.
    time_major: whether time is the first axis.

  Returns:
    The flipped sequences, shaped like ``inputs``.

  >>> import jax.numpy as jnp
  >>> x = jnp.arange(4.)[None, :, None]  # batch 1, time 4, features 1
  >>> flip_sequences(x, jnp.array([3]), 1, False)[0, :, 0]
  Array([2., 1., 0., 3.], dtype=float32)
  """
  time_axis = 0 if time_major else num_batch_dims
  steps = inputs.shape[time_axis]
  if seq_lengths is None:
    return jnp.flip(inputs, axis=time_axis)
  order = jnp.arange(steps - 1, -1, -1)
  shape = [1] * (num_batch_dims + 1)
  shape[time_axis] = steps
  order = order.reshape(shape)
  lengths = jnp.expand_dims(seq_lengths, axis=time_axis)
  idx = (order + lengths) % steps
  idx = idx.reshape(idx.shape + (1,) * (inputs.ndim - idx.ndim))
  return jnp.take_along_axis(inputs, idx, axis=time_axis)


def _last_carry(carries, seq_lengths):
  """The carry after step ``seq_lengths[b] - 1`` for each batch row ``b``
  (carries stacked on axis 0, one batch axis)."""
  last = seq_lengths - 1

  def pick(x):
    return x[last, jnp.arange(x.shape[1])]

  return jax.tree_util.tree_map(pick, carries)


def _concatenate(a: Array, b: Array) -> Array:
  """Joins the forward and backward outputs along the feature axis."""
  return jnp.concatenate([a, b], axis=-1)


class RNNBase(Protocol):
  """What :class:`Bidirectional` expects of its two recurrent layers: the
  call signature of :class:`RNN`."""

  def __call__(self, inputs: Array, *, initial_carry: Carry | None = None,
               init_key: PRNGKey | None = None,
               seq_lengths: Array | None = None,
               return_carry: bool | None = None,
               time_major: bool | None = None, reverse: bool | None = None,
               keep_order: bool | None = None) -> Any:
    ...


class RNN(Module):
  """Runs a recurrent ``cell`` over the time axis of its inputs with a lifted
  ``scan``.

  Inputs are ``(*batch, time, *features)`` (or ``(time, *batch, *features)``
  with ``time_major``), where the cell says how many trailing axes are
  features (``num_feature_axes``). The carry starts from
  ``cell.initialize_carry(init_key or key(0), ...)`` unless
  ``initial_carry`` is given. Parameters are shared across steps
  (``variable_broadcast='params'``); the ``variable_*`` and ``split_rngs``
  attributes go to the scan unchanged.

  Attributes:
    cell: the step, an :class:`RNNCellBase`.
    time_major: whether time is the first axis.
    return_carry: also return the final carry (``(carry, outputs)``).
    reverse: run from the last step to the first (within
      ``seq_lengths`` when given).
    keep_order: with ``reverse``, flip the outputs back to input order.
    unroll: scan steps unrolled per loop iteration.
    variable_axes: as for :func:`liftmods.scan`.
    variable_broadcast: as for :func:`liftmods.scan` (default: ``'params'``,
      shared across steps).
    variable_carry: as for :func:`liftmods.scan`.
    split_rngs: as for :func:`liftmods.scan` (default:
      ``{'params': False}``).

  >>> import jax, jax.numpy as jnp
  >>> rnn = RNN(GRUCell(features=3))
  >>> x = jnp.ones((2, 5, 4))  # batch, time, features
  >>> variables = rnn.init(jax.random.key(0), x)
  >>> sorted(variables['params']['cell'])
  ['hn', 'hr', 'hz', 'in', 'ir', 'iz']
  >>> rnn.apply(variables, x).shape
  (2, 5, 3)
  """

  cell: RNNCellBase
  time_major: bool = False
  return_carry: bool = False
  reverse: bool = False
  keep_order: bool = False
  unroll: int = 1
  variable_axes: Mapping[Any, Any] = FrozenDict()
  variable_broadcast: Any = 'params'
  variable_carry: Any = False
  split_rngs: Mapping[Any, bool] = FrozenDict({'params': False})

  def __call__(self, inputs: Array, *, initial_carry: Carry | None = None,
               init_key: PRNGKey | None = None,
               seq_lengths: Array | None = None,
               return_carry: bool | None = None,
               time_major: bool | None = None, reverse: bool | None = None,
               keep_order: bool | None = None):
    """Returns the outputs of every step (and the final carry when
    ``return_carry``); arguments given here override the attributes."""
    return_carry = _pick(return_carry, self.return_carry)
    time_major = _pick(time_major, self.time_major)
    reverse = _pick(reverse, self.reverse)
    keep_order = _pick(keep_order, self.keep_order)
    n_features = self.cell.num_feature_axes
    time_axis = 0 if time_major else inputs.ndim - (n_features + 1)
    if time_axis < 0:
      time_axis += inputs.ndim
    n_batch = (len(inputs.shape[1:-n_features]) if time_major
               else time_axis)

    def flip(tree):
      return jax.tree_util.tree_map(
          lambda x: flip_sequences(x, seq_lengths, n_batch, time_major),
          tree)

    if reverse:
      inputs = flip(inputs)
    carry = initial_carry
    if carry is None:
      key = random.key(0) if init_key is None else init_key
      step_shape = inputs.shape[:time_axis] + inputs.shape[time_axis + 1:]
      carry = self.cell.initialize_carry(key, step_shape)
    stack_carries = seq_lengths is not None and return_carry

    def body(cell, carry, x):
      carry, y = cell(carry, x)
      return carry, ((carry, y) if stack_carries else y)

    looped = transforms.scan(
        body, in_axes=time_axis,
        out_axes=(0, time_axis) if stack_carries else time_axis,
        unroll=self.unroll, variable_axes=self.variable_axes,
        variable_broadcast=self.variable_broadcast,
        variable_carry=self.variable_carry, split_rngs=self.split_rngs)
    carry, outputs = looped(self.cell, carry, inputs)
    if stack_carries:
      carries, outputs = outputs
      carry = _last_carry(carries, seq_lengths)
    if reverse and keep_order:
      outputs = flip(outputs)
    return (carry, outputs) if return_carry else outputs


def _pick(value, default):
  return default if value is None else value


class Bidirectional(Module):
  """Runs ``forward_rnn`` over the inputs and ``backward_rnn`` over them
  reversed (outputs put back in input order), and merges the two outputs
  with ``merge_fn`` (concatenation on the last axis by default). The carry
  is ``(forward_carry, backward_carry)``.

  Attributes:
    forward_rnn: the RNN run over the inputs in order.
    backward_rnn: the RNN run over the reversed inputs.
    merge_fn: ``merge_fn(forward_outputs, backward_outputs)``.
    time_major: whether time is the first axis.
    return_carry: also return the pair of final carries.

  >>> import jax, jax.numpy as jnp
  >>> bi = Bidirectional(RNN(LSTMCell(3)), RNN(LSTMCell(3)))
  >>> x = jnp.ones((2, 5, 4))
  >>> variables = bi.init(jax.random.key(0), x)
  >>> sorted(variables['params'])
  ['backward_rnn', 'forward_rnn']
  >>> bi.apply(variables, x).shape
  (2, 5, 6)
  """

  forward_rnn: RNNBase
  backward_rnn: RNNBase
  merge_fn: Callable[[Array, Array], Array] = _concatenate
  time_major: bool = False
  return_carry: bool = False

  def __call__(self, inputs: Array, *, initial_carry: Carry | None = None,
               init_key: PRNGKey | None = None,
               seq_lengths: Array | None = None,
               return_carry: bool | None = None,
               time_major: bool | None = None, reverse: bool | None = None,
               keep_order: bool | None = None):
    """Returns the merged outputs (and the pair of carries when
    ``return_carry``). ``reverse`` and ``keep_order`` are accepted for
    signature compatibility and ignored, as in Linen."""
    del reverse, keep_order
    time_major = _pick(time_major, self.time_major)
    return_carry = _pick(return_carry, self.return_carry)
    keys = (None, None)
    if init_key is not None:
      keys = tuple(random.split(init_key))
    carries = (None, None) if initial_carry is None else initial_carry
    if self.forward_rnn is self.backward_rnn:
      logging.warning('forward_rnn and backward_rnn are the same object: '
                      'they share parameters.')
    common = dict(seq_lengths=seq_lengths, return_carry=True,
                  time_major=time_major)
    carry_f, out_f = self.forward_rnn(inputs, initial_carry=carries[0],
                                      init_key=keys[0], reverse=False,
                                      **common)
    carry_b, out_b = self.backward_rnn(inputs, initial_carry=carries[1],
                                       init_key=keys[1], reverse=True,
                                       keep_order=True, **common)
    outputs = jax.tree_util.tree_map(self.merge_fn, out_f, out_b)
    carry = (carry_f, carry_b)
    return (carry, outputs) if return_carry else outputs
