"""The logical-axis rules context, as ``flax.core.spmd``: which mesh axes
each logical axis name maps to, set per thread. ``liftmods.spmd`` builds
the partitioning API on it.

>>> with logical_axis_rules((('embed', 'data'),)):
...   get_logical_axis_rules()
(('embed', 'data'),)
>>> composite_rules((('a', 'x'),), (('b', 'y'),))
(('a', 'x'), ('b', 'y'))
"""
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

# ((logical name, mesh axis or axes or None), ...), as liftmods.typing's
# LogicalRules (not imported: liftmods.typing imports the core).
_RulesLike = Any


class _Rules(threading.local):
  rules: tuple = ()


_state = _Rules()


def set_logical_axis_rules(rules: _RulesLike) -> None:
  """Sets this thread's logical-to-mesh axis rules.

  Args:
    rules: ``((logical name, mesh axis or axes or None), ...)``.
  """
  _state.rules = rules


def get_logical_axis_rules() -> _RulesLike:
  """This thread's logical-to-mesh axis rules.

  Returns:
    The rules, ``()`` when none are set.
  """
  return _state.rules


@contextlib.contextmanager
def logical_axis_rules(rules: _RulesLike) -> Iterator[None]:
  """Uses ``rules`` inside the ``with`` block, restoring the old ones after.

  Args:
    rules: ``((logical name, mesh axis or axes or None), ...)``.

  Yields:
    None, with the rules set.
  """
  old = _state.rules
  _state.rules = rules
  try:
    yield
  finally:
    _state.rules = old


def composite_rules(rule1: _RulesLike, rule2: _RulesLike) -> _RulesLike:
  """The union of two rule sets.

  Args:
    rule1: a rule set.
    rule2: another rule set.

  Returns:
    The merged rules.

  Raises:
    ValueError: a name is mapped differently by the two.
  """
  if not rule1 or not rule2:
    return rule1 or rule2 or ()
  merged = dict(rule1)
  for name, axes in rule2:
    if name in merged and merged[name] != axes:
      raise ValueError(f'Inconsistent logical axis annotations for {name}: '
                       f'{merged[name]} vs {axes}')
    merged[name] = axes
  return tuple(merged.items())


def from_sharding_rules(sharding: tuple, sharding_rules: _RulesLike) -> tuple:
  """Replaces the logical names of ``sharding`` by their mesh axes.

  Args:
    sharding: a tuple of logical names (or None).
    sharding_rules: the rules.

  Returns:
    The tuple with every name the rules map replaced by its mesh axes.
  """
  table = dict(sharding_rules)
  return tuple(table[str(s)] if s and str(s) in table else s
               for s in sharding)
