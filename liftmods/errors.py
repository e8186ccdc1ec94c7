"""Exceptions raised by liftmods, one class per mistake a user can make.

Class names follow Flax Linen's where Linen has the same error, so that code
catching ``flax.errors.ScopeParamShapeError`` ports by changing the import.
Every message says where (module path, collection) and what was expected.

>>> from liftmods import errors
>>> err = errors.ScopeParamShapeError('kernel', '/Dense_0', (3, 4), (3, 5))
>>> isinstance(err, errors.LiftmodsError)
True
>>> 'Dense_0' in str(err) and '(3, 4)' in str(err)
True
"""


DOCS = 'docs/errors.md'


class LiftmodsError(Exception):
  """Base class of every error liftmods raises on purpose.

  The message ends with a pointer to the error's entry in the catalogue,
  ``docs/errors.md``: the mistake, a program that makes it, and the fix.
  """

  def __str__(self):
    return f'{super().__str__()} (see {DOCS}#{_entry(type(self))})'


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


class ScopeParamShapeError(LiftmodsError):
  """A stored parameter's shape differs from the one its initializer makes."""

  def __init__(self, name, path, stored, expected):
    super().__init__(
        f'Parameter "{name}" at {_where(path)} has shape {tuple(stored)}, but its '
        f'initializer produces shape {tuple(expected)}. The variables do not '
        'match this model: check the layer sizes, or re-initialize.')


class ScopeParamNotFoundError(LiftmodsError):
  """A parameter is read during apply but is not in the variables."""

  def __init__(self, name, path):
    super().__init__(
        f'No parameter "{name}" at {_where(path)} in the "params" collection. '
        'Pass variables that contain it, or create it with init().')


class ScopeCollectionNotFound(LiftmodsError):
  """A variable is read from a collection that was not passed at all."""

  def __init__(self, col, name, path):
    super().__init__(
        f'Collection "{col}" is missing, so variable "{name}" at {_where(path)} '
        f'cannot be read. Pass it to apply(), or make "{col}" mutable so it '
        'can be created.')


class ScopeVariableNotFoundError(LiftmodsError):
  """A variable is read during apply but is not in its collection."""

  def __init__(self, name, col, path):
    super().__init__(
        f'No variable "{name}" in collection "{col}" at {_where(path)}. Pass '
        f'variables that contain it, or make "{col}" mutable so it can be '
        'created.')


class ModifyScopeVariableError(LiftmodsError):
  """A variable of an immutable collection is written."""

  def __init__(self, col, name, path):
    super().__init__(
        f'Cannot write variable "{name}" of collection "{col}" at '
        f'{_where(path)}: "{col}" is immutable here. Pass mutable=["{col}"] '
        '(or mutable=True) to apply().')


ImmutableVariableError = ModifyScopeVariableError


class NameInUseError(LiftmodsError):
  """Two children or variables of one module are given the same name."""

  def __init__(self, kind, name, owner, col=None):
    where = f' in collection "{col}"' if col else ''
    super().__init__(
        f'Cannot create {kind} "{name}"{where} in {owner}: the name is already '
        'in use there. Give one of them another name.')


class InvalidRngError(LiftmodsError):
  """make_rng asks for a sequence that was not passed (and no 'params' rng)."""

  def __init__(self, rng_name, path):
    super().__init__(
        f'{_where(path)} needs the PRNG sequence "{rng_name}", but none was '
        f'given. Pass rngs={{"{rng_name}": key}} to init() or apply().')


class InvalidRngTypeError(InvalidRngError):
  """An rng passed in is not a PRNG key."""

  def __init__(self, rng_name, value):
    LiftmodsError.__init__(
        self, f'The rng for sequence "{rng_name}" must be a PRNG key (jax.random.key '
        f'or jax.random.PRNGKey), got {type(value).__name__} '
        f'{getattr(value, "shape", "")}.')


class ApplyScopeInvalidVariablesTypeError(LiftmodsError):
  """The variables passed to apply are not a mapping."""

  def __init__(self, got=None):
    kind = f' got {type(got).__name__}' if got is not None else ''
    super().__init__(
        'apply() expects variables as a dict {collection: {name: value}};'
        f'{kind}.')


class ApplyScopeInvalidVariablesStructureError(LiftmodsError):
  """Variables are passed without the collection level, e.g. bare params."""

  def __init__(self, variables):
    keys = list(variables)[:5]
    super().__init__(
        'apply() expects variables with collections at the top level, e.g. '
        f'{{"params": {{...}}}}; got top-level keys {keys}. Did you pass '
        'params instead of {"params": params}?')


class InvalidScopeError(LiftmodsError):
  """A scope is used after the transform or apply that owned it ended."""

  def __init__(self, name):
    super().__init__(
        f'The scope "{name}" is no longer valid: it belonged to an init/apply '
        'or a transform that has finished. Do not keep modules or scopes '
        'past the call that created them.')


class InvalidFilterError(LiftmodsError):
  """A collection filter has an unsupported type."""

  def __init__(self, filter_like):
    super().__init__(
        'A collection filter must be True, False, a name, a sequence of '
        f'names or DenyList(...); got {filter_like!r}.')


class SetAttributeFrozenModuleError(LiftmodsError):
  """A module attribute is assigned outside of setup()."""

  def __init__(self, module_cls, attr_name, attr_val):
    super().__init__(
        f'Cannot set attribute "{attr_name}" of {module_cls} to {attr_val!r}: '
        'modules are frozen after construction. Assign submodules and '
        'variables inside setup(), or use clone(**overrides).')


class SetAttributeInModuleSetupError(LiftmodsError):
  """A dataclass field is reassigned inside setup()."""

  def __init__(self, module_cls='', attr_name=''):
    super().__init__(
        f'Cannot reassign the dataclass field "{attr_name}" of {module_cls} '
        'inside setup(); fields are fixed at construction.')


class MultipleMethodsCompactError(LiftmodsError):
  """More than one method of a class is decorated with @compact."""

  def __init__(self, module_cls=''):
    super().__init__(
        f'{module_cls} has more than one @compact method. Only one method per '
        'module may be compact; move the others into submodules or setup().')


class ReservedModuleAttributeError(LiftmodsError):
  """A Module subclass defines a field named 'parent' or 'name'."""

  def __init__(self, annotations):
    super().__init__(
        f'Fields "parent" and "name" are reserved by Module; got annotations '
        f'{annotations}.')


class AssignSubModuleError(LiftmodsError):
  """A submodule is constructed outside setup() and outside @compact."""

  def __init__(self, cls):
    super().__init__(
        f'Submodule {cls} must be created in setup() or in a method wrapped '
        'in @compact.')


class ApplyModuleInvalidMethodError(LiftmodsError):
  """The method= passed to apply/init is not usable."""

  def __init__(self, method):
    super().__init__(
        f'method= must be a method of the module, its name, or a function '
        f'taking the module as first argument; got {method!r}.')


class CallCompactUnboundModuleError(LiftmodsError):
  """A compact method is called on a module that is not bound to variables."""

  def __init__(self, cls=''):
    super().__init__(
        f'{cls} is unbound: call it through init() or apply(), or bind() it '
        'to variables first.')


class CallSetupUnboundModuleError(LiftmodsError):
  """setup() is called on an unbound module."""

  def __init__(self):
    super().__init__('setup() can only run on a bound module: use init(), '
                     'apply() or bind().')


class CallUnbindOnUnboundModuleError(LiftmodsError):
  """unbind() is called on a module that is not bound."""

  def __init__(self, cls=''):
    super().__init__(f'unbind() was called on an unbound {cls}; it needs a '
                     'module returned by bind().')


class UnboundModuleError(LiftmodsError, ValueError):
  """A variable or rng method is used on an unbound module."""

  def __init__(self, cls, what):
    super().__init__(
        f'{cls} is unbound, so it cannot {what}. Use init(), apply() or bind().')


class InvalidInstanceModuleError(LiftmodsError):
  """init/apply is called on the class instead of an instance."""

  def __init__(self):
    super().__init__('init()/apply() must be called on a module instance, '
                     'e.g. MyModule().init(...), not on the class.')


class IncorrectPostInitOverrideError(LiftmodsError):
  """A subclass overrides __post_init__ without calling super()."""

  def __init__(self):
    super().__init__('A Module subclass overrode __post_init__ without calling '
                     'super().__post_init__().')


class TransformTargetError(LiftmodsError):
  """A lifted transform is applied to something it cannot lift."""

  def __init__(self, target):
    super().__init__(
        'Lifted transforms take a Module class or a function whose first '
        f'argument is a Module; got {target!r}.')


class TransformedMethodReturnValueError(LiftmodsError):
  """A transformed method returned a Module (which cannot cross a transform)."""

  def __init__(self, name):
    super().__init__(
        f'The transformed method "{name}" returned a Module or Variable; '
        'these cannot leave a transform. Return arrays instead.')


class JaxTransformError(LiftmodsError):
  """A JAX transform is applied directly to a bound module method."""

  def __init__(self):
    super().__init__('Use liftmods transforms (nn.jit, nn.vmap, ...) inside '
                     'modules rather than jax transforms over bound modules.')


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


class WhileLoopInitError(LiftError):
  """Variables are initialised inside a lifted while_loop."""


class PartitioningUnspecifiedError(LiftError):
  """A Partitioned variable crosses vmap/scan without a partition name."""

  def __init__(self, names):
    super().__init__(
        f'A Partitioned variable with names {names} went through a transform '
        'that adds an axis, but metadata_params has no "partition_name". '
        'Pass metadata_params={"partition_name": "layers"} (or None for an '
        'unsharded axis).')
