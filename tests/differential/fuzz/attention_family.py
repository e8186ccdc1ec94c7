"""``nn.fused_dot_product_attention`` against the default path.

A program is a random call: batch axes (none to two), query and key/value
lengths, query heads and key/value heads (grouped-query when fewer),
depths, a padding mask, a bias, ``is_causal``, a local window, dropout, and
the dtype. The reference is ``nn.dot_product_attention`` on the key/value
heads repeated to the query heads, with the causal and window masks written
out here as boolean masks. Outputs and the gradients with respect to query,
key, value (and bias) must agree within the documented tolerance
(docs/attention.md: float32 1e-5 for outputs and 5e-5 for gradients;
bfloat16 3e-2 and 1e-1, relative to the largest magnitude: the
docs measured up to 6.3e-2 on gradients, seed 51 gives 6.5e-2), and bit for bit where the call falls back (dropout
on, or value depth different from key depth). Shapes the fused call
refuses (heads that do not divide, ``is_causal`` with different lengths)
must raise ``nn.FusedAttentionError``.
"""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import programs

TOLERANCE = {'float32': (1e-5, 5e-5), 'bfloat16': (3e-2, 1e-1)}


@dataclasses.dataclass(frozen=True)
class Call:
  """One random attention call."""
  batch: tuple
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  depth: int
  v_depth: int
  padding: bool
  bias: bool
  is_causal: bool
  window: tuple | None
  dropout: bool
  dtype: str


def draw(c: programs.Chooser) -> Call:
  """A random call, valid or not (simplest options first)."""
  batch = tuple(c.choice([2, 3]) for _ in range(c.choice([1, 0, 2])))
  q_len = c.integer(1, 6)
  kv_len = q_len if c.boolean(0.8) else c.integer(1, 6)
  kv_heads = c.choice([1, 2])
  heads = kv_heads * c.choice([1, 2]) if c.boolean(0.95) else 3
  depth = c.choice([4, 8])
  v_depth = depth if c.boolean(0.85) else 2 * depth
  window = None
  if c.boolean(0.25):
    window = (c.integer(0, 3), c.integer(0, 3))
  return Call(batch, q_len, kv_len, heads, kv_heads, depth, v_depth,
              padding=c.boolean(0.4), bias=c.boolean(0.3),
              is_causal=c.boolean(0.4), window=window,
              dropout=c.boolean(0.15),
              dtype=c.choice(['float32', 'float32', 'bfloat16']))


def _inputs(call: Call):
  keys = jax.random.split(jax.random.key(0), 5)
  dtype = jnp.dtype(call.dtype)
  q = jax.random.normal(keys[0], call.batch + (call.q_len, call.heads,
                                               call.depth), dtype)
  k = jax.random.normal(keys[1], call.batch + (call.kv_len, call.kv_heads,
                                               call.depth), dtype)
  v = jax.random.normal(keys[2], call.batch + (call.kv_len, call.kv_heads,
                                               call.v_depth), dtype)
  bias = None
  if call.bias:
    bias = jax.random.normal(keys[3], call.batch + (call.heads, call.q_len,
                                                    call.kv_len), dtype)
  mask = None
  if call.padding:  # the last key of every other batch row is padding
    valid = jnp.arange(call.kv_len) < call.kv_len - 1
    mask = jnp.broadcast_to(valid, call.batch + (1, call.q_len,
                                                 call.kv_len))
  return q, k, v, bias, mask


def _position_mask(call: Call):
  """Causal and window masks written out: query i sees key j when..."""
  i = jnp.arange(call.q_len)[:, None]
  j = jnp.arange(call.kv_len)[None, :]
  sees = jnp.ones((call.q_len, call.kv_len), bool)
  if call.is_causal:
    sees &= j <= i
  if call.window is not None:
    sees &= (j >= i - call.window[0]) & (j <= i + call.window[1])
  return sees


def _both(call: Call, nn):
  q, k, v, bias, mask = _inputs(call)
  rate = 0.5 if call.dropout else 0.0
  rng = jax.random.key(9)
  groups = call.heads // call.kv_heads

  def fused(q, k, v, bias):
    return nn.fused_dot_product_attention(
        q, k, v, bias, mask, dropout_rng=rng, dropout_rate=rate,
        is_causal=call.is_causal, local_window_size=call.window)

  def default(q, k, v, bias):
    k, v = jnp.repeat(k, groups, axis=-2), jnp.repeat(v, groups, axis=-2)
    full = _position_mask(call)
    if mask is not None:
      full = full & mask
    return nn.dot_product_attention(q, k, v, bias, full, dropout_rng=rng,
                                    dropout_rate=rate)

  def value_and_grads(fn):
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    return fn(q, k, v, bias), jax.grad(loss, argnums)(q, k, v, bias)

  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    # One compile for both paths, values and gradients.
    both = jax.jit(lambda: (value_and_grads(fused), value_and_grads(default)))
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), both())


def _refused(call: Call) -> str | None:
  """Why the fused call must refuse ``call``, or None."""
  if call.heads % call.kv_heads:
    return 'heads'
  if (call.is_causal or call.window is not None) and (
      call.q_len != call.kv_len):
    return 'lengths'
  return None


def _worst(a, b, dtype: str) -> float:
  """The largest difference; in bfloat16, in units of the reference's
  largest magnitude (its rounding is relative: seed 6's gradient entries
  reach 12, where one bfloat16 step is 0.06)."""
  worst = float(np.max(np.abs(a - b), initial=0))
  if dtype == 'bfloat16':
    worst /= max(1.0, float(np.max(np.abs(b), initial=0)))
  return worst


def check(call: Call) -> tuple:
  """The fused call against the default path (see the module docstring)."""
  import liftmods as nn  # pylint: disable=g-import-not-at-top
  refused = _refused(call)
  try:
    (out, grads), (ref, ref_grads) = _both(call, nn)
  except nn.FusedAttentionError as e:
    if refused:
      return 'both_raise', f'FusedAttentionError ({refused})'
    return 'mismatch', f'refused a valid call: {e}'
  if refused:
    return 'mismatch', f'accepted an invalid call ({refused})'
  exact = call.dropout or call.v_depth != call.depth
  atol, grad_atol = (0, 0) if exact else TOLERANCE[call.dtype]
  worst = _worst(out, ref, call.dtype)
  if worst > atol:
    return 'mismatch', f'output differs by {worst:.3g} > {atol}'
  for name, g, r in zip('qkvb', grads, ref_grads):
    worst = _worst(g, r, call.dtype)
    if worst > grad_atol:
      return 'mismatch', f'gradient of {name} differs by {worst:.3g} > ' \
          f'{grad_atol}'
  return 'ok', ''
