"""Model-wide mixed precision: one policy instead of ``dtype=`` everywhere.

A :class:`Precision` names three dtypes: ``compute_dtype`` (what layers
compute in), ``param_dtype`` (what parameters are stored in) and
``output_dtype`` (what the model hands back). :func:`precision_policy`
applies one, or a mapping from module classes and path globs to them, to
every module method that runs inside its ``with`` block, without editing
the model's code:

>>> import jax, jax.numpy as jnp
>>> import liftmods as nn
>>> class MLP(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))
>>> policy = nn.Precision(compute_dtype=jnp.bfloat16,
...                       param_dtype=jnp.float32, output_dtype=jnp.float32)
>>> x = jnp.ones((1, 3))
>>> with nn.precision_policy(policy):
...   variables = MLP().init(jax.random.key(0), x)
...   y = MLP().apply(variables, x)
>>> variables['params']['Dense_0']['kernel'].dtype, y.dtype
(dtype('float32'), dtype('float32'))

How it works: the policy is a method interceptor (see
:func:`liftmods.intercept_methods`). When a method of a bound module runs,
the policy looks up the module's entry; if the module has dataclass fields
named ``dtype`` / ``param_dtype`` (every Linen layer does: Dense,
DenseGeneral, Einsum, Conv*, Embed, the norms, attention, the RNN cells),
they are set to ``compute_dtype`` / ``param_dtype`` for the duration of the
outermost call, so the layer computes exactly as if the model had been
written with those arguments threaded through by hand. Normalisation
statistics therefore stay in float32 (as Linen's do), parameters are
created in ``param_dtype`` and their gradients come back in it. Layers'
inputs are not cast by the policy: each layer casts them as its ``dtype``
says. ``output_dtype`` casts the floating outputs of a call that enters a
policy region (the model's own method, or a module whose entry differs
from its caller's), so a loss computed from them stays in float32.

With no policy active nothing is registered and nothing runs: programs are
the ones written.
"""
import contextlib
import dataclasses
import fnmatch
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from liftmods import errors
from liftmods.core import caching
from liftmods.module import Module, current_module, intercept_methods

__all__ = ['Precision', 'PrecisionPolicyError', 'PrecisionPolicyWarning',
           'precision_policy']

_FIELDS = (('compute_dtype', 'dtype'), ('param_dtype', 'param_dtype'))


class PrecisionPolicyError(errors.LiftmodsError, ValueError):
  """A precision policy that cannot be applied: a bad dtype, a bad key or
  value in a policy mapping, or a policy entered while a module runs."""

  docs_link = 'docs/precision.md#errors'


class PrecisionPolicyWarning(UserWarning):
  """A path glob of a precision policy matched no module."""


def _checked_dtype(field: str, value):
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise PrecisionPolicyError(
        f'Precision({field}={value!r}): not a dtype; expected a floating '
        'dtype such as jnp.bfloat16, jnp.float16 or jnp.float32, or None '
        'to leave it as the code says.') from None
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise PrecisionPolicyError(
        f'Precision({field}={value!r}): expected a floating dtype such as '
        f'jnp.bfloat16 or jnp.float32, got {dtype}.')
  return dtype


@dataclasses.dataclass(frozen=True)
class Precision:
  """The dtypes of a mixed-precision policy; None leaves that dtype as the
  code says.

  Attributes:
    compute_dtype: set as the ``dtype`` field of every matched module that
      has one.
    param_dtype: set as the ``param_dtype`` field of every matched module
      that has one.
    output_dtype: floating outputs of a call entering the policy's region
      are cast to it.

  >>> import jax.numpy as jnp, liftmods as nn
  >>> nn.Precision(compute_dtype='bfloat16').compute_dtype
  dtype(bfloat16)
  """

  compute_dtype: Any = None
  param_dtype: Any = None
  output_dtype: Any = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      object.__setattr__(self, f.name,
                         _checked_dtype(f.name, getattr(self, f.name)))


def _literal_count(pattern: str) -> int:
  return sum(c not in '*?[]' for c in pattern)


class _Rules:
  """A policy spec resolved into path and class entries, chained to the
  policy of the enclosing ``with`` block (consulted when this one has no
  entry for a module)."""

  def __init__(self, spec, outer: '_Rules | None'):
    self.outer = outer
    self.paths = []  # (pattern, Precision), most specific first
    self.classes = {}
    if isinstance(spec, Precision):
      self.classes[Module] = spec
    elif isinstance(spec, Mapping):
      self._add_entries(spec)
    else:
      raise PrecisionPolicyError(
          'precision_policy expects a Precision or a mapping from module '
          'classes and path globs to Precision, got '
          f'{type(spec).__name__}.')
    self.key = (tuple(self.paths), tuple(self.classes.items()),
                outer.key if outer is not None else None)
    # A small int standing for ``key``: jax hashes the jit-key context on
    # every jitted call inside the block, so it must be cheap to hash.
    with _KEY_LOCK:
      self.number = _KEY_NUMBERS.setdefault(self.key, len(_KEY_NUMBERS))

  def _add_entries(self, spec):
    ranked = []
    for index, (key, value) in enumerate(spec.items()):
      if not isinstance(value, Precision):
        raise PrecisionPolicyError(
            f'precision_policy entry {key!r}: expected a Precision, got '
            f'{type(value).__name__}.')
      if isinstance(key, str):
        ranked.append((_literal_count(key), index, key, value))
      elif isinstance(key, type) and issubclass(key, Module):
        self.classes[key] = value
      else:
        raise PrecisionPolicyError(
            f'precision_policy key {key!r}: expected a Module subclass or '
            'a path glob (a str such as "decoder/*"), got '
            f'{type(key).__name__}.')
    ranked.sort(key=lambda r: (-r[0], -r[1]))
    self.paths = [(pattern, value) for _, _, pattern, value in ranked]

  def resolve(self, cls, path: str, seen: set):
    """``(entry, Precision)`` for a module of class ``cls`` at ``path``:
    the innermost policy with an entry wins; within one, a path glob beats a
    class, a glob with more literal characters beats one with fewer (the
    later entry on a tie), and a class beats its bases. Every glob that
    matches ``path`` is added to ``seen``."""
    found = None
    for pattern, value in self.paths:
      if fnmatch.fnmatchcase(path, pattern):
        seen.add(pattern)
        if found is None:
          found = (id(self), pattern), value
    if found is None:
      for base in cls.__mro__:
        value = self.classes.get(base)
        if value is not None:
          found = (id(self), base), value
          break
    if self.outer is not None:
      outer = self.outer.resolve(cls, path, seen)
      if found is None:
        found = outer
    return found or (None, None)


_dtype_fields: dict = {}
caching.register('precision._dtype_fields', caching.Policy(
    holds='the (Precision attribute, module field) pairs of a Module class',
    keyed_on='Module class',
    bound='one entry per class',
    cleared='never'), clear=_dtype_fields.clear)
_KEY_NUMBERS: dict = {}  # policy key -> the number standing for it
# Not clearable: a number must go on standing for its policy, or a jit
# trace made under one policy would be reused under another.
caching.register('precision._KEY_NUMBERS', caching.Policy(
    holds='the small int standing for a policy in jit\'s cache key',
    keyed_on='a policy\'s rules',
    bound='one entry per distinct policy',
    cleared='never'))
_KEY_LOCK = threading.Lock()


def _settable_fields(cls) -> tuple:
  """The (Precision attribute, module field) pairs ``cls`` has."""
  found = _dtype_fields.get(cls)
  if found is None:
    names = {f.name for f in dataclasses.fields(cls)}
    found = _dtype_fields[cls] = tuple(
        (attr, field) for attr, field in _FIELDS if field in names)
  return found


def _cast_output(y, dtype):
  def cast(leaf):
    if (isinstance(leaf, (jax.Array, np.ndarray))
        and jnp.issubdtype(leaf.dtype, jnp.inexact) and leaf.dtype != dtype):
      return jnp.asarray(leaf, dtype)
    return leaf
  return jax.tree_util.tree_map(cast, y)


class _Local(threading.local):

  def __init__(self):
    self.policies = []  # the _PolicyInterceptor of each open with block


_local = _Local()


class _PolicyInterceptor:
  """The interceptor of one ``with precision_policy(...)`` block. Equal to
  any other with the same rules, so lifted-jit caches are shared across
  blocks that apply the same policy."""

  def __init__(self, rules: _Rules, seen: set):
    self.rules = rules
    self.regions = []  # entry of each intercepted call now running
    self.changed = []  # (module, field, value before the policy)
    self.seen = seen  # path globs that matched a module (shared by nesting)
    self.resolved = {}  # (class, path) -> (entry, Precision)

  def __hash__(self):
    return self.rules.number

  def __eq__(self, other):
    return (isinstance(other, _PolicyInterceptor)
            and other.rules.number == self.rules.number)

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if _local.policies[-1] is not self or module.scope is None:
      return next_fun(*args, **kwargs)  # an inner policy decides
    key = (type(module), module.path)
    found = self.resolved.get(key)
    if found is None:
      path = '/'.join(str(p) for p in key[1])
      found = self.resolved[key] = self.rules.resolve(key[0], path, self.seen)
    entry, precision = found
    if precision is not None:
      self._set_fields(module, precision)
    regions = self.regions
    enters = entry is not None and (not regions or regions[-1] != entry)
    regions.append(entry)
    try:
      y = next_fun(*args, **kwargs)
    finally:
      regions.pop()
      if not regions:
        self._restore_fields()
    if (enters and precision.output_dtype is not None
        and context.method_name != 'setup'):
      y = _cast_output(y, precision.output_dtype)
    return y

  def _set_fields(self, module, precision):
    d = module.__dict__
    for attr, field in _settable_fields(type(module)):
      value = getattr(precision, attr)
      if value is not None and d[field] is not value:
        self.changed.append((module, field, d[field]))
        object.__setattr__(module, field, value)

  def _restore_fields(self):
    for module, field, value in reversed(self.changed):
      object.__setattr__(module, field, value)
    self.changed.clear()

  def warn_unmatched(self):
    for pattern, _ in self.rules.paths:
      if pattern not in self.seen and pattern not in _warned:
        _warned.add(pattern)
        warnings.warn(PrecisionPolicyWarning(
            f'precision_policy: the path glob {pattern!r} matched no module '
            'path in this block (paths look like "Block_0/Dense_1", '
            'without a leading slash); see docs/precision.md.'), stacklevel=4)


_warned: set = set()
caching.register('precision._warned', caching.Policy(
    holds='path globs already warned about for matching no module (each '
          'warning is given once)',
    keyed_on='path glob',
    bound='one entry per glob',
    cleared='never'))

# The active policy as part of jax.jit's cache key, so that a function
# jitted outside a policy block is traced again inside it (and vice versa).
# A jax without user contexts reuses the earlier trace.
_make_user_context = getattr(jax, 'make_user_context', None)
_JIT_KEY = _make_user_context(None) if _make_user_context else None


@contextlib.contextmanager
def precision_policy(
    policy: 'Precision | Mapping[type[Module] | str, Precision]'
) -> Iterator[None]:
  """Applies ``policy`` to the module methods run in this thread inside the block.

  ``policy`` is a :class:`Precision` (every module) or a mapping whose keys
  are Module classes (instances of the class and its subclasses) or path
  globs (``fnmatch`` patterns over paths such as ``'Block_3/Dense_0'``;
  ``*`` also crosses ``/``). The most specific entry wins: a path glob over
  a class, a glob with more literal characters over one with fewer, a class
  over its base classes, and an inner ``with`` block over an outer one;
  modules no entry matches run as written.

  The policy is read while a module method is traced, so enter it around
  ``init`` / ``apply`` (inside a ``jax.jit``-ed step is fine). It is part
  of ``jax.jit``'s cache key (through ``jax.make_user_context``) and of
  lifted ``nn.jit``'s, so a function jitted outside the block is traced
  again inside it. Entering a policy while a module method runs (part of
  the model already traced without it) raises
  :class:`PrecisionPolicyError`. A path glob that matched no module warns
  once (:class:`PrecisionPolicyWarning`) when the block ends.

  Args:
    policy: a :class:`Precision`, or ``{Module class or path glob:
      Precision}``.

  Yields:
    None, with the policy in force.

  Raises:
    PrecisionPolicyError: entered while a module method runs.

  >>> import jax, jax.numpy as jnp, liftmods as nn
  >>> bf16 = nn.Precision(compute_dtype=jnp.bfloat16)
  >>> with nn.precision_policy({nn.Dense: bf16}):
  ...   y, _ = nn.Dense(2).init_with_output(jax.random.key(0), jnp.ones((1, 3)))
  >>> y.dtype
  dtype(bfloat16)
  """
  running = current_module()
  if running is not None:
    where = running.scope.path_text if running.scope is not None else ''
    raise PrecisionPolicyError(
        'precision_policy entered inside a method of '
        f'{type(running).__name__} at {where or "/"}: part of the model has '
        'already been traced without it. Enter the policy around init / '
        'apply (the policy is read while module methods are traced).')
  enclosing = _local.policies[-1] if _local.policies else None
  if enclosing is None:
    interceptor = _PolicyInterceptor(_Rules(policy, None), set())
  else:
    interceptor = _PolicyInterceptor(_Rules(policy, enclosing.rules),
                                     enclosing.seen)
  _local.policies.append(interceptor)
  jit_key = (_JIT_KEY(interceptor.rules.number) if _JIT_KEY is not None
             else contextlib.nullcontext())
  try:
    with intercept_methods(interceptor), jit_key:
      yield
  finally:
    _local.policies.pop()
  interceptor.warn_unmatched()
