"""The Scope: a cursor into a variable store plus the PRNG sequences of one
position in a model.

The store is a plain dict ``{collection: {name: value or nested dict}}``.
A child scope (``push``) views the sub-dict named after it in every
collection. Writes need the collection to be mutable. ``init``/``apply``
build a root scope around user variables (copying only the collections that
may be written, so the caller's dict is never mutated).

>>> import jax, jax.numpy as jnp
>>> from liftmods.core import init, apply
>>> def dense(scope, x, features):
...   w = scope.param('kernel', jax.nn.initializers.lecun_normal(),
...                   (x.shape[-1], features))
...   return x @ w
>>> y, variables = init(dense)(jax.random.key(0), jnp.ones((2, 3)), 4)
>>> variables['params']['kernel'].shape
(3, 4)
>>> apply(dense)(variables, jnp.ones((2, 3)), 4).shape
(2, 4)
"""
import contextlib
import functools
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np

from liftmods import errors
from liftmods.core import meta, partial_eval
from liftmods.core import caching, filters
from liftmods.core.filters import in_filter
from liftmods.config import FLAG_VALUES
from liftmods.core.frozen_dict import FrozenDict, freeze, unfreeze
from liftmods.core.init_shapes import expected_shapes
from liftmods.core.rngs import LazyKey, as_lazy
from liftmods.traceback_util import api_boundary

PRNGKey = jax.Array

_EMPTY = FrozenDict()
_CHILD = object()  # tags child-scope entries in rng_counters
_creations: list | None = None  # see created_variables


@contextlib.contextmanager
def created_variables():
  """Collects ``(scope, collection, name, value)`` for every variable
  created inside the block, ``value`` being what it was created with (a loop
  whose body creates variables starts from those values).

  >>> from liftmods.core import bind
  >>> scope = bind({}, mutable=True)
  >>> with created_variables() as created:
  ...   n = scope.variable('counts', 'n', lambda: 0)
  ...   n.value += 5
  >>> [(col, name, value) for _, col, name, value in created]
  [('counts', 'n', 0)]
  """
  global _creations
  outer, _creations = _creations, []
  try:
    yield _creations
  finally:
    _creations = outer


def note_creation(scope: 'Scope', col: str, name: str):
  """Called right after a variable is created, for ``created_variables``
  (a no-op outside it)."""
  if _creations is not None:
    _creations.append((scope, col, name, scope.get_variable(col, name)))


class Variable:
  """A reference to one variable of a scope; read and write via ``.value``.

  Args:
    scope: the scope holding the variable.
    collection: its collection.
    name: its name in the scope.
    unbox: ``.value`` returns the value inside an axis-metadata box.

  >>> from liftmods.core import bind
  >>> scope = bind({'counts': {'n': 0}}, mutable=['counts'])
  >>> v = scope.variable('counts', 'n')
  >>> v.value += 1
  >>> scope.variables()['counts']['n']
  1
  """

  __slots__ = ('scope', 'collection', 'name', 'unbox')

  def __init__(self, scope: 'Scope', collection: str, name: str,
               unbox: bool = True):
    self.scope = scope
    self.collection = collection
    self.name = name
    self.unbox = unbox

  @property
  def value(self):
    v = self.scope.get_variable(self.collection, self.name)
    return meta.unbox(v) if self.unbox and not _is_array(v) else v

  @value.setter
  def value(self, new):
    if self.unbox:
      old = self.scope.get_variable(self.collection, self.name)
      if _has_boxes(old) and _same_structure(meta.unbox(old), new):
        new = meta.replace_boxed(old, new)
    self.scope.put_variable(self.collection, self.name, new)

  def is_mutable(self) -> bool:
    return self.scope.is_mutable_collection(self.collection)

  def __repr__(self):
    return f'Variable({self.scope.path_text}, {self.collection}/{self.name})'


def _is_array(x) -> bool:
  """A plain array or tracer: no box inside, one leaf. By type, not by a
  ``shape`` attribute, which a pytree may have as a property that raises
  (AQT's QTensor while it holds only scales)."""
  kind = type(x)
  if kind in _ARRAY_TYPES:  # the common case, without jax.Array's check
    return True
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    _ARRAY_TYPES.add(kind)
    return True
  return False


_ARRAY_TYPES: set = set()  # concrete array and tracer types seen
caching.register('core.scope._ARRAY_TYPES', caching.Policy(
    holds='concrete array and tracer types seen by `_is_array`',
    keyed_on='type',
    bound='one entry per type',
    cleared='never'), clear=_ARRAY_TYPES.clear)


def _has_boxes(tree) -> bool:
  if isinstance(tree, meta.AxisMetadata):
    return True
  if _is_array(tree):  # nothing to walk
    return False
  return any(isinstance(x, meta.AxisMetadata) for x in
             jax.tree_util.tree_leaves(tree, is_leaf=meta.is_axis_metadata))


def _same_structure(a, b) -> bool:
  return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b))


def _merge_put(target: dict, value: Mapping):
  """Writes the entries of ``value`` into the existing dict ``target`` in
  place (recursively), so child scopes that already hold ``target`` see the
  new values. Entries of ``target`` missing from ``value`` stay, as in
  Linen."""
  for k, v in value.items():
    if k in target and type(target[k]) is dict and isinstance(v, Mapping):
      _merge_put(target[k], v)
    else:
      target[k] = v


class Scope:
  """One position in the model: variables, rngs, names reserved there.

  Made by ``bind``/``init``/``apply`` (roots) and ``Scope.push`` (children),
  not usually by hand.

  Args:
    variables: ``{collection: {name: value}}`` of this position.
    rngs: ``{sequence name: key}``.
    name: the scope's name in its parent.
    mutable: the filter of the collections that may be written.
    parent: the parent scope (None for a root).
    path: the names from the root to this scope.
    flags: read-only settings shared by the tree (e.g. ``initializing``).
  """

  __slots__ = ('_variables', 'parent', 'root', 'name', 'path', 'rngs',
               'rng_counters', 'mutable', 'reservations', 'flags', '_invalid',
               '_mutability', '_tree', '__weakref__')

  def __init__(self, variables: dict, rngs: Mapping | None = None,
               name: str | None = None, mutable: Any = False,
               parent: 'Scope | None' = None, path: tuple = (),
               flags: Mapping | None = None):
    self._variables = variables
    self.parent = parent
    self.root = parent.root if parent is not None else self
    self.name = name
    self.path = tuple(path)
    if rngs:
      self.rngs = {k: as_lazy(k, v) for k, v in rngs.items()}
      self.rng_counters = {k: 0 for k in self.rngs}
    else:
      self.rngs, self.rng_counters = {}, {}
    self.mutable = mutable
    self.reservations = {}
    self.flags = flags if flags is not None else {}
    self._invalid = False
    shared = parent is not None and parent.mutable is mutable
    self._mutability = parent._mutability if shared else {}
    self._tree = []  # every scope derived from this one, for release()

  # -- identity and validity ------------------------------------------------

  @property
  def path_text(self) -> str:
    return '/' + '/'.join(self.path)

  @property
  def invalid(self) -> bool:
    return self._invalid

  def invalidate(self):
    self._invalid = True

  @contextlib.contextmanager
  def temporary(self):
    """A context giving this scope and invalidating it on exit."""
    try:
      yield self
    finally:
      self.invalidate()

  def release(self):
    """Drop the variables and rngs of this scope and every scope derived
    from it. Modules bound to them form reference cycles, so without this
    the arrays (or tracers, under a jax transform) would stay alive until
    the garbage collector runs."""
    for scope in [self, *self._tree]:
      scope._variables = {}
      scope.rngs = {}
    self._tree.clear()

  def _check_valid(self):
    if self._invalid:
      raise errors.InvalidScopeError(self.name)

  def __repr__(self):
    return f'Scope({self.path_text})'

  # -- naming ----------------------------------------------------------------

  def name_reserved(self, name: str, col: str | None = None) -> bool:
    """Whether ``name`` is taken by a child (col None) or by a variable of
    ``col``. Variables of different collections may share a name."""
    taken = self.reservations.get(name)
    if taken is None:
      return False
    return None in taken or col is None or col in taken

  def reserve(self, name: str, col: str | None = None):
    if not isinstance(name, str):
      raise TypeError(f'Scope and variable names must be str, got {name!r} '
                      f'at {self.path_text}')
    if self.name_reserved(name, col):
      kind = 'submodule' if col is None else 'variable'
      raise errors.NameInUseError(kind, name, None, col, self.path_text)
    self.reservations.setdefault(name, set()).add(col)

  def default_name(self, prefix: str) -> str:
    """The first unreserved name ``prefix0``, ``prefix1``, ..."""
    i = 0
    while f'{prefix}{i}' in self.reservations:
      i += 1
    return f'{prefix}{i}'

  def push(self, name: str | None = None, prefix: str = '',
           reuse: bool = False) -> 'Scope':
    """Returns the child scope ``name`` (reserving it unless ``reuse``)."""
    self._check_valid()
    if name is None:
      name = self.default_name(prefix)
    if not reuse or name not in self.reservations:
      self.reserve(name)
    child = Scope.__new__(Scope)
    child._variables = {}
    child.parent = self
    child.root = self.root
    child.name = name
    child.path = self.path + (name,)
    child.rngs = {k: v.child(name) for k, v in self.rngs.items()}
    key = (_CHILD, name)
    counters = self.rng_counters.get(key)
    if counters is None:
      counters = self.rng_counters[key] = {k: 0 for k in child.rngs}
    child.rng_counters = counters
    child.mutable = self.mutable
    child.reservations = {}
    child.flags = self.flags
    child._invalid = False
    child._mutability = self._mutability
    child._tree = self._tree
    self._tree.append(child)
    return child

  def rewound(self, rewind_rngs: bool = False) -> 'Scope':
    """The same position with reservations cleared (used when a compact
    method runs again); rng counters are kept unless ``rewind_rngs``."""
    self._check_valid()
    scope = Scope.__new__(Scope)
    scope._variables = self._variables
    scope.parent = self.parent
    scope.root = self.root if self.parent is not None else scope
    scope.name = self.name
    scope.path = self.path
    scope.rngs = self.rngs
    scope.rng_counters = ({k: 0 for k in self.rngs} if rewind_rngs
                          else self.rng_counters)
    scope.mutable = self.mutable
    scope.reservations = {}
    scope.flags = self.flags
    scope._invalid = False
    scope._mutability = self._mutability
    scope._tree = self._tree
    self._tree.append(scope)
    return scope

  # -- collections -----------------------------------------------------------

  def is_mutable_collection(self, col: str) -> bool:
    cached = self._mutability.get(col)
    if cached is None:
      cached = self._mutability[col] = in_filter(self.mutable, col)
    return cached

  def _collection(self, col: str) -> Mapping:
    """This scope's dict in ``col`` for reading (empty if absent)."""
    found = self._variables.get(col)
    if found is not None:
      return found
    if self.parent is None:
      return _EMPTY
    found = self.parent._collection(col).get(self.name)
    if found is None:
      return _EMPTY
    self._variables[col] = found
    return found

  def _mutable_collection(self, col: str) -> dict:
    """This scope's dict in ``col`` for writing, created if absent."""
    found = self._variables.get(col)
    if found is not None:
      return found
    if self.parent is None:
      found = self._variables[col] = {}
      return found
    parent_col = self.parent._mutable_collection(col)
    found = parent_col.get(self.name)
    if found is None:
      found = parent_col[self.name] = {}
    self._variables[col] = found
    return found

  def is_collection_empty(self, col: str) -> bool:
    """Whether ``col`` is absent or empty at the root (Linen's meaning: a
    collection that holds nothing anywhere in the model)."""
    return not self.root._variables.get(col)

  def variables(self) -> dict:
    """All of this scope's collections, ``{collection: {name: value}}``."""
    out = {}
    for col in self.root._variables:
      found = self._collection(col)
      if found is not _EMPTY:
        out[col] = found
    return out

  def mutable_variables(self) -> dict:
    """The collections of this scope that may be written."""
    return {k: v for k, v in self.variables().items()
            if self.is_mutable_collection(k)}

  # -- variables -------------------------------------------------------------

  def has_variable(self, col: str, name: str) -> bool:
    return name in self._collection(col)

  def get_variable(self, col: str, name: str, default: Any = None) -> Any:
    return self._collection(col).get(name, default)

  def put_variable(self, col: str, name: str, value: Any):
    self._check_valid()
    if not self.is_mutable_collection(col):
      raise errors.ModifyScopeVariableError(col, name, self.path_text)
    target = self._mutable_collection(col)
    if name in target and type(target[name]) is dict and isinstance(
        value, Mapping):
      _merge_put(target[name], value)
    else:
      target[name] = value

  def variable(self, col: str, name: str, init_fn: Callable | None = None,
               *init_args, unbox: bool = True, **init_kwargs) -> Variable:
    """Declares variable ``name`` in ``col``, creating it with
    ``init_fn(*init_args)`` if it does not exist and ``col`` is mutable."""
    self.reserve(name, col)
    if not self.has_variable(col, name):
      if not self.is_mutable_collection(col) or init_fn is None:
        if self.is_collection_empty(col):
          raise errors.ScopeCollectionNotFound(col, name, self.path_text)
        raise errors.ScopeVariableNotFoundError(name, col, self.path_text)
      self.put_variable(col, name, init_fn(*init_args, **init_kwargs))
      note_creation(self, col, name)
    return Variable(self, col, name, unbox=unbox)

  def param(self, name: str, init_fn: Callable, *init_args,
            unbox: bool = True, **init_kwargs) -> Any:
    """Returns parameter ``name``, creating it with
    ``init_fn(make_rng('params'), *init_args)`` when initializing. A stored
    value whose shape differs from what ``init_fn`` makes is an error."""
    self.reserve(name, 'params')
    params = self._collection('params')
    if name in params:
      value = params[name]
      is_array = _is_array(value)
      if unbox and not is_array:
        value = meta.unbox(value)
        is_array = _is_array(value)
      _check_shapes(name, self, value, is_array, init_fn, init_args,
                    init_kwargs)
      return value
    if not self.is_mutable_collection('params'):
      if self.is_collection_empty('params'):
        raise errors.ScopeCollectionNotFound('params', name, self.path_text)
      raise errors.ScopeParamNotFoundError(name, self.path_text)
    value = init_fn(self.make_rng('params'), *init_args, **init_kwargs)
    self.put_variable('params', name, value)
    note_creation(self, 'params', name)
    if not unbox or _is_array(value):
      return value
    try:
      return meta.unbox(value)
    except errors.MeshAxisNotFoundError as e:
      raise e.at(f'param "{name}" of {self.path_text}') from None

  def child(self, fn: Callable, name: str | None = None,
            prefix: str | None = None, named_call: bool = True,
            **partial_kwargs) -> Callable:
    """``fn`` with a child scope (reserved now) as its first argument; the
    variables are reused when the result is called again.

    >>> import jax, jax.numpy as jnp
    >>> from liftmods.core import init
    >>> def bias(scope, x):
    ...   return x + scope.param('b', jax.nn.initializers.ones, x.shape[-1:])
    >>> def model(scope, x):
    ...   return scope.child(bias, 'first')(x)
    >>> _, variables = init(model)(jax.random.key(0), jnp.zeros(2))
    >>> variables['params']['first']['b']
    Array([1., 1.], dtype=float32)
    """
    if name is None:
      if prefix is None:
        prefix = fn.__name__ + '_' if hasattr(fn, '__name__') else ''
      name = self.default_name(prefix)
    scope = self.push(name)

    @functools.wraps(fn)
    def with_child(*args, **kwargs):
      kwargs = {**partial_kwargs, **kwargs}
      if named_call:
        with jax.named_scope(name):
          return fn(scope.rewound(), *args, **kwargs)
      return fn(scope.rewound(), *args, **kwargs)

    return with_child

  # -- rngs ------------------------------------------------------------------

  def has_rng(self, name: str) -> bool:
    return name in self.rngs

  def make_rng(self, name: str = 'params'):
    """A fresh key of sequence ``name``; falls back to 'params' like Linen."""
    self._check_valid()
    if name not in self.rngs:
      if 'params' not in self.rngs:
        raise errors.missing_rng(name, self.name, self.path_text)
      name = 'params'
    self.rng_counters[name] += 1
    return self.rngs[name].child(self.rng_counters[name]).materialize()

  def get_flag(self, key, default=None):
    return self.flags.get(key, default)

  def has_flag(self, key) -> bool:
    return key in self.flags


# -- parameter shape checks (the expected shapes are cached in init_shapes) ---


def _check_shapes(name, scope, value, is_array, init_fn, init_args,
                  init_kwargs):
  expected = expected_shapes(init_fn, init_args, init_kwargs)
  leaves = (value,) if is_array else jax.tree_util.tree_leaves(value)
  for leaf, shape in zip(leaves, expected):
    if np.shape(leaf) != shape:
      raise errors.ScopeParamShapeError(name, scope.path_text, np.shape(leaf),
                                        shape)


# -- entry points --------------------------------------------------------------


def _validate_variables(variables):
  if not isinstance(variables, Mapping):
    raise errors.ApplyScopeInvalidVariablesTypeError(variables)
  for col, value in variables.items():
    if type(col) is not str or (type(value) is not dict  # pylint: disable=unidiomatic-typecheck
                                and not isinstance(value, Mapping)):
      if not isinstance(col, str) or not isinstance(value, Mapping):
        raise errors.ApplyScopeInvalidVariablesTypeError(variables)
  params = variables.get('params')
  if params is not None and 'params' in params:  # a Mapping: checked above
    raise errors.ApplyScopeInvalidVariablesStructureError(variables)


def _normalize_rngs(rngs, entry='apply'):
  """``{name: LazyKey}`` from a key or a ``{name: key}`` dict; ``entry``
  ('init', 'apply' or 'bind') picks the wording of the error for a bad one."""
  if rngs is None:
    return {}
  if isinstance(rngs, Mapping):
    return {k: as_lazy(k, v, entry) for k, v in rngs.items()}
  return {'params': as_lazy('params', rngs, entry)}


def _copy_mutable(variables: Mapping, mutable) -> dict:
  if mutable is False:  # apply's default: nothing to copy
    return dict(variables)
  return {col: (unfreeze(value) if in_filter(mutable, col) else value)
          for col, value in variables.items()}


def bind(variables: Mapping, rngs: PRNGKey | Mapping[str, PRNGKey] | None = None,
         mutable: Any = False, flags: Mapping | None = None) -> Scope:
  """A root Scope over ``variables`` for interactive use.

  Args:
    variables: ``{collection: {...}}``.
    rngs: a key (for ``'params'``) or ``{sequence name: key}``.
    mutable: the filter of the collections that may be written.
    flags: read-only settings for the scope tree.

  Returns:
    The root scope.

  Raises:
    InvalidRngError: ``rngs`` is not a key or a dict of keys.
  """
  return _bind(variables, _normalize_rngs(rngs, 'bind'), mutable, flags)


def _bind(variables, lazy_rngs, mutable, flags):
  _validate_variables(variables)
  return Scope(_copy_mutable(variables, mutable), rngs=lazy_rngs,
               mutable=mutable, flags=flags)


def apply(fn: Callable, mutable: Any = False,
          flags: Mapping | None = None) -> Callable[..., Any]:
  """Turns ``fn(scope, *args)`` into ``f(variables, *args, rngs=None)``.

  Args:
    fn: a function taking the root scope first.
    mutable: the filter of the collections ``fn`` may write.
    flags: read-only settings for the scope tree.

  Returns:
    ``f``, which returns ``out``, or ``(out, mutated_collections)`` when
      ``mutable`` is not False.
  """

  @api_boundary
  @functools.wraps(fn)
  def wrapper(variables, *args, rngs=None, **kwargs):
    return run(fn, variables, args, kwargs, rngs, mutable, flags)

  return wrapper


def run(fn: Callable, variables: Mapping, args: tuple, kwargs: dict,
        rngs: PRNGKey | Mapping[str, PRNGKey] | None = None,
        mutable: Any = False, flags: Mapping | None = None) -> Any:
  """One ``apply`` call without building a wrapper: ``fn(root, *args)``.

  Args:
    fn: a function taking the root scope first.
    variables: ``{collection: {...}}``.
    args: ``fn``'s positional arguments.
    kwargs: its keyword arguments.
    rngs: a key or ``{sequence name: key}``.
    mutable: the filter of the collections ``fn`` may write.
    flags: read-only settings for the scope tree.

  Returns:
    ``out``, or ``(out, mutated_collections)`` when ``mutable`` is not
      False.
  """
  root = _bind(variables, _normalize_rngs(rngs), mutable, flags)
  try:
    out = fn(root, *args, **kwargs)
    if mutable is not False:
      mutated = root.mutable_variables()
  finally:
    root.invalidate()
    root.release()
  if mutable is not False:
    if FLAG_VALUES['flax_return_frozendict']:
      mutated = freeze(mutated)
    return out, mutated
  return out


def init(fn: Callable, mutable: Any = True,
         flags: Mapping | None = None) -> Callable[..., tuple[Any, Any]]:
  """Turns ``fn(scope, *args)`` into ``f(rngs, *args) -> (out, variables)``.

  ``rngs`` is a key (used for ``'params'``) or ``{sequence_name: key}``.

  Args:
    fn: a function taking the root scope first.
    mutable: the filter of the collections created.
    flags: read-only settings for the scope tree (``initializing`` is
      added).

  Returns:
    The initializing function.
  """

  @api_boundary
  @functools.wraps(fn)
  def wrapper(rngs, *args, **kwargs):
    init_flags = {**(flags or {}), 'initializing': True}
    return apply(fn, mutable=mutable, flags=init_flags)(
        {}, *args, rngs=_normalize_rngs(rngs, 'init'), **kwargs)

  return wrapper


def lazy_init(fn: Callable, mutable: Any = True,
              flags: Mapping | None = None) -> Callable[..., Any]:
  """Like ``init``, but returns only the variables and computes nothing else.

  Inputs may be ``jax.ShapeDtypeStruct``s (see
  ``liftmods.core.partial_eval``).

  Args:
    fn: a function taking the root scope first.
    mutable: the filter of the collections created.
    flags: read-only settings for the scope tree.

  Returns:
    ``f(rngs, *args) -> variables``.

  >>> import jax, jax.numpy as jnp
  >>> def dense(scope, x):
  ...   k = scope.param('kernel', jax.nn.initializers.lecun_normal(),
  ...                   (x.shape[-1], 3))
  ...   return x @ k
  >>> x = jax.ShapeDtypeStruct((1 << 28, 1024), jnp.float32)  # 1 TB
  >>> lazy_init(dense)(jax.random.key(0), x)['params']['kernel'].shape
  (1024, 3)
  """
  def variables_only(*args, **kwargs):
    return init(fn, mutable, flags)(*args, **kwargs)[1]

  return partial_eval.lazy_init(variables_only)


# Linen's flax.core.scope names for the filter algebra of core/filters.py.
union_filters = filters.union
intersect_filters = filters.intersect
subtract_filters = filters.subtract
is_filter_empty = filters.is_empty


def group_collections(xs: Mapping, col_filters: Any) -> tuple:
  """Splits the collections of ``xs`` by a sequence of filters.

  Each collection goes to the first filter that matches it (later filters
  never see it).

  Args:
    xs: ``{collection: value}``.
    col_filters: a sequence of collection filters.

  Returns:
    One dict per filter.

  >>> group_collections({'params': 1, 'stats': 2, 'cache': 3},
  ...                   ['params', True])
  ({'params': 1}, {'stats': 2, 'cache': 3})
  """
  remaining = list(xs)
  groups = []
  for col_filter in col_filters:
    groups.append({col: xs[col] for col in remaining
                   if in_filter(col_filter, col)})
    remaining = [col for col in remaining if col not in groups[-1]]
  return tuple(groups)
