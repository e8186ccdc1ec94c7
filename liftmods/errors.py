"""Exceptions raised by liftmods, one class per mistake a user can make.

Class names follow Flax Linen's where Linen has the same error, so that code
catching ``flax.errors.ScopeParamShapeError`` ports by changing the import.
Each message begins with Linen's wording for the same mistake (so regexes
written against Linen's messages still match) and goes on with liftmods's
detail: where the mistake is (module path, collection) and what to do.

>>> from liftmods import errors
>>> err = errors.ScopeParamShapeError('kernel', '/Dense_0', (3, 4), (3, 5))
>>> isinstance(err, errors.LiftmodsError)
True
>>> str(err).startswith('For parameter "kernel" in "/Dense_0", the given '
...                     'initializer is expected to generate shape (3, 5)')
True
"""


DOCS = 'docs/errors.md'


class LiftmodsError(Exception):
  """Base class of every error liftmods raises on purpose.

  The message ends with a pointer to the error's entry in the catalogue,
  ``docs/errors.md``: the mistake, a program that makes it, and the fix.
  Error families documented in their own guide set ``docs_link``.
  """

  docs_link = None

  def __str__(self):
    link = self.docs_link or f'{DOCS}#{_entry(type(self))}'
    return f'{super().__str__()} (see {link})'

  def __reduce__(self):
    # Subclasses build their message from several required arguments, so
    # the default (calling the class with ``self.args``, the message) would
    # fail to unpickle; restore the finished error instead.
    return _restore, (type(self), self.args, self.__dict__)


def _restore(cls, args, state):
  """An error of class ``cls`` with the given ``args`` and attributes,
  made without running its ``__init__`` (what unpickling calls)."""
  err = cls.__new__(cls, *args)
  err.args = args
  err.__dict__.update(state)
  return err


def _entry(cls) -> str:
  """The catalogue anchor of ``cls``: its own, or that of the nearest base
  defined here (for error classes that other modules derive)."""
  for base in cls.__mro__:
    if base.__module__ == __name__:
      return base.__name__.lower()
  return 'liftmodserror'


FlaxError = LiftmodsError  # Linen's name for the base class.


def _where(path: str) -> str:
  return path if path else '/'


def _join(linen_wording: str, detail: str = '') -> str:
  """Linen's message for the mistake, then liftmods's detail."""
  return f'{linen_wording} {detail}' if detail else linen_wording


class ScopeParamShapeError(LiftmodsError):
  """A stored parameter's shape differs from the one its initializer makes."""

  def __init__(self, name, path, stored, expected):
    super().__init__(_join(
        f'For parameter "{name}" in "{_where(path)}", the given initializer '
        f'is expected to generate shape {tuple(expected)}, but the existing '
        f'parameter it received has shape {tuple(stored)}.',
        'The variables do not match this model: check the layer sizes, or '
        're-initialize.'))


class ScopeParamNotFoundError(LiftmodsError):
  """A parameter is read during apply but is not in the variables."""

  def __init__(self, name, path, hint=None):
    self.collection, self.lookup = 'params', (name, path)
    super().__init__(_join(
        f'Could not find parameter named "{name}" in scope "{_where(path)}".',
        hint or 'Pass variables that contain it, or create it with init().'))


class ScopeCollectionNotFound(LiftmodsError):
  """A variable is read from a collection that was not passed at all."""

  def __init__(self, col, name, path, hint=None):
    self.collection, self.lookup = col, (col, name, path)
    super().__init__(_join(
        f'Tried to access "{name}" from collection "{col}" in '
        f'"{_where(path)}" but the collection is empty.',
        hint or f'Pass "{col}" to apply(), or make it mutable so that '
        f'"{name}" can be created.'))


class ScopeVariableNotFoundError(LiftmodsError):
  """A variable is read during apply but is not in its collection."""

  def __init__(self, name, col, path, hint=None):
    self.collection, self.lookup = col, (name, col, path)
    super().__init__(_join(
        f'No Variable named "{name}" for collection "{col}" exists in '
        f'"{_where(path)}".',
        hint or f'Pass variables that contain it, or make "{col}" mutable '
        'so it can be created.'))


class ModifyScopeVariableError(LiftmodsError):
  """A variable of an immutable collection is written."""

  def __init__(self, col, name, path):
    super().__init__(_join(
        f'Cannot update variable "{name}" in "{_where(path)}" because '
        f'collection "{col}" is immutable.',
        f'Pass mutable=["{col}"] (or mutable=True) to apply().'))


ImmutableVariableError = ModifyScopeVariableError


class NameInUseError(LiftmodsError, ValueError):
  """Two children or variables of one module are given the same name.

  Raised with Linen's Module wording (``Could not create param "w" in Module
  Foo: Name in use.``) by modules, and with Linen's core wording
  (``Duplicate use of scope name: "w"``, a ValueError there) by bare scopes.
  """

  def __init__(self, kind, name, owner, col=None, path=None):
    if owner is None:
      where = f' in collection "{col}"' if col else ''
      super().__init__(_join(
          f'Duplicate use of scope name: "{name}"',
          f'({kind}{where} at {_where(path)}). Give one of them another '
          'name.'))
      return
    at = f' at {_where(path)}' if path is not None else ''
    super().__init__(_join(
        f'Could not create {kind} "{name}" in Module {owner}: Name in use.',
        f'({owner}{at} already has a child or variable named "{name}"; give '
        'one of them another name.)'))


class InvalidRngError(LiftmodsError):
  """make_rng asks for a sequence that was not passed (and no 'params' rng),
  or an rng passed in is not a PRNG key. Built from a whole message, as
  Linen's is."""


class InvalidRngTypeError(InvalidRngError, ValueError):
  """An rng in a ``{name: key}`` dict passed to init/apply is not a PRNG key
  (Linen raises a ValueError with this wording)."""

  _WORDING = {
      'init': 'First argument passed to an init function should be a '
              '``jax.PRNGKey`` or a dictionary mapping strings to '
              '``jax.PRNGKey``.',
      'apply': 'The ``rngs`` argument passed to an apply function should be '
               'a ``jax.PRNGKey`` or a dictionary mapping strings to '
               '``jax.PRNGKey``.',
      'bind': 'rngs should be a dictionary mapping strings to '
              '`jax.PRNGKey`.',
  }

  def __init__(self, rng_name, value, entry='apply'):
    super().__init__(_bad_rng_message(rng_name, value, entry))


def _bad_rng_message(rng_name, value, entry):
  wording = InvalidRngTypeError._WORDING  # pylint: disable=protected-access
  return _join(
      wording.get(entry, wording['apply']),
      f'The rng for sequence "{rng_name}" must be a PRNG key '
      '(jax.random.key or jax.random.PRNGKey), got '
      f'{type(value).__name__} {getattr(value, "shape", "")}.')


def bad_rng(rng_name, value, entry='apply') -> InvalidRngError:
  """The error for an rng that is not a key: a ValueError (as Linen's) when
  passed to init/apply, a plain InvalidRngError when passed to bind."""
  if entry == 'bind':
    return InvalidRngError(_bad_rng_message(rng_name, value, entry))
  return InvalidRngTypeError(rng_name, value, entry)


def missing_rng(rng_name, scope_name, path, hint=''):
  """The InvalidRngError for a sequence that was not passed."""
  return InvalidRngError(_join(
      f'{scope_name} needs PRNG for "{rng_name}"',
      f'(at {_where(path)}): pass rngs={{"{rng_name}": key}} to init() or '
      f'apply().{hint}'))


class ApplyScopeInvalidVariablesTypeError(LiftmodsError):
  """The variables passed to apply are not ``{collection: dict}``."""

  def __init__(self, got=None):
    super().__init__(_join(
        'The first argument passed to an apply function should be a '
        'dictionary of collections. Each collection should be a dictionary '
        'with string keys.', f'Got {_describe(got)}'))


def _describe(variables):
  if not hasattr(variables, 'items'):
    return f'{type(variables).__name__}.'
  bad = [f'{k!r}: {type(v).__name__}' for k, v in variables.items()
         if not isinstance(k, str) or not hasattr(v, 'keys')]
  text = 'a mapping with entries ' + ', '.join(bad[:5])
  if any(hasattr(v, 'shape') for v in variables.values()):
    text += '. Did you pass params instead of {"params": params}?'
  else:
    text += '.'
  return text


class ApplyScopeInvalidVariablesStructureError(LiftmodsError):
  """The params are wrapped in one ``{'params': ...}`` too many."""

  def __init__(self, variables=None):
    super().__init__(_join(
        'Expect the `variables` (first argument) passed to apply() to be a '
        'dict with the structure {"params": ...}, but got a dict with an '
        'extra params layer, i.e.  {"params": {"params": ... } }. You should '
        'instead pass in your dict\'s ["params"].'))


class InvalidScopeError(LiftmodsError):
  """A scope is used after the transform or apply that owned it ended."""

  def __init__(self, name):
    super().__init__(_join(
        f'The scope "{name}" is no longer valid.',
        'It belonged to an init/apply or a transform that has finished: do '
        'not keep modules or scopes past the call that created them.'))


class InvalidFilterError(LiftmodsError):
  """A collection filter has an unsupported type."""

  def __init__(self, filter_like):
    super().__init__(_join(
        f'Invalid Filter: "{filter_like}"',
        '(a collection filter is True, False, a name, a sequence of names or '
        'DenyList(...)).'))


class SetAttributeFrozenModuleError(LiftmodsError):
  """A module attribute is assigned outside of setup()."""

  def __init__(self, module_cls, attr_name, attr_val):
    super().__init__(_join(
        f"Can't set {attr_name}={attr_val} for Module of type {module_cls}: "
        'Module instance is frozen outside of setup method.',
        'Assign submodules and variables inside setup(), or use '
        'clone(**overrides).'))


class SetAttributeInModuleSetupError(LiftmodsError):
  """A dataclass field is reassigned inside setup()."""

  def __init__(self, module_cls='', attr_name=''):
    super().__init__(_join(
        'Module construction attributes are frozen.',
        f'(setup() of {module_cls} reassigns the dataclass field '
        f'"{attr_name}"; fields are fixed at construction.)'))


class MultipleMethodsCompactError(LiftmodsError):
  """More than one method of a class is decorated with @compact."""

  def __init__(self, module_cls=''):
    super().__init__(_join(
        'Only one method per class can be @compact',
        f'({module_cls}); move the others into submodules or setup().'))


class ReservedModuleAttributeError(LiftmodsError):
  """A Module subclass defines a field named 'parent' or 'name'."""

  def __init__(self, annotations):
    super().__init__(
        f'properties `parent` and `name` are reserved: {annotations}')


class AssignSubModuleError(LiftmodsError):
  """A submodule is constructed outside setup() and outside @compact."""

  def __init__(self, cls, where=''):
    super().__init__(_join(
        f'Submodule {cls} must be defined in `setup()` or in a method '
        'wrapped in `@compact`', f'({where})' if where else ''))


class ApplyModuleInvalidMethodError(LiftmodsError):
  """The method= passed to apply/init is not usable."""

  def __init__(self, method):
    super().__init__(_join(
        f'Cannot call apply(): {method} is not a valid function for apply().',
        'Pass a method of the module, its name, or a function taking the '
        'module as first argument.'))


class CallCompactUnboundModuleError(LiftmodsError):
  """A compact method is called on a module that is not bound to variables."""

  def __init__(self, cls=''):
    super().__init__(_join(
        "Can't call compact methods on unbound modules",
        f'({cls}): call it through init() or apply(), or bind() it to '
        'variables first.'))


class CallSetupUnboundModuleError(LiftmodsError):
  """setup() is called on an unbound module."""

  def __init__(self, cls=''):
    # Linen uses the compact-method wording for setup() as well.
    super().__init__(_join(
        "Can't call compact methods on unbound modules",
        f'(setup() of {cls or "a module"} needs a bound module: use init(), '
        'apply() or bind()).'))


class CallUnbindOnUnboundModuleError(LiftmodsError):
  """unbind() is called on a module that is not bound."""

  def __init__(self, cls=''):
    super().__init__(_join(
        "Can't call `unbind()` on unbound modules",
        f'({cls}); it needs a module returned by bind().'))


class UnboundModuleError(LiftmodsError, ValueError):
  """A variable or rng method is used on an unbound module (Linen raises a
  ValueError with the same wording)."""

  def __init__(self, cls, linen_wording):
    super().__init__(_join(
        linen_wording, f'({cls}): use init(), apply() or bind().'))


class InvalidInstanceModuleError(LiftmodsError):
  """init/apply is called on the class instead of an instance."""

  def __init__(self):
    super().__init__(_join(
        'Can only call init, init_with_output or apply methods on an '
        'instance of the Module class, not the Module class itself',
        '(e.g. MyModule().init(...)).'))


class IncorrectPostInitOverrideError(LiftmodsError):
  """A subclass overrides __post_init__ without calling super()."""

  def __init__(self):
    super().__init__(
        'Overrode `.__post_init__()` without calling `super().__post_init__()`')


class TransformTargetError(LiftmodsError):
  """A lifted transform is applied to something it cannot lift."""

  def __init__(self, target):
    super().__init__(
        'Linen transformations must be applied to Modules classes or '
        'functions taking a Module instance as the first argument. The '
        f'provided target is not a Module class or callable: {target}')


class TransformedMethodReturnValueError(LiftmodsError):
  """A transformed method returned a Module (which cannot cross a transform)."""

  def __init__(self, name):
    super().__init__(_join(
        f'Transformed module method {name} cannot return Modules or '
        'Variables.', 'Return arrays instead.'))


class JaxTransformError(LiftmodsError):
  """A JAX transform is applied directly to a bound module method."""

  def __init__(self):
    super().__init__(_join(
        'Jax transforms and Flax models cannot be mixed.',
        'Use liftmods transforms (nn.jit, nn.vmap, ...) inside modules.'))


class LiftError(LiftmodsError, ValueError):
  """A lifted transform is used inconsistently (axes, carries, branches)."""


class ScanCarryError(LiftError, TypeError):
  """A scan body returns a carry whose structure or shape changes."""


class BroadcastVariableError(LiftError):
  """A broadcast variable would depend on the loop iteration."""


class CondBranchVariablesError(LiftError, TypeError):
  """Branches of cond/switch create different variables."""


class VariableAxisError(LiftError):
  """A collection mapped by vmap/scan is missing or has a wrong axis size."""


class WhileLoopInitError(LiftError, TypeError):
  """A lifted while_loop's body adds variables to a carried collection
  (Linen lets JAX reject the changed carry with a ``TypeError``)."""


class PartitioningUnspecifiedError(LiftError):
  """A Partitioned variable crosses vmap/scan without a partition name.

  ``transform`` is the transform that adds or removes the axis, when it is
  known; the advice names its ``metadata_params`` argument only then.
  """

  def __init__(self, target, transform: str | None = None,
               path: str | None = None):
    # As text: the box holds arrays, and the error must pickle to an equal
    # one (an array compares elementwise).
    self.target = str(target)
    self.transform = transform
    self.path = path
    if transform is None:
      advice = ('-- the params given to add_axis/remove_axis must hold '
                '{"partition_name": <axis name, or None for an unsharded '
                'axis>}.')
    else:
      at = f' at {path}' if path else ''
      advice = (f'-- pass metadata_params={{"partition_name": "layers"}} '
                f'(or None for an unsharded axis) to {transform}{at}, '
                'which adds this axis.')
    super().__init__(_join(
        'Trying to transform a Partitioned variable but "partition_name" is '
        f'not specified in metadata_params: {target}', advice))


class DescriptorAttributeError(LiftmodsError):
  """A property (or other descriptor) of a module raised AttributeError,
  e.g. because it reads a field that does not exist."""

  def __init__(self, prop='', cls=''):
    where = f' ("{prop}" of {cls})' if prop and cls else ''
    super().__init__(
        'Trying to access a property that is accessing a non-existent '
        f'attribute{where}. The AttributeError raised inside it is chained '
        'below.')


class LazyInitError(LiftmodsError):
  """lazy_init produced a variable that depends on an input given only as a
  jax.ShapeDtypeStruct."""

  def __init__(self, partial_val):
    super().__init__(
        'Lazy init encountered a value that could with the given inputs '
        f'(shape: {partial_val}). A variable depends on an input passed as a '
        'jax.ShapeDtypeStruct: pass a concrete array for that input, or use '
        'init().')


class CallShareScopeOnUnboundModuleError(LiftmodsError):
  """share_scope is called with a module that is not bound."""

  def __init__(self):
    super().__init__(
        "Can't call `share_scope` on unbound modules: call it inside setup() "
        'or a @compact method, where both modules are bound.')


class PartitionAxisMismatchError(LiftError, AssertionError):
  """A transform removes a stacked axis whose partition name differs from
  the one in its ``metadata_params`` (Linen asserts the same)."""

  def __init__(self, names, index, expected):
    super().__init__(
        f'Axis {index} of a Partitioned variable with names {names} is '
        f'named {names[index]!r}, but the transform that removes it expects '
        f'{expected!r} (metadata_params["partition_name"]). Use the same '
        'partition name when the axis is added and removed.')


class ShardingError(LiftmodsError, ValueError):
  """Base class of the errors of sharding a variable over a device mesh."""


class LogicalAxisUnmappedError(ShardingError):
  """A logical axis name matches no rule and ``fallback`` asks for an error."""

  def __init__(self, where, names, rules, unmapped=None):
    if unmapped is None:
      mapped = {rule[0] for rule in rules}
      unmapped = [n for n in names if isinstance(n, str) and n not in mapped]
    unmapped = tuple(unmapped)
    first = unmapped[0] if unmapped else 'name'
    which = (repr(unmapped[0]) if len(unmapped) == 1
             else ', '.join(map(repr, unmapped)))
    super().__init__(
        f'{where}: the logical axis names {tuple(names)} are not all mapped to '
        f'mesh axes by the rules {tuple(rules)}: {which} '
        f'{"is" if len(unmapped) == 1 else "are"} unmapped. Add a rule '
        f'({first!r}, \'mesh_axis\') or ({first!r}, None) for each.')


class MeshAxisNotFoundError(ShardingError):
  """A partition spec names a mesh axis that the mesh does not have."""

  def __init__(self, where, spec, axis, mesh_axes):
    self.spec, self.axis, self.mesh_axes = spec, axis, tuple(mesh_axes)
    super().__init__(
        f'{where}: partition spec {spec} names mesh axis {axis!r}, but the '
        f'mesh has axes {tuple(mesh_axes)}. Fix the rules or the names, or '
        'build the mesh with that axis.')

  def at(self, where) -> 'MeshAxisNotFoundError':
    """The same error, said of ``where``."""
    return type(self)(where, self.spec, self.axis, self.mesh_axes)


class ShardingDivisibilityError(ShardingError):
  """A sharded dimension is not a multiple of its mesh axes' size."""

  def __init__(self, where, shape, spec, dim, size):
    super().__init__(
        f'{where}: dimension {dim} of shape {tuple(shape)} is sharded as '
        f'{spec[dim]!r} over {size} devices (spec {spec}), but '
        f'{shape[dim]} is not divisible by {size}. Change the size, or map '
        'that axis to a smaller (or no) mesh axis.')


class ExplicitShardingError(ShardingError):
  """An operation's output sharding on Explicit mesh axes cannot be
  resolved from its operands' shardings."""

  def __init__(self, where, what, specs, cause=None):
    super().__init__(
        f"{where}: the {what}'s output sharding cannot be resolved on the "
        f'Explicit mesh axes ({specs}): {cause}. Pass a valid out_sharding= '
        'to the layer call (Explicit mesh axes only, each once, one entry '
        'per output dimension at most), or constrain the input '
        '(nn.with_logical_constraint) or change the rules so that the '
        'shardings agree.')


class ShardMapSpecError(ShardingError):
  """A variable crosses ``nn.shard_map`` with no spec it can be cut by."""

  def __init__(self, where, reason=None, crossing=True):
    if not crossing:  # said of the map's outputs
      super().__init__(f'{where}: {reason}.')
      return
    reason = reason or (
        'it has no partitioning metadata (nn.with_partitioning / '
        'nn.with_logical_partitioning) and variable_specs gives its '
        'collection no PartitionSpec')
    super().__init__(
        f'{where} cannot cross the shard_map boundary: {reason}. Annotate '
        'the variable, or pass variable_specs={collection: PartitionSpec(...)} '
        '(PartitionSpec() replicates it).')


class StackError(LiftError):
  """A layer stack (nn.Stack) is called in a way its block cannot take."""
