"""Global configuration flags, as Linen's ``flax.config``.

Each flag has Linen's name, default and environment variable (the name in
upper case, read once at import). Read a flag as an attribute of this module,
change it with :func:`update`, or for a block with :func:`set_config` /
:func:`temp_flip_flag`.

Flags that change what liftmods does:

- ``flax_preserve_adopted_names``: a module passed in from outside and
  adopted through a field keeps its own ``name`` instead of the field name
  (a Module class can override it with a ``preserve_adopted_names`` class
  attribute).
- ``flax_return_frozendict``: ``init`` / ``apply`` / ``Module.variables``
  return ``FrozenDict`` s instead of dicts.
- ``flax_fix_rng_separator``: a zero byte is hashed before every name and
  counter when deriving keys, so ``('ab', 'c')`` and ``('a', 'bc')`` differ
  (this changes every initial parameter value, as in Linen).
- ``flax_profile``: whether module methods run under ``jax.named_scope``
  (read at import, like Linen; ``nn.enable_named_call`` changes it later).

The others exist so that code setting them runs; they concern parts of Flax
that liftmods does not have (checkpointing, flaxlib, NNX) and change nothing.

>>> from liftmods import config
>>> config.flax_return_frozendict
False
>>> with config.set_config(flax_return_frozendict=True):
...   config.flax_return_frozendict
True
>>> config.flax_return_frozendict
False
"""
import contextlib
import os

__all__ = ['update', 'set_config', 'temp_flip_flag', 'values',
           'static_bool_env', 'static_int_env']

_FLAGS = {  # name: (default, does something in liftmods)
    'flax_filter_frames': (True, False),
    'flax_profile': (True, True),
    'flax_use_orbax_checkpointing': (True, False),
    'flax_preserve_adopted_names': (False, True),
    'flax_return_frozendict': (False, True),
    'flax_fix_rng_separator': (False, True),
    'flax_use_flaxlib': (False, False),
    'flax_array_ref': (False, False),
    'flax_pytree_module': (True, False),
    'flax_max_repr_depth': (None, False),
    'flax_always_shard_variable': (True, False),
    'flax_hijax_variable': (False, False),
    'nnx_graph_mode': (True, False),
    'nnx_graph_updates': (True, False),
    'nnx_sow_capture_noop': (False, False),  # flax 0.12.11 and newer
}


def static_bool_env(varname: str, default: bool) -> bool:
  """The boolean in environment variable ``varname`` (``default`` if unset).

  >>> static_bool_env('LIFTMODS_SURELY_UNSET', True)
  True
  """
  val = os.getenv(varname, str(default)).lower()
  if val in ('y', 'yes', 't', 'true', 'on', '1'):
    return True
  if val in ('n', 'no', 'f', 'false', 'off', '0'):
    return False
  raise ValueError(f'invalid truth value {val!r} for environment {varname!r}')


def static_int_env(varname: str, default):
  """The integer in environment variable ``varname`` (``default`` if
  unset)."""
  val = os.getenv(varname)
  if val is None:
    return default
  try:
    return int(val)
  except ValueError:
    raise ValueError(f'invalid integer value {val!r} for environment '
                     f'{varname!r}') from None


def _from_env(name, default):
  if isinstance(default, bool):
    return static_bool_env(name.upper(), default)
  return static_int_env(name.upper(), default)


# Current values by name; read-only for other modules (hot paths read it
# directly instead of going through the module attribute).
FLAG_VALUES = {name: _from_env(name, d) for name, (d, _) in _FLAGS.items()}


def __getattr__(name):
  try:
    return FLAG_VALUES[name]
  except KeyError:
    raise AttributeError(f'Unrecognized config option: {name}') from None


def values() -> dict:
  """A copy of every flag's current value."""
  return dict(FLAG_VALUES)


def update(name, value, /) -> None:
  """Sets flag ``name`` (a name, or an object with a ``.name``).

  >>> update('flax_no_such_flag', True)
  Traceback (most recent call last):
  LookupError: Unrecognized config option: flax_no_such_flag
  """
  name = getattr(name, 'name', name)
  if name not in FLAG_VALUES:
    raise LookupError(f'Unrecognized config option: {name}')
  FLAG_VALUES[name] = value


@contextlib.contextmanager
def set_config(**flags):
  """Sets the given flags for the duration of a ``with`` block."""
  for name in flags:
    if name not in FLAG_VALUES:
      raise LookupError(f'Unrecognized config option: {name}')
  saved = {name: FLAG_VALUES[name] for name in flags}
  try:
    for name, value in flags.items():
      update(name, value)
    yield
  finally:
    FLAG_VALUES.update(saved)


def temp_flip_flag(var_name: str, var_value: bool):
  """Linen's spelling: sets ``flax_{var_name}`` for a ``with`` block."""
  return set_config(**{f'flax_{var_name}': var_value})
