"""Error parity with flax.linen: the same wrong program raises the same error.

Each case is a function ``run(nn)`` written once against a Linen-style
namespace and run under flax.linen and under liftmods. Both must raise; the
liftmods error must have the class name of Linen's (and be an instance of
Linen's builtin base, e.g. ``ValueError``, when Linen raises a builtin), and
its message must begin with Linen's message (Linen's documentation link
removed), so that regexes written against Linen's messages keep matching.
liftmods may add detail after Linen's wording.
"""
import re
from typing import Any, Sequence

import flax.core
import flax.errors
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import liftmods as lnn
import liftmods.core
from liftmods import errors

KEY = jax.random.key(0)
X = jnp.ones((2, 3))
_URL = re.compile(r' \(https://flax\.readthedocs\.io/[^)]*\)$')


def _linen_message(exc) -> str:
  return _URL.sub('', str(exc))


def _raised(run, nn):
  try:
    run(nn)
  except Exception as e:  # pylint: disable=broad-except
    return e
  raise AssertionError(f'{nn.__name__}: no error raised')


def check(run, *, linen_regex=None, core=False):
  """Runs ``run`` under both (given ``flax.core`` / ``liftmods.core`` when
  ``core``); returns (linen_error, liftmods_error)."""
  f_err = _raised(run, flax.core if core else fnn)
  l_err = _raised(run, liftmods.core if core else lnn)
  f_cls = type(f_err)
  if isinstance(f_err, flax.errors.FlaxError):
    assert type(l_err).__name__ == f_cls.__name__, (f_err, l_err)
    assert isinstance(l_err, errors.FlaxError)
    assert isinstance(l_err, getattr(errors, f_cls.__name__))
  else:
    assert isinstance(l_err, f_cls), (f_err, l_err)
  f_msg, l_msg = _linen_message(f_err), str(l_err)
  if linen_regex is None:
    assert l_msg.startswith(f_msg), f'\nlinen:    {f_msg}\nliftmods: {l_msg}'
  else:
    assert re.match(linen_regex, f_msg), f_msg
    assert re.match(linen_regex, l_msg), l_msg
  return f_err, l_err


def _dense(nn, features=3):

  class Dense(nn.Module):

    @nn.compact
    def __call__(self, x):
      w = self.param('kernel', nn.initializers.lecun_normal(),
                     (x.shape[-1], features))
      return x @ w

  return Dense


def _outer(nn, make_inner):

  class Outer(nn.Module):

    @nn.compact
    def __call__(self, x):
      return make_inner(nn)(name='layer')(x)

  return Outer


# -- the root error class -------------------------------------------------------------


def test_flax_error_base_catches_liftmods_errors():
  assert errors.FlaxError is errors.LiftmodsError
  for name in dir(flax.errors):
    f_cls = getattr(flax.errors, name)
    l_cls = getattr(errors, name, None)
    if (isinstance(f_cls, type) and issubclass(f_cls, flax.errors.FlaxError)
        and l_cls is not None):
      assert issubclass(l_cls, errors.FlaxError), name
      for base in f_cls.__mro__:
        if base.__module__ == 'builtins' and base is not object:
          assert issubclass(l_cls, base), (name, base)


# -- scope: variables and params ---------------------------------------------------------


def test_param_shape_mismatch():

  def run(nn):
    m = _outer(nn, _dense)()
    m.apply(m.init(KEY, X), jnp.ones((2, 5)))

  check(run)


def test_param_not_found():

  def run(nn):
    _outer(nn, _dense)().apply({'params': {'layer': {'other': X}}}, X)

  check(run)


def test_collection_not_found():

  def run(nn):
    _outer(nn, _dense)().apply({}, X)

  check(run)


def _stats_reader(nn):

  class Stats(nn.Module):

    @nn.compact
    def __call__(self, x):
      return x + self.variable('stats', 'missing').value

  return Stats


def test_variable_not_found():

  def run(nn):
    _outer(nn, _stats_reader)().apply(
        {'stats': {'layer': {'other': 1.0}}}, X)

  check(run)


def test_variable_collection_not_found():

  def run(nn):
    _outer(nn, _stats_reader)().apply({'params': {}}, X)

  check(run)


def test_modify_immutable_variable():

  def make(nn):

    class Counter(nn.Module):

      @nn.compact
      def __call__(self, x):
        n = self.variable('stats', 'n', lambda: jnp.zeros(()))
        n.value += 1
        return x

    return Counter

  def run(nn):
    m = _outer(nn, make)()
    m.apply(m.init(KEY, X), X)

  check(run)


def test_put_variable_immutable():

  def run(nn):

    class M(nn.Module):

      @nn.compact
      def __call__(self, x):
        self.put_variable('stats', 'n', 1.0)
        return x

    M().apply({}, X)

  check(run)


@pytest.mark.parametrize('what', ['param', 'variable', 'submodule',
                                  'param_vs_submodule', 'setup_submodule'])
def test_name_in_use(what):

  def run(nn):

    class Dummy(nn.Module):

      @nn.compact
      def __call__(self, x):
        if what == 'param':
          self.param('bias', nn.initializers.zeros, (3,))
          self.param('bias', nn.initializers.zeros, (3,))
        elif what == 'variable':
          self.variable('stats', 'mean', jnp.zeros, (3,))
          self.variable('stats', 'mean', jnp.zeros, (3,))
        elif what == 'submodule':
          nn.Dense(3, name='proj')(x)
          nn.Dense(3, name='proj')(x)
        else:
          nn.Dense(3, name='proj')(x)
          self.param('proj', nn.initializers.zeros, (3,))
        return x

    class WithSetup(nn.Module):

      def setup(self):
        self.a = nn.Dense(3, name='same')
        self.b = nn.Dense(3, name='same')

      def __call__(self, x):
        return self.a(x) + self.b(x)

    model = WithSetup() if what == 'setup_submodule' else Dummy()
    model.init(KEY, X)

  check(run)


def test_name_in_use_message_matches_issue_example():
  _, err = check(lambda nn: _name_clash(nn).init(KEY, X))
  assert str(err).startswith(
      'Could not create param "bias" in Module Dummy: Name in use')


def _name_clash(nn):

  class Dummy(nn.Module):

    @nn.compact
    def __call__(self, x):
      self.param('bias', nn.initializers.zeros, (3,))
      self.param('bias', nn.initializers.zeros, (3,))
      return x

  return Dummy()


def test_core_duplicate_scope_name():

  def run(core):

    def f(scope, x):
      scope.param('w', jax.nn.initializers.zeros, (3,))
      scope.param('w', jax.nn.initializers.zeros, (3,))
      return x

    core.init(f)(KEY, X)

  f_err, _ = check(run, core=True)
  assert type(f_err) is ValueError


# -- rngs ----------------------------------------------------------------------


def test_missing_rng_in_submodule():

  def make(nn):

    class Noisy(nn.Module):

      @nn.compact
      def __call__(self, x):
        return x + jax.random.normal(self.make_rng('noise'), x.shape)

    return Noisy

  def run(nn):
    _outer(nn, make)().apply({}, X)

  check(run)


def test_dropout_needs_prng():

  def run(nn):

    class Model(nn.Module):

      @nn.compact
      def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(x)

    Model().apply({}, X)

  f_err, _ = check(run)
  assert str(f_err).startswith('Dropout_0 needs PRNG for "dropout"')


@pytest.mark.parametrize('entry', ['init', 'apply'])
def test_rngs_not_a_key(entry):

  def run(nn):
    m = _dense(nn)()
    if entry == 'init':
      m.init('not a key', X)
    else:
      m.apply({'params': {'kernel': jnp.ones((3, 3))}}, X, rngs=3)

  check(run)


def test_rng_dict_with_bad_key():

  def run(nn):
    _dense(nn)().init({'params': 'x'}, X)

  check(run)


# -- apply's variables ----------------------------------------------------------------


@pytest.mark.parametrize('variables', [{'params': 3}, {3: {}}])
def test_apply_variables_type(variables):

  def run(nn):
    _dense(nn)().apply(variables, X)

  check(run)


def test_apply_variables_extra_params_layer():

  def run(nn):
    m = _dense(nn)()
    m.apply({'params': m.init(KEY, X)}, X)

  check(run)


@pytest.mark.parametrize('use', ['put_variable', 'push', 'make_rng'])
def test_invalid_scope_after_init(use):

  def run(core):
    kept = []

    def f(scope, x):
      kept.append(scope)
      return x

    core.init(f)(KEY, X)
    scope = kept[0]
    if use == 'put_variable':
      scope.put_variable('params', 'w', 1.0)
    elif use == 'push':
      scope.push('child')
    else:
      scope.make_rng('params')

  check(run, core=True)


@pytest.mark.parametrize('entry', ['init', 'apply', 'bind'])
def test_core_rng_not_a_key(entry):

  def run(core):
    rngs = {'params': 'not a key'}
    if entry == 'init':
      core.init(lambda scope: 0)(rngs)
    elif entry == 'apply':
      core.apply(lambda scope: 0)({}, rngs=rngs)
    else:
      core.bind({}, rngs=rngs)

  check(run, core=True)


def test_core_missing_rng_at_root():

  def run(core):
    core.apply(lambda scope: scope.make_rng('dropout'))({})

  check(run, core=True)


def test_invalid_filter():

  def run(nn):
    m = _dense(nn)()
    m.apply(m.init(KEY, X), X, mutable=3)

  check(run)


# -- Module definition and use ---------------------------------------------------------


def test_set_attribute_frozen():

  def run(nn):

    class Foo(nn.Module):
      i: int = 1

      @nn.compact
      def __call__(self, x):
        self.i = 2
        return x

    Foo().init(KEY, X)

  f_err, _ = check(run)
  assert _linen_message(f_err).startswith(
      "Can't set i=2 for Module of type Foo: Module instance is frozen "
      'outside of setup method.')


def test_set_attribute_of_submodule_in_setup():

  def run(nn):

    class Foo(nn.Module):

      def setup(self):
        self.dense = nn.Dense(3)
        self.dense.features = 4

      def __call__(self, x):
        return self.dense(x)

    Foo().init(KEY, X)

  check(run)


def test_set_field_in_setup():

  def run(nn):

    class Foo(nn.Module):
      n: int = 3

      def setup(self):
        self.n = 4

      def __call__(self, x):
        return x

    Foo().init(KEY, X)

  check(run)


def test_reserved_field_name():

  def run(nn):

    class Foo(nn.Module):
      parent: int

    return Foo

  check(run)


def test_submodule_outside_setup_and_compact():

  def run(nn):

    class Foo(nn.Module):

      def __call__(self, x):
        return nn.Dense(3)(x)

    Foo().init(KEY, X)

  check(run)


_NO_ARGS = lambda: None  # noqa: E731 (the same object for both backends)


@pytest.mark.parametrize('method', [3, _NO_ARGS])
def test_apply_invalid_method(method):

  def run(nn):
    m = _dense(nn)()
    m.apply(m.init(KEY, X), X, method=method)

  check(run)


def test_method_name_not_callable():

  def run(nn):

    class Foo(nn.Module):
      n: int = 3

      def __call__(self, x):
        return x

    Foo().apply({}, X, method='n')

  check(run)


def test_call_compact_on_unbound():

  def run(nn):
    _dense(nn)()(X)

  _, err = check(run)
  assert str(err).startswith("Can't call compact methods on unbound modules")


def test_call_setup_on_unbound():

  def run(nn):

    class Foo(nn.Module):

      def setup(self):
        self.d = nn.Dense(3)

    Foo().setup()

  check(run)


def test_unbind_unbound():
  check(lambda nn: _dense(nn)().unbind())


def test_init_on_class():
  check(lambda nn: _dense(nn).init(KEY, X))


def test_post_init_without_super():

  def run(nn):

    class Foo(nn.Module):

      def __post_init__(self):
        pass

      @nn.compact
      def __call__(self, x):
        return x

    Foo().init(KEY, X)

  check(run)


@pytest.mark.parametrize('what', [
    'has_variable', 'is_mutable_collection', 'has_rng', 'make_rng',
    'is_initializing', 'variables', 'get_variable', 'put_variable', 'sow',
    'path'])
def test_unbound_module_methods(what):

  def run(nn):
    m = nn.Dense(3)
    calls = {
        'has_variable': lambda: m.has_variable('params', 'kernel'),
        'is_mutable_collection': lambda: m.is_mutable_collection('params'),
        'has_rng': lambda: m.has_rng('params'),
        'make_rng': lambda: m.make_rng('params'),
        'is_initializing': m.is_initializing,
        'variables': lambda: m.variables,
        'get_variable': lambda: m.get_variable('params', 'kernel'),
        'put_variable': lambda: m.put_variable('params', 'kernel', 1.0),
        'sow': lambda: m.sow('intermediates', 'h', 1.0),
        'path': lambda: m.path,
    }
    calls[what]()

  check(run)


@pytest.mark.parametrize('what', ['param', 'variable'])
def test_variable_outside_setup_and_compact(what):

  def run(nn):

    class Foo(nn.Module):

      def __call__(self, x):
        if what == 'param':
          return x + self.param('w', nn.initializers.zeros, (3,))
        return x + self.variable('stats', 'w', jnp.zeros, (3,)).value

    Foo().init(KEY, X)

  check(run)


def test_hash_of_unhashable_module():

  def run(nn):

    class Foo(nn.Module):
      table: Any = None

    hash(Foo(table=np.ones(2)))

  check(run, linen_regex=r'Failed to hash Flax Module\.  The module probably '
        r'contains unhashable attributes\.  Module=Foo\(')


def test_hash_of_bound_module():

  def run(nn):
    m = nn.Dense(3)
    hash(m.bind(m.init(KEY, X)))

  check(run)


# -- transforms ----------------------------------------------------------------------


@pytest.mark.parametrize('transform', ['vmap', 'jit', 'remat'])
def test_transform_target(transform):
  target = 3

  def run(nn):
    getattr(nn, transform)(target)

  check(run)


def test_transformed_method_returns_module():

  def run(nn):

    class Foo(nn.Module):

      @nn.compact
      def __call__(self, x):
        nn.Dense(3)(x)
        return self

    nn.remat(Foo)().init(KEY, X)

  _, err = check(run)
  assert 'cannot return Modules or Variables' in str(err)


def test_partitioned_variable_without_partition_name():

  def run(nn):

    class Foo(nn.Module):

      @nn.compact
      def __call__(self, x):
        w = self.param('w', nn.with_partitioning(nn.initializers.ones, ('a',)),
                       (3,))
        return x * w

    nn.vmap(Foo, variable_axes={'params': 0}, split_rngs={'params': True},
            in_axes=0)().init(KEY, jnp.ones((2, 3)))

  check(run, linen_regex=r'Trying to transform a Partitioned variable but '
         r'"partition_name" is not specified in metadata_params: ')


# -- layers --------------------------------------------------------------------------


def _layer_case(make, x):

  def run(nn):
    make(nn).init(KEY, x)

  return run


LAYER_CASES = {
    'empty_sequential': (lambda nn: nn.Sequential([]), X),
    'sequential_not_sequence': (lambda nn: nn.Sequential(3), X),
    'einsum_implicit': (lambda nn: nn.Einsum((3, 4), 'ab,bc'), X),
    'einsum_three_operands': (lambda nn: nn.Einsum((3, 4), 'ab,bc,cd->ad'), X),
    'conv_bad_padding': (lambda nn: nn.Conv(2, (3,), padding=(1, 2, 3)),
                         jnp.ones((1, 5, 2))),
    'conv_causal_2d': (lambda nn: nn.Conv(2, (3, 3), padding='CAUSAL'),
                       jnp.ones((1, 5, 5, 2))),
    'conv_mask_shape': (lambda nn: nn.Conv(2, (3,), mask=jnp.ones((2, 2, 2))),
                        jnp.ones((1, 5, 2))),
    'dense_general_batch_dims': (
        lambda nn: nn.DenseGeneral(3, axis=-1, batch_dims=(1,)),
        jnp.ones((2, 2, 3))),
    'embed_float_input': (lambda nn: nn.Embed(4, 3), jnp.ones((2,))),
    'group_norm_axes': (lambda nn: nn.GroupNorm(1, reduction_axes=(1,)),
                        jnp.ones((2, 3, 4))),
    'group_norm_both_none': (
        lambda nn: nn.GroupNorm(num_groups=None, group_size=None),
        jnp.ones((2, 4))),
    'group_norm_size': (lambda nn: nn.GroupNorm(num_groups=None, group_size=3),
                        jnp.ones((2, 4))),
    'group_norm_groups': (lambda nn: nn.GroupNorm(num_groups=3),
                          jnp.ones((2, 4))),
    'instance_norm_feature_axis': (lambda nn: nn.InstanceNorm(feature_axes=0),
                                   jnp.ones((2, 3, 4))),
    'batch_norm_train_missing': (lambda nn: nn.BatchNorm(), X),
    'dropout_deterministic_missing': (lambda nn: nn.Dropout(0.5), X),
}


@pytest.mark.parametrize('case', sorted(LAYER_CASES))
def test_layer_errors(case):
  check(_layer_case(*LAYER_CASES[case]))


def test_batch_norm_train_given_twice():

  def run(nn):
    nn.BatchNorm(use_running_average=True).init(KEY, X,
                                                 use_running_average=False)

  check(run)


def test_einsum_message_prefixes():
  _, err = check(_layer_case(*LAYER_CASES['einsum_implicit']))
  assert str(err).startswith(
      '`einsum_str` equation must be explicit and include "->".')


@pytest.mark.parametrize('case', ['both_kv', 'v_without_k'])
def test_attention_input_errors(case):

  def run(nn):
    m = nn.MultiHeadDotProductAttention(num_heads=1)
    if case == 'both_kv':
      m.init(KEY, X, X, inputs_kv=X)
    else:
      m.init(KEY, X, inputs_v=X)

  check(run)


def test_attention_decode_cache_shape():

  def run(nn):
    m = nn.MultiHeadDotProductAttention(num_heads=1, decode=True)
    x = jnp.ones((1, 4, 3))
    v = m.init(KEY, x)
    # longer than the cache (liftmods takes a prompt up to its length)
    m.apply(v, jnp.ones((1, 5, 3)), mutable=['cache'])

  check(run)


def test_attention_decode_without_cache():

  def run(nn):
    m = nn.MultiHeadDotProductAttention(num_heads=1, decode=True)
    x = jnp.ones((1, 4, 3))
    v = m.init(KEY, x)
    m.apply({'params': v['params']}, x[:, :1])

  check(run)


def test_merge_param():
  for a, b in ((None, None), (1, 2)):
    def run(nn):
      nn.merge_param('train', a, b)

    check(run)
