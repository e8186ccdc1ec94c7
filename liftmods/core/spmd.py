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


class _Rules(threading.local):
  rules: tuple = ()


_state = _Rules()


def set_logical_axis_rules(rules):
  """Sets this thread's logical-to-mesh axis rules."""
  _state.rules = rules


def get_logical_axis_rules():
  """This thread's logical-to-mesh axis rules (``()`` when none are set)."""
  return _state.rules


@contextlib.contextmanager
def logical_axis_rules(rules):
  """Uses ``rules`` inside the ``with`` block, restoring the old ones after."""
  old = _state.rules
  _state.rules = rules
  try:
    yield
  finally:
    _state.rules = old


def composite_rules(rule1, rule2):
  """The union of two rule sets; a name mapped differently by both is an
  error."""
  if not rule1 or not rule2:
    return rule1 or rule2 or ()
  merged = dict(rule1)
  for name, axes in rule2:
    if name in merged and merged[name] != axes:
      raise ValueError(f'Inconsistent logical axis annotations for {name}: '
                       f'{merged[name]} vs {axes}')
    merged[name] = axes
  return tuple(merged.items())


def from_sharding_rules(sharding, sharding_rules):
  """``sharding`` (a tuple of logical names) with every name the rules map
  replaced by its mesh axes."""
  table = dict(sharding_rules)
  return tuple(table[str(s)] if s and str(s) in table else s
               for s in sharding)
