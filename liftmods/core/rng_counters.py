"""Snapshots of rng counters, and replaying what a trace did to them.

A scope's ``rng_counters`` is a nested dict: ``{sequence: count}`` plus one
child dict per scope pushed below it. A snapshot is the same tree as nested
``(key, value)`` tuples, so it can be compared, hashed and stored:

>>> counters = {'params': 2, 'Dense_0': {'params': 1}}
>>> state = snapshot(counters)
>>> state
(('params', 2), ('Dense_0', (('params', 1),)))
>>> counters['params'] = 5; counters['Dense_1'] = {'params': 3}
>>> restore(counters, state); counters
{'params': 2, 'Dense_0': {'params': 1}}
>>> apply_changes(counters, changes(state, (('params', 4),)))
>>> counters['params']
4

Lifted transforms that trace a body more often than it runs use these to
make the counters advance exactly as a single Linen run would: lifted jit
replays a cached call's effect (``changes``/``apply_changes``); the loops
(``lift.scan``, ``layer_scan``) replay the effect of the extra trace they
skip (``RngReplay``, driven by ``axes_scan.trace_loop`` for both).
"""
from liftmods.core.caching import BoundedCache, Policy, hashable_flags


def snapshot(counters: dict) -> tuple:
  """A hashable snapshot of a (nested) rng counter dict."""
  return tuple((k, snapshot(v) if isinstance(v, dict) else v)
               for k, v in counters.items())


def _write(counters: dict, state: tuple, exact: bool):
  """Writes the entries of ``state`` into ``counters`` in place (child dicts
  kept, so scopes holding them see the new counts); with ``exact``, entries
  missing from ``state`` are deleted too."""
  for k, v in state:
    if isinstance(v, tuple):
      sub = counters.get(k)
      if not isinstance(sub, dict):
        sub = counters[k] = {}
      _write(sub, v, exact)
    else:
      counters[k] = v
  if exact and len(counters) != len(state):
    keep = {k for k, _ in state}
    for k in [k for k in counters if k not in keep]:
      del counters[k]


def restore(counters: dict, state: tuple):
  """Makes ``counters`` equal the snapshot ``state``."""
  _write(counters, state, exact=True)


def apply_changes(counters: dict, delta: tuple):
  """Writes what ``changes`` found into ``counters``, leaving other entries
  as they are."""
  _write(counters, delta, exact=False)


def snapshot_scopes(scopes) -> tuple:
  """One snapshot per scope."""
  return tuple(snapshot(s.rng_counters) for s in scopes)


def restore_scopes(scopes, states: tuple):
  """Inverse of ``snapshot_scopes``."""
  for scope, state in zip(scopes, states):
    restore(scope.rng_counters, state)


def _all_zero(state: tuple) -> bool:
  return all(_all_zero(v) if isinstance(v, tuple) else v == 0
             for _, v in state)


def changes(before: tuple, after: tuple) -> tuple:
  """What a call changed in a counter snapshot, for ``apply_changes``.

  New child entries whose counters are all zero are left out: a later push
  creates exactly those, so replaying them changes nothing.
  """
  old = dict(before)
  out = []
  for k, v in after:
    prev = old.get(k)
    if isinstance(v, tuple):
      if prev is None:
        if not _all_zero(v):
          out.append((k, v))
      elif prev != v:
        sub = changes(prev, v)
        if sub:
          out.append((k, sub))
    elif prev != v:
      out.append((k, v))
  return tuple(out)


def without_zero_children(state: tuple) -> tuple:
  """A counter snapshot with all-zero child entries dropped: a push creates
  exactly those, so states differing only in them behave the same."""
  out = []
  for k, v in state:
    if isinstance(v, tuple):
      if _all_zero(v):
        continue
      v = without_zero_children(v)
    out.append((k, v))
  return tuple(out)


# -- replaying the counter effect of a skipped trace -------------------------


class ReplayMismatch(Exception):
  """A replayed trace moved the rng counters otherwise than recorded."""


class RngReplay:
  """Replays the rng-counter effect of a scan's invariant trace.

  Linen traces a scan body twice, and the keys of the second (loop) trace
  depend on the counters the first one advanced. When the same site was
  traced before from the same counter state and nothing else needs the first
  trace, the counters jump to the recorded post-first-trace state and the
  body is traced once; the loop trace then checks that it advanced the
  counters exactly as recorded, or aborts (before the scan is emitted) so
  that the caller falls back to two traces.

  ``cache`` (process-wide) maps a site and its starting counters to
  ``(after_first_trace, after_loop_trace)`` snapshots.
  """

  cache = BoundedCache(
      512, name='core.rng_counters.RngReplay.cache', policy=Policy(
          holds='rng-counter snapshots after the first and the loop trace '
                'of a loop body (`lift.scan`, `layer_scan`)',
          keyed_on='traced site, scope paths, flags, counters before',
          bound='512 entries',
          cleared='on eviction'))

  def __init__(self, scopes, site):
    """``site``: what identifies the traced code and its inputs' structure
    (the scopes' paths and flags are added here)."""
    self.scopes = scopes
    self.before = self.state()
    self.key = (site, tuple(s.path for s in scopes),
                hashable_flags(scopes[0].flags), self.before)
    self.hit = self.cache.get(self.key)

  def jump(self) -> bool:
    """Sets the counters to the recorded post-first-trace state; False (and
    nothing changed) when nothing is recorded."""
    if self.hit is None:
      return False
    self.set(self.hit[0])
    return True

  def rewind(self):
    """Puts the counters back as they were before ``jump``."""
    self.set(self.before)

  def state(self) -> tuple:
    """The scopes' counters now."""
    return snapshot_scopes(self.scopes)

  def set(self, state: tuple):
    restore_scopes(self.scopes, state)

  def record(self, after_first, after_loop):
    self.cache[self.key] = (after_first, after_loop)

  def verify(self):
    if self.state() != self.hit[1]:
      raise ReplayMismatch
