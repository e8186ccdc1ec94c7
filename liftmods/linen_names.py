"""The names of a Linen submodule that its liftmods counterpart leaves out.

A few of ``dir(flax.linen.X)`` cannot mean anything in liftmods (flax's own
modules, private JAX modules, Linen internals). Each mirror module lists them
with the reason, and its module-level ``__getattr__`` (PEP 562) says so
instead of a bare "has no attribute":

>>> getattr_ = not_provided('liftmods.demo', 'flax.linen.demo',
...                         {'flax': 'liftmods never imports flax'})
>>> try:
...   getattr_('flax')
... except AttributeError as err:
...   print(err)
flax.linen.demo.flax is not provided by liftmods.demo: liftmods never imports flax
"""
from collections.abc import Callable, Mapping
from typing import NoReturn

__all__ = ['not_provided', 'shared']

# Reasons that several mirror modules give for the same Linen name.
_SHARED = {
    'flax': 'the flax package itself; liftmods never imports flax',
    'tpe': 'the typing_extensions module, a dependency of flax that '
           'liftmods does not have (it needs only jax, jaxlib, numpy and '
           'msgpack)',
    'struct': "the flax.struct module, flax's own rather than Linen's; "
              'liftmods has no counterpart, and under liftmods.compat '
              "flax.struct stays flax's",
    'FlaxId': "flax.ids.FlaxId, the class of Linen's module ids; liftmods "
              'numbers its modules with plain integers and has no id class',
}


def not_provided(module: str, linen_module: str,
                 reasons: Mapping[str, str]) -> Callable[[str], NoReturn]:
  """A module ``__getattr__`` explaining the Linen names ``module`` lacks.

  Args:
    module: the liftmods module's ``__name__``.
    linen_module: the Linen module it mirrors (``flax.linen.X``).
    reasons: ``{name: why liftmods has no such name}``.

  Returns:
    ``__getattr__(name)``: raises AttributeError, with the reason for a
    listed name.
  """

  def __getattr__(name: str) -> NoReturn:
    reason = reasons.get(name)
    if reason is None:
      raise AttributeError(f'module {module!r} has no attribute {name!r}')
    raise AttributeError(f'{linen_module}.{name} is not provided by '
                         f'{module}: {reason}')

  return __getattr__


def shared(*names: str) -> dict[str, str]:
  """The reasons several mirror modules give, for ``names``.

  Args:
    *names: Linen names listed in more than one mirror module.

  Returns:
    ``{name: reason}``.
  """
  return {name: _SHARED[name] for name in names}
