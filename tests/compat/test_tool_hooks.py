"""The Linen behaviours that tools built on Linen's module system rely on.

Quantization libraries (qwix, AQT) do not only write models: they reach
into Linen's module internals and dataclass machinery. Each test here is one
such behaviour, run under flax.linen and liftmods with the same program
(``treecheck.assert_matches_linen``) or checked through the switch.
"""
import dataclasses
import functools
import gc
import weakref
from typing import Any

import flax.core.meta as flax_meta
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods
from liftmods import compat
from liftmods.core import meta

from treecheck import assert_identical, assert_matches_linen, normal

X = normal(0, (2, 3))


# -- the module stack and re-wrapping, as qwix reaches them -------------------


def test_context_module_stack_is_the_running_module():
  """``nn.module._context.module_stack[-1]`` is the module whose method is
  running (qwix finds the module to quantize this way)."""

  def program(nn):
    seen = []

    class Inner(nn.Module):
      @nn.compact
      def __call__(self, x):
        seen.append(nn.module._context.module_stack[-1])  # pylint: disable=protected-access
        return nn.Dense(2)(x)

    class Outer(nn.Module):
      @nn.compact
      def __call__(self, x):
        seen.append(nn.module._context.module_stack[-1])  # pylint: disable=protected-access
        return Inner()(x)

    outside = nn.module._context.module_stack[-1]  # pylint: disable=protected-access
    Outer().init(jax.random.key(0), X)
    return (outside, [(type(m).__name__, m.scope is not None, m.name)
                      for m in seen])

  assert assert_matches_linen(program) == (
      None, [('Outer', True, None), ('Inner', True, 'Inner_0')])


def test_context_resolves_through_the_switch():
  with compat.flax_linen_as_liftmods():
    import flax.linen as linen  # pylint: disable=import-outside-toplevel
    assert linen.module._context is liftmods.module._context  # pylint: disable=protected-access
    assert linen.module.wrap_method_once is liftmods.module.wrap_method


def test_unwrap_and_wrap_method_once_like_qwix():
  """qwix unwraps a module method through ``__wrapped__``, wraps its own
  function around it, re-wraps with ``wrap_method_once`` and installs it on
  a subclass made with ``type``: the result runs as a module method (inside
  the module stack, with compact naming) on either library."""

  def program(nn):
    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(4)(x)))

    calls = []
    method = Model.__call__
    assert method.method_handler_wrapped
    raw = method.__wrapped__

    @functools.wraps(raw)  # carries the compact mark, as qwix's wrapper does
    def intercepted(self, x):
      calls.append(type(nn.module._context.module_stack[-1]).__name__)  # pylint: disable=protected-access
      return raw(self, x) * 2.0

    wrapped = nn.module.wrap_method_once(intercepted)
    assert nn.module.wrap_method_once(wrapped) is wrapped
    model = Model()
    model.__class__ = type('Model', (Model,), {'__call__': wrapped})
    variables = model.init(jax.random.key(1), X)
    out = model.apply(variables, X)
    return variables, out, calls

  variables, out, calls = assert_matches_linen(program)
  assert calls == ['Model', 'Model']
  assert set(variables['params']) == {'Dense_0', 'Dense_1'}
  assert out.shape == (2, 3)


# -- Modules through dataclass(slots=True), as AQT declares them -------------


def _slots_program(nn):
  @dataclasses.dataclass(slots=True, kw_only=True)
  class Quantizer(nn.Module):
    bits: int = 8
    scale: float = 0.5

    @nn.compact
    def __call__(self, x):
      y = nn.Dense(4, name='proj')(x)
      return jnp.round(y / self.scale) * self.scale, self.bits

  model = Quantizer(bits=4)
  variables = model.init(jax.random.key(2), X)
  out, bits = model.apply(variables, X)
  clone = model.clone(scale=0.25)
  return (variables, out, bits, clone.scale, clone.bits, repr(model),
          model == Quantizer(bits=4), hash(model) == hash(Quantizer(bits=4)),
          Quantizer(3).bits, Quantizer.__slots__)


def test_slots_dataclass_of_a_module():
  out = assert_matches_linen(_slots_program)
  variables, _, bits, scale, cbits, text, eq, same_hash, positional, slots = out
  assert set(variables['params']['proj']) == {'bias', 'kernel'}
  assert (bits, scale, cbits, eq, same_hash) == (4, 0.25, 4, True, True)
  assert text.endswith('Quantizer(bits=4, scale=0.5, parent=None, name=None)')
  # As in Linen, the constructor made before the slots pass stands: a
  # positional argument is still accepted despite kw_only=True.
  assert positional == 3
  assert slots == ('bits', 'scale', 'parent', 'name')


def test_slots_dataclass_keeps_field_defaults():
  """Linen's fields lose their defaults in the slots pass (a subclass of
  such a class then cannot be built without them); liftmods keeps the
  fields of the first pass, so subclasses work."""

  @dataclasses.dataclass(slots=True, kw_only=True)
  class Q(liftmods.Module):
    bits: int = 8

    @liftmods.compact
    def __call__(self, x):
      return liftmods.Dense(self.bits)(x)

  class Wide(Q):
    extra: int = 2

  fields = {f.name: f.default for f in dataclasses.fields(Q)}
  assert fields['bits'] == 8 and fields['name'] is None
  wide = Wide(extra=3)
  assert (wide.bits, wide.extra) == (8, 3)
  variables = Wide(bits=5).init(jax.random.key(0), X)
  assert variables['params']['Dense_0']['kernel'].shape == (3, 5)


def test_reserved_names_still_rejected():
  with pytest.raises(liftmods.errors.ReservedModuleAttributeError):
    class Bad(liftmods.Module):  # pylint: disable=unused-variable
      parent: int = 0


# -- custom_vjp whose forward is traced after apply returned -----------------


def _custom_vjp_model(nn):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      self.param('w', nn.initializers.ones, (3,))
      f = lambda mdl, x: x * mdl.get_variable('params', 'w') + jax.random.uniform(
          mdl.make_rng('noise'), (3,))
      fwd = lambda mdl, x: (f(mdl, x), mdl.variables)
      bwd = lambda res, g: (jax.tree.map(jnp.zeros_like, res), g * 3.0)
      return nn.custom_vjp(f, fwd, bwd, grad_vars=True)(self, x)

  return M


def test_custom_vjp_forward_traced_after_apply_with_rngs():
  """``jax.grad`` of a jitted apply traces the custom_vjp's forward after
  ``apply`` has returned; the rng streams it draws from must still be the
  ones ``apply`` was given (AQT's ``test_einsum_grad_leak``)."""

  def program(nn):
    model = _custom_vjp_model(nn)()
    rngs = {'params': jax.random.key(0), 'noise': jax.random.key(5)}
    variables = model.init(rngs, jnp.ones(3))
    apply = jax.jit(lambda x: model.apply(variables, x, rngs=rngs))
    grad = jax.grad(lambda x: apply(x).sum())(jnp.full(3, 2.0))
    value = apply(jnp.full(3, 2.0))
    return grad, value

  grad, _ = assert_matches_linen(program)
  np.testing.assert_array_equal(grad, np.full(3, 3.0))


def test_custom_vjp_after_apply_keeps_no_scope_alive():
  """The fix reads the rng names at the boundary; apply still releases its
  scopes, so no module or variable outlives the call."""
  model = _custom_vjp_model(liftmods)()
  rngs = {'params': jax.random.key(0), 'noise': jax.random.key(5)}
  variables = model.init(rngs, jnp.ones(3))
  scopes = []
  original = liftmods.core.scope.Scope.__init__

  def spy(self, *args, **kwargs):
    original(self, *args, **kwargs)
    scopes.append(weakref.ref(self))

  liftmods.core.scope.Scope.__init__ = spy
  try:
    jax.grad(lambda x: jax.jit(
        lambda x: model.apply(variables, x, rngs=rngs))(x).sum())(jnp.ones(3))
  finally:
    liftmods.core.scope.Scope.__init__ = original
  gc.collect()
  alive = [r() for r in scopes if r() is not None]
  assert scopes and all(not s._variables and not s.rngs for s in alive)  # pylint: disable=protected-access


# -- boxes written against flax.core.meta ------------------------------------


class FlaxBox(flax.struct.PyTreeNode, flax_meta.AxisMetadata):
  """A box of another module system's AxisMetadata (AQT's freezer makes
  these); liftmods never imports flax, it recognises the protocol."""
  value: Any
  note: str = flax.struct.field(default='', pytree_node=False)

  def unbox(self):
    return self.value

  def replace_boxed(self, val):
    return self.replace(value=val)

  def add_axis(self, index, params):
    return self

  def remove_axis(self, index, params):
    return self


def test_third_party_boxes_are_axis_metadata():
  box = FlaxBox(jnp.ones(2), 'x')
  assert isinstance(box, meta.AxisMetadata)
  assert isinstance(flax_meta.Partitioned(jnp.ones(2), ('a',)),
                    meta.AxisMetadata)
  assert not isinstance(jnp.ones(2), meta.AxisMetadata)
  assert not isinstance(liftmods.partitioning.AxisMetadata(('a',)),
                        meta.AxisMetadata)
  assert meta.unbox({'w': box})['w'] is box.value


def test_variable_value_assignment_keeps_a_third_party_box():
  """``variable.value = x`` on a variable holding a box puts ``x`` inside the
  box (Linen does; a bare array in its place would silently drop the box's
  metadata)."""

  def program(nn):
    class Store(nn.Module):
      @nn.compact
      def __call__(self, x):
        v = self.variable('frozen', 'q', lambda: FlaxBox(jnp.zeros(3), 'qm'))
        if not self.is_initializing():
          v.value = x
        return v.value

    model = Store()
    variables = model.init(jax.random.key(0), jnp.ones(3))
    out, updated = model.apply(variables, jnp.arange(3.0), mutable=True)
    return variables, out, updated

  variables, out, updated = assert_matches_linen(program)
  assert isinstance(variables['frozen']['q'], FlaxBox)
  box = updated['frozen']['q']
  assert isinstance(box, FlaxBox) and box.note == 'qm'
  assert_identical(box.value, jnp.arange(3.0))
  assert_identical(out, jnp.arange(3.0))


class ScalesOnly(flax.struct.PyTreeNode):
  """Like AQT's QTensor: its ``shape`` property raises while it holds only
  scales (AQT's freezer stores such a tensor for an activation)."""
  qvalue: Any
  scale: Any

  @property
  def shape(self):
    assert self.qvalue is not None, 'no qvalue'
    return self.qvalue.shape


def test_variables_holding_a_pytree_whose_shape_raises():
  """Storing, reassigning and reading such a pytree as a variable and as a
  parameter, at init and apply (AQT's ``serving_conversion(...,
  weight_only=False)`` assigns one to ``variable.value``; liftmods took
  anything with a ``shape`` attribute for an array and asked for it)."""

  def program(nn):
    class Freeze(nn.Module):
      @nn.compact
      def __call__(self, x):
        tensor = ScalesOnly(None, x.sum(keepdims=True))
        frozen = self.variable('frozen', 'q', lambda: tensor)
        frozen.value = tensor
        p = self.param('p', lambda rng: ScalesOnly(None, jnp.ones(2)))
        return frozen.value.scale + p.scale

    y, variables = Freeze().init_with_output(jax.random.key(0), X)
    return y, variables, Freeze().apply(variables, X * 2, mutable=True)

  _, variables, (y, updated) = assert_matches_linen(program)
  assert isinstance(variables['params']['p'], ScalesOnly)
  assert_identical(updated['frozen']['q'].scale, (X * 2).sum(keepdims=True))
  assert_identical(y, (X * 2).sum(keepdims=True) + jnp.ones(2))


# -- the same programs as Linen ----------------------------------------------


def test_normalization_lowers_to_linens_program():
  """The normalization layers lower to Linen's StableHLO op for op (not
  only to the same values): the differential tests' liftmods side then
  loads the executables the flax side compiled from the shared persistent
  cache instead of compiling its own (AQT's Transformer block compiled its
  forward and gradient again while LayerNorm subtracted the mean before
  expanding the variance)."""

  def program(nn):
    texts = []
    for layer in (nn.LayerNorm(), nn.RMSNorm(), nn.GroupNorm(num_groups=1),
                  nn.BatchNorm(use_running_average=False)):
      variables = layer.init(jax.random.key(0), X)
      apply = jax.jit(lambda v, x, layer=layer: layer.apply(v, x,
                                                            mutable=True))
      texts.append(apply.lower(variables, X).as_text(debug_info=False))
    return texts

  assert_matches_linen(program)
