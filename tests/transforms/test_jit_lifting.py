"""How nn.jit and nn.fold_rngs lift classes: through transforms.lift_class
with a method hook, under the class names Linen gives, with the fast apply
only where ``__call__`` is compiled; and the named-call label that module.py
and nn.named_call share."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
from liftmods import jit_transform, transforms
from liftmods.core import lift
from liftmods.module import named_call_label

X = jnp.ones((2, 4))
KEY = jax.random.key(0)


class Twice(lnn.Module):
  features: int = 3

  @lnn.compact
  def __call__(self, x):
    return lnn.Dense(self.features)(x) * 2

  def other(self, x):
    return self(x) + 1


def test_jit_names_resolve_everywhere():
  assert lnn.jit is transforms.jit is jit_transform.jit
  assert lnn.fold_rngs is transforms.fold_rngs is jit_transform.fold_rngs


@pytest.mark.parametrize('lifter,name', [(lnn.jit, 'JitTwice'),
                                         (lnn.fold_rngs, 'Fold_rngsTwice')])
def test_class_names_and_partials(lifter, name):
  cls = lifter(Twice)
  assert cls.__name__ == name and issubclass(cls, Twice)
  made = lifter(functools.partial(Twice, features=5))
  assert isinstance(made, functools.partial)
  assert made.func.__name__ == name and made.keywords == {'features': 5}
  v = made().init(KEY, X)
  assert v['params']['Dense_0']['kernel'].shape == (4, 5)


def test_fast_apply_only_when_call_is_compiled():
  assert lnn.jit(Twice)._fast_apply is not None
  assert lnn.jit(Twice, methods=['other'])._fast_apply is None
  assert lnn.jit(Twice, methods={'__call__': {}})._fast_apply is not None
  assert lnn.fold_rngs(Twice)._fast_apply is None


def test_jit_methods_match_the_plain_module():
  v = Twice().init(KEY, X)
  want = Twice().apply(v, X, method='other')
  for methods in (['other'], {'other': {}}, ['__call__', 'other']):
    got = lnn.jit(Twice, methods=methods)().apply(v, X, method='other')
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match='methods must be'):
    lnn.jit(Twice, methods='other')


def test_lift_class_takes_a_method_hook():
  made = []

  def lift_method(transform, fn, fn_name, trafo_args, trafo_kwargs, cls):
    made.append((fn_name, trafo_args, trafo_kwargs, cls))
    assert transform is lift.jit

    def method(self, *args, **kwargs):
      return fn(self, *args, **kwargs) - 1

    return method

  cls = transforms.lift_class(lift.jit, 'hooked', Twice, 7, methods=['other'],
                              lift_method=lift_method, variables=True)
  assert cls.__name__ == 'HookedTwice'
  assert made == [('other', (7,), {'variables': True}, Twice)]
  assert cls.other.__name__ == 'other'
  v = Twice().init(KEY, X)
  np.testing.assert_array_equal(cls().apply(v, X, method='other'),
                                Twice().apply(v, X, method='other') - 1)


def test_named_call_label_is_shared(monkeypatch):

  class Probe(lnn.Module):

    def __call__(self, x):
      return x

    def helper(self, x):
      return x

  probe = Probe(name='p')
  assert named_call_label(probe, '__call__') == 'p'
  assert named_call_label(probe, 'helper') == 'p.helper'
  assert named_call_label(Probe(), 'helper') == 'Probe.helper'
  seen, real = [], jax.named_call

  def spy(fn, name):
    seen.append(name)
    return real(fn, name=name)

  monkeypatch.setattr(jax, 'named_call', spy)
  Probe().apply({}, X, method=lnn.named_call(Probe.helper))
  assert seen == ['Probe.helper']

  # The other user of the label: every module method call runs under
  # ``jax.named_scope`` while named calls are on.
  scopes, real_scope = [], jax.named_scope

  def scope_spy(name):
    scopes.append(name)
    return real_scope(name)

  class Outer(lnn.Module):

    @lnn.compact
    def __call__(self, x):
      probe = Probe(name='p')
      return probe.helper(probe(x))

  monkeypatch.setattr(jax, 'named_scope', scope_spy)
  with lnn.override_named_call(False):
    Outer().apply({}, X)
  assert not scopes
  with lnn.override_named_call(True):
    Outer().apply({}, X)
    Probe().apply({}, X, method='helper')
  assert scopes == ['Outer', 'p', 'p.helper', 'Probe.helper']


class InitOverride(lnn.Module):
  """A module whose jitted ``init_with_output`` runs unbound, counting the
  traces of its call in ``COUNT``."""
  features: int = 3

  @lnn.compact
  def __call__(self, x):
    COUNT.append(None)
    return lnn.Dense(self.features)(x)

  @lnn.jit
  def init_with_output(self, rngs, *args, **kwargs):
    return super().init_with_output(rngs, *args, **kwargs)


class HeldOverride(InitOverride):
  extra: tuple = ()  # not a plain value: the key is not kept


COUNT = []


def test_unbound_jit_keeps_the_key_of_a_plain_module(monkeypatch):
  COUNT.clear()
  walks = []
  for name in ('_fingerprint', '_leaf_fingerprint'):
    real = getattr(jit_transform, name)
    monkeypatch.setattr(jit_transform, name,
                        lambda m, real=real: walks.append(m) or real(m))
  plain = InitOverride()
  y, _ = plain.init_with_output(KEY, X)
  key = plain.__dict__['_unbound_jit_key']
  assert len(COUNT) == 1 and len(walks) == 1
  again, _ = plain.init_with_output(KEY, X)
  assert plain.__dict__['_unbound_jit_key'] is key
  assert len(COUNT) == 1 and len(walks) == 1  # no walk, no trace
  np.testing.assert_array_equal(again, y)
  # An equal module has an equal key: the trace is shared.
  InitOverride().init_with_output(KEY, X)
  assert len(COUNT) == 1 and len(walks) == 2
  # The active interceptors are part of the key: made afresh (from the
  # kept fingerprint), traced anew, and the new key serves while they last.
  with lnn.intercept_methods(lambda f, args, kwargs, context: f(*args,
                                                                **kwargs)):
    plain.init_with_output(KEY, X)
    plain.init_with_output(KEY, X)
  assert len(COUNT) == 2 and len(walks) == 2
  plain.init_with_output(KEY, X)
  assert len(COUNT) == 2 and len(walks) == 2
  assert InitOverride(5).init_with_output(KEY, X)[0].shape == (2, 5)


def test_unbound_jit_makes_the_key_of_other_modules_each_call():
  COUNT.clear()
  held = HeldOverride(extra=(1, 2))
  y, _ = held.init_with_output(KEY, X)
  again, _ = held.init_with_output(KEY, X)
  assert '_unbound_jit_key' not in held.__dict__
  assert len(COUNT) == 1  # still one trace: equal keys
  np.testing.assert_array_equal(again, y)
  HeldOverride(extra=(1, 3)).init_with_output(KEY, X)
  assert len(COUNT) == 2


def test_plain_fields_are_fingerprinted_once_beside_a_module_argument(
    monkeypatch):
  """A bound call whose arguments hold a module walks them for scopes, but
  the key of a module whose fields are all plain values still comes from
  the one-pass fingerprint, not from a second, general one."""
  general = []
  real = jit_transform._fingerprint
  monkeypatch.setattr(jit_transform, '_fingerprint',
                      lambda v: general.append(type(v)) or real(v))

  class Uses(lnn.Module):
    scale: float = 2.0

    def __call__(self, dense, x):
      return dense(x) * self.scale

  class Outer(lnn.Module):

    @lnn.compact
    def __call__(self, x):
      return lnn.jit(Uses)()(lnn.Dense(3), x)

  v = Outer().init(KEY, X)
  y = Outer().apply(v, X)
  assert not any(issubclass(t, Uses) for t in general)
  want = X @ v['params']['Dense_0']['kernel'] * 2.0
  np.testing.assert_allclose(y, want, rtol=1e-6)
