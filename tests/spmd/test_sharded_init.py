"""``nn.init_sharded`` on one device: a call signature is traced and
compiled once, later calls (``init_fn`` and ``lower``) reuse it, and the
logical-name check walks the variables once. (Placement on a real mesh is
in spmd_mesh_cases.py.)"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import liftmods as nn
from liftmods import sharded_init
from liftmods.call_context import record_calls
from liftmods.core import caching
from program_compare import assert_match, optimized_hlo

KEY = jax.random.key(0)
X = jnp.ones((2, 4))
RULES = (('embed', None), ('mlp', 'model'))
MESH = jax.make_mesh((1,), ('model',), axis_types=(AxisType.Auto,))
TRACES = []  # one entry per trace of Counted's call


@pytest.fixture(name='traces')
def fresh_traces():
  TRACES.clear()
  return TRACES


class Counted(nn.Module):
  """A Dense layer that counts the traces of its call in ``TRACES``."""
  features: int = 3

  @nn.compact
  def __call__(self, x, scale=1.0):
    TRACES.append(x.shape)
    return nn.Dense(self.features, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'mlp')))(x) * scale


def kernel(variables):
  return np.asarray(variables['params']['Dense_0']['kernel'])


def test_a_signature_is_traced_once_and_reused(traces):
  init = nn.init_sharded(Counted(), MESH, RULES)
  variables, shardings = init(KEY, X)
  first = len(traces)  # the shape trace and the jit's trace
  again, same_shardings = init(KEY, X)
  init.lower(KEY, X)
  assert len(traces) == first
  assert same_shardings is shardings
  np.testing.assert_array_equal(kernel(again), kernel(variables))
  # The key is an argument: another key gives other values, untraced.
  other, _ = init(jax.random.key(1), X)
  assert len(traces) == first
  assert not np.array_equal(kernel(other), kernel(variables))
  # Bitwise where the sharded init compiles to the plain jit's program (on
  # one device, the same but for sharding annotations); otherwise to float32
  # rounding of the initializer's arithmetic (a few ulps).
  plain = jax.jit(Counted().init)
  assert_match(kernel(other),
               kernel(nn.unbox(plain(jax.random.key(1), X))),
               [(optimized_hlo(init, jax.random.key(1), X),
                 optimized_hlo(plain, jax.random.key(1), X))],
               rtol=1e-6, atol=1e-7)


def test_another_signature_is_traced_again(traces):
  init = nn.init_sharded(Counted(), MESH, RULES)
  init(KEY, X)
  first = len(traces)
  variables, shardings = init(KEY, jnp.ones((2, 6)))  # another shape
  assert len(traces) == 2 * first
  assert kernel(variables).shape == (6, 3)
  assert shardings['params']['Dense_0']['kernel'].spec == jax.sharding.PartitionSpec(
      None, 'model')
  # A plain argument's value and type are part of the signature.
  init(KEY, X, scale=2.0)
  init(KEY, X, scale=2)
  assert len(traces) == 4 * first
  init(KEY, X, scale=2)
  assert len(traces) == 4 * first
  # So are the rules, when they come from the context.
  context_init = nn.init_sharded(Counted(), MESH)
  with nn.logical_axis_rules(RULES):
    _, by_rules = context_init(KEY, X)
  with nn.logical_axis_rules((('embed', None), ('mlp', None))):
    _, unsharded = context_init(KEY, X)
  assert len(traces) == 6 * first
  assert by_rules['params']['Dense_0']['kernel'].spec[1] == 'model'
  assert unsharded['params']['Dense_0']['kernel'].spec[1] is None


def test_watched_calls_and_clear_caches_trace_again(traces):
  init = nn.init_sharded(Counted(), MESH, RULES)
  init(KEY, X)
  first = len(traces)
  with record_calls():  # a recording block sees every call's trace
    init(KEY, X)
  assert len(traces) == 2 * first
  init(KEY, X)
  assert len(traces) == 2 * first
  caching.clear_caches()
  init(KEY, X)
  assert len(traces) == 3 * first


def test_the_name_check_walks_the_variables_once(monkeypatch):
  walks = []
  real = sharded_init._logical_boxes

  def counted(boxed):
    walks.append(None)
    return real(boxed)

  monkeypatch.setattr(sharded_init, '_logical_boxes', counted)
  rules = (('embed', None), ('mpl', 'model'))  # 'mlp' misspelled
  with pytest.warns(nn.LogicalNamesWarning, match=r"'mpl' \(did you mean "
                    r"'mlp'\?\)") as caught:
    nn.init_sharded(Counted(), MESH, rules)(KEY, X)
  assert len(walks) == 1
  assert caught[0].filename == __file__  # still points at the call
  with warnings.catch_warnings():
    warnings.simplefilter('error', nn.LogicalNamesWarning)
    nn.init_sharded(Counted(), MESH, rules, warn_unmapped=False)(KEY, X)
  assert len(walks) == 1


class Options:
  """A plain argument that cannot be hashed (it defines ``__eq__`` only)."""

  def __init__(self, factor):
    self.factor = factor

  def __eq__(self, other):
    return isinstance(other, Options) and other.factor == self.factor

  __hash__ = None


class Optioned(Counted):

  @nn.compact
  def __call__(self, x, options=None):
    return super().__call__(x, scale=options.factor)


def test_an_unhashable_plain_argument_is_prepared_each_call(traces):
  init = nn.init_sharded(Optioned(), MESH, RULES)
  variables, _ = init(KEY, X, options=Options(2.0))
  first = len(traces)
  again, _ = init(KEY, X, options=Options(2.0))
  assert len(traces) == 2 * first  # nothing kept: traced afresh
  np.testing.assert_array_equal(kernel(again), kernel(variables))
