"""The state tools (``nn.state``) on the variables of random models.

A program is a random Linen program (the linen family's generator), initialized
under liftmods, and a random list of filters from a table that pairs each
filter with a plain-Python predicate written here (the reference). Checked:

- ``split(v, f1, ..., fk, ...)`` puts each leaf in the part of the first
  reference predicate it meets, and ``merge`` of the parts is ``v`` bit for
  bit (same tree); ``select(v, f)`` holds exactly the matched leaves;
- ``update(v, 2 * select(v, f))`` doubles those leaves and keeps the rest;
- ``rename`` of a random sub-tree and back gives ``v``; ``drop`` removes
  exactly that sub-tree, and ``graft`` of it from ``v`` into zeros sets
  exactly its leaves;
- partial training: ``state.grad(loss, wrt=f)`` equals ``jax.grad`` of the
  whole tree restricted to the matched leaves, and after optimizer steps of
  ``optax.multi_transform`` with ``state.labels`` the frozen leaves are
  unchanged bit for bit.
"""
import dataclasses
import fnmatch

import jax
import jax.numpy as jnp
import numpy as np

from . import compare, programs

# (filter as source over `state`, reference predicate on the path's keys)
FILTERS = (
    ("'params'", lambda p: p[0] == 'params'),
    ("'batch_stats'", lambda p: p[0] == 'batch_stats'),
    ("'**/kernel'", lambda p: 'kernel' in p),
    ("'**/bias'", lambda p: 'bias' in p),
    ("'params/*/Dense_*'",
     lambda p: len(p) > 2 and p[0] == 'params' and
     fnmatch.fnmatchcase(p[2], 'Dense_*')),
    ("'*/m0'", lambda p: len(p) > 1 and p[1] == 'm0'),
    ("state.filters.Not('params')", lambda p: p[0] != 'params'),
    ("['intermediates', '**/scale']",
     lambda p: p[0] == 'intermediates' or 'scale' in p),
    ("'**/Dense_?/**'",
     lambda p: any(fnmatch.fnmatchcase(k, 'Dense_?') for k in p[:-1])),
)
_REFERENCE = dict(FILTERS)


@dataclasses.dataclass(frozen=True)
class Program:
  """A random model and the filters used on its variables."""
  src: str
  filters: tuple  # source texts from FILTERS
  steps: int


def draw(c: programs.Chooser) -> Program:
  """A random program and 1 to 3 filters."""
  # No while loops: partial training takes reverse-mode gradients.
  src = programs.generate(c, {'unguarded_write': False, 'while_loop': False},
                          max_depth=3)
  names = [f for f, _ in FILTERS]
  filters = tuple(c.choice(names) for _ in range(c.integer(1, 3)))
  return Program(src, filters, c.integer(1, 3))


def _leaves(tree):
  """``{path tuple: leaf}`` (mappings descended into)."""
  out = {}

  def walk(t, path):
    if hasattr(t, 'items'):
      for k, v in t.items():
        walk(v, path + (str(k),))
    else:
      out[path] = t
  walk(tree, ())
  return out


def _same(a, b):
  la, lb = _leaves(a), _leaves(b)
  if set(la) != set(lb):  # key order is not part of a tree's value
    return (f'paths differ: only expected {sorted(set(la) - set(lb))}, '
            f'only got {sorted(set(lb) - set(la))}')
  for path, x in la.items():
    if not np.array_equal(np.asarray(x), np.asarray(lb[path])):
      return f'{"/".join(path)}: values differ'
  return None


def _filters(prog):
  from liftmods import state  # pylint: disable=g-import-not-at-top
  return [eval(f, {'state': state}) for f in prog.filters]  # pylint: disable=eval-used


def _check_split(v, prog) -> str | None:
  from liftmods import state  # pylint: disable=g-import-not-at-top
  filters, refs = _filters(prog), [_REFERENCE[f] for f in prog.filters]
  parts = state.split(v, *filters, ...)
  leaves = _leaves(v)
  for i, part in enumerate(parts):
    want = {p for p in leaves
            if (refs[i](p) if i < len(refs) else True)
            and not any(r(p) for r in refs[:i])}
    if set(_leaves(part)) != want:
      return (f'split part {i} ({(prog.filters + ("...",))[i]}): got '
              f'{sorted(_leaves(part))}, expected {sorted(want)}')
  d = _same(v, state.merge(*parts))
  if d:
    return f'merge(split(v)) != v: {d}'
  chosen = state.select(v, filters[0])
  want = {p for p in leaves if refs[0](p)}
  if set(_leaves(chosen)) != want:
    return f'select {prog.filters[0]}: got {sorted(_leaves(chosen))}'
  doubled = state.update(v, jax.tree_util.tree_map(lambda a: 2 * a, chosen))
  expected = {p: (2 * x if p in want else x) for p, x in leaves.items()}
  for p, x in _leaves(doubled).items():
    if not np.array_equal(np.asarray(x), np.asarray(expected[p])):
      return f'update: {"/".join(p)} not as expected'
  return None


def _check_surgery(v) -> str | None:
  from liftmods import state  # pylint: disable=g-import-not-at-top
  subtrees = sorted({p[:2] for p in _leaves(v) if len(p) > 2})
  if not subtrees:
    return None
  path = '/'.join(subtrees[len(subtrees) // 2])
  moved = state.rename(v, {path: path + '_moved'})
  d = _same(v, state.rename(moved, {path + '_moved': path}))
  if d:
    return f'rename {path} and back: {d}'
  trunk = _leaves(state.drop(v, path))
  prefix = tuple(path.split('/'))
  if set(trunk) != {p for p in _leaves(v) if p[:2] != prefix}:
    return f'drop {path}: wrong leaves {sorted(trunk)}'
  zeros = jax.tree_util.tree_map(jnp.zeros_like, v)
  grafted = _leaves(state.graft(zeros, v, {path: path}))
  for p, x in _leaves(v).items():
    want = x if p[:2] == prefix else jnp.zeros_like(x)
    if not np.array_equal(np.asarray(grafted[p]), np.asarray(want)):
      return f'graft {path} into zeros: {"/".join(p)} wrong'
  return None


def _check_training(model, v, x, prog) -> str | None:
  import optax  # pylint: disable=g-import-not-at-top
  from liftmods import state  # pylint: disable=g-import-not-at-top
  if 'params' not in v:
    return None
  params = {'params': v['params']}
  rest = {k: t for k, t in v.items() if k != 'params'}

  def loss(p):
    return jnp.sum(model.apply({**rest, **p}, x) ** 2)

  wrt, ref = _filters(prog)[0], _REFERENCE[prog.filters[0]]
  want = {p: g for p, g in _leaves(jax.jit(jax.grad(loss))(params)).items()
          if ref(p)}
  if not want:
    return None
  got = _leaves(jax.jit(state.grad(loss, wrt))(params))
  if set(got) != set(want):
    return f'state.grad paths {sorted(got)}, expected {sorted(want)}'
  for p, g in want.items():
    if not np.allclose(got[p], g, rtol=compare.RTOL, atol=compare.ATOL):
      return f'state.grad {"/".join(p)}: values differ'
  tx = optax.multi_transform(
      {'train': optax.sgd(0.1), 'frozen': optax.set_to_zero()},
      state.labels(params, {'train': wrt, 'frozen': ...}))
  @jax.jit
  def train_step(p, opt_state):
    updates, opt_state = tx.update(jax.grad(loss)(p), opt_state, p)
    return optax.apply_updates(p, updates), opt_state

  p, opt_state = params, tx.init(params)
  for _ in range(prog.steps):
    p, opt_state = train_step(p, opt_state)
  for path, before in _leaves(params).items():
    after = _leaves(p)[path]
    if not ref(path) and not np.array_equal(before, after):
      return f'frozen {"/".join(path)} moved in training'
  return None


def check(prog: Program) -> tuple:
  """The round trips and partial training (module docstring)."""
  import liftmods as nn  # pylint: disable=g-import-not-at-top
  model_cls = programs.build(prog.src, nn)
  x = jax.random.normal(jax.random.key(42), programs.INPUT_SHAPE)
  try:
    v = jax.jit(model_cls().init)(jax.random.key(0), x)
    model_cls().apply(v, x)
  except Exception as e:  # pylint: disable=broad-except
    return 'both_raise', f'the model itself raised {type(e).__name__}'
  for step in (lambda: _check_split(v, prog), lambda: _check_surgery(v),
               lambda: _check_training(model_cls(), v, x, prog)):
    d = step()
    if d:
      return 'mismatch', d
  return 'ok', ''
