"""Runs one generated program under flax.linen and liftmods and compares.

Stages, in order: ``init`` for two seeds, then ``apply`` (with a random
``train`` flag and a random set of mutable collections), which also takes
the gradient of the summed squared output with respect to params (and
perturbations, when there are any; forward mode through while loops). A stage that raises ends the run; the error's class
is recorded instead of results.

Verdicts (``compare`` returns ``(verdict, detail)``):

- ``'ok'``: both ran every stage and agree — same variable trees, init
  values bit for bit, outputs / mutated collections / gradients allclose.
- ``'both_raise'``: Linen raised and liftmods raised a compatible error at
  the same stage (same class name; or, where Linen's class is a builtin
  like ``TypeError``, an instance of it).
- ``'mismatch'``: anything else; ``detail`` says what differed.
"""
import builtins
import contextlib
import dataclasses
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from . import programs

STAGES = ('init0', 'init1', 'apply')
RTOL, ATOL = 1e-4, 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
  """A program plus how it is run."""
  src: str
  train: bool = True
  init_train: bool = False
  mutable: tuple = ()
  # The reference's source, where it is not ``src`` itself (a feature with
  # no Linen name, compared with the Linen program that must equal it).
  ref_src: str = None


def draw_case(chooser, features=None, max_depth=4) -> Case:
  src = programs.generate(chooser, features, max_depth)
  mutable = tuple(c for c in ('batch_stats', 'intermediates', 'state')
                  if chooser.boolean(0.7))
  return Case(src, chooser.boolean(), chooser.boolean(), mutable)


def _x():
  return jax.random.normal(jax.random.key(42), programs.INPUT_SHAPE)


def run(case: Case, nn, src: str = None) -> list:
  """``[(stage, result)]`` up to the first raise, whose result is the
  exception (with ``__traceback_text__`` set). ``src`` replaces
  ``case.src``."""
  out = []
  x = _x()
  try:
    model_cls = programs.build(src or case.src, nn)
    init_model = model_cls(train=case.init_train)
    # Everything runs jitted: one compile per stage instead of one per
    # eager loop primitive, which is what keeps a program well under a second.
    init = jax.jit(init_model.init)
    variables = None
    for stage, seed in (('init0', 0), ('init1', 7)):
      v = init({'params': jax.random.key(seed),
                'dropout': jax.random.key(seed + 1)}, x)
      out.append((stage, _plain(v)))
      variables = variables or v
    model = model_cls(train=case.train)
    rngs = {'dropout': jax.random.key(3)}
    mutable = list(case.mutable)
    diff = {k: v for k, v in variables.items()
            if k in ('params', 'perturbations')}
    rest = {k: v for k, v in variables.items() if k not in diff}

    def loss(d):
      y, mutated = model.apply({**rest, **d}, x, rngs=rngs, mutable=mutable)
      return jnp.sum(y ** 2), (y, mutated)

    # Outputs, mutated collections and gradients come from one compiled
    # function: a program costs two compiles per library.
    if 'while_loop' in case.src:  # no reverse mode through while loops
      tangent = jax.tree_util.tree_map(jnp.ones_like, diff)

      def step(d):
        value, slope, aux = jax.jvp(loss, (d,), (tangent,), has_aux=True)
        return (value, aux), slope

      step = jax.jit(step)
    else:
      step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, (y, mutated)), grads = step(diff)
    out.append(('apply', (_plain(y), _plain(mutated), _plain(grads))))
  except Exception as e:  # pylint: disable=broad-except
    e.__traceback_text__ = traceback.format_exc()
    out.append((STAGES[len(out)], e))
  return out


def _plain(tree):
  """Nested plain dicts/tuples of numpy arrays (FrozenDicts unfrozen)."""
  if hasattr(tree, 'items'):
    return {k: _plain(v) for k, v in tree.items()}
  if isinstance(tree, (tuple, list)):
    return tuple(_plain(v) for v in tree)
  if isinstance(tree, jax.Array) and jnp.issubdtype(tree.dtype,
                                                    jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(tree))
  return np.asarray(tree)


def _flat(tree, prefix=''):
  if isinstance(tree, dict):
    items = {}
    for k in sorted(tree, key=str):
      items.update(_flat(tree[k], f'{prefix}/{k}'))
    if not tree:
      items[prefix + '/{}'] = None
    return items
  if isinstance(tree, tuple):
    items = {}
    for i, v in enumerate(tree):
      items.update(_flat(v, f'{prefix}[{i}]'))
    if not tree:
      items[prefix + '()'] = None
    return items
  return {prefix: tree}


def diff_trees(a, b, exact: bool, scaled: bool = False):
  """A description of the first difference between ``a`` and ``b``, or
  ``None``. ``scaled`` measures ``ATOL`` in units of the tree's largest
  magnitude (for a reference that is a different program, whose rounding
  differs: a gradient that is zero but for rounding, beside large ones)."""
  fa, fb = _flat(a), _flat(b)
  if list(fa) != list(fb):
    return (f'trees differ: only linen {sorted(set(fa) - set(fb))}, only '
            f'liftmods {sorted(set(fb) - set(fa))}')
  largest = max([1.0] + [float(np.max(np.abs(v), initial=0))
                         for v in fa.values() if v is not None and
                         np.issubdtype(v.dtype, np.floating)])
  for path, va in fa.items():
    vb = fb[path]
    if va is None:
      continue
    if va.shape != vb.shape or va.dtype != vb.dtype:
      return (f'{path}: linen {va.dtype}{va.shape}, liftmods '
              f'{vb.dtype}{vb.shape}')
    if exact:
      same = np.array_equal(va, vb, equal_nan=True)
    else:
      scale = largest if scaled and np.issubdtype(va.dtype, np.floating) \
          else 1.0
      same = np.allclose(va, vb, rtol=RTOL, atol=ATOL * scale, equal_nan=True)
    if not same:
      return f'{path}: values differ ({"bitwise" if exact else "allclose"})'
  return None


def compatible_errors(linen_err, ours_err) -> bool:
  """Ours is Linen's class (by name, or a subclass of the liftmods class of
  that name), or an instance of the builtin class Linen raised."""
  lname = type(linen_err).__name__
  if any(c.__name__ == lname for c in type(ours_err).__mro__):
    return True
  builtin = getattr(builtins, lname, None)
  return (isinstance(builtin, type) and issubclass(builtin, BaseException)
          and type(linen_err) is builtin and isinstance(ours_err, builtin))


@contextlib.contextmanager
def xla_optimizations(enabled: bool):
  """Compiles with XLA's optimizations on or off, restoring the setting.

  Off, a program compiles about twice as fast, and both libraries still get
  the same compiler on the same (or equivalent) program: the comparison is
  of the module systems, not of XLA.
  """
  before = jax.config.read('jax_disable_most_optimizations')
  jax.config.update('jax_disable_most_optimizations', not enabled)
  try:
    yield
  finally:
    jax.config.update('jax_disable_most_optimizations', before)


def _diff_init(va, vb, exact_cols, scaled):
  """``diff_trees`` of two inits: bit for bit, or only the collections in
  ``exact_cols`` (when given) and the rest allclose."""
  if exact_cols is None:
    return diff_trees(va, vb, exact=True)
  part = lambda v, inside: {k: x for k, x in v.items()
                            if (k in exact_cols) == inside}
  return (diff_trees(part(va, True), part(vb, True), exact=True) or
          diff_trees(part(va, False), part(vb, False), exact=False,
                     scaled=scaled))


def linen_bug_fixed(case: Case, stage: str, err: Exception) -> bool:
  """Whether Linen's error is one of its bugs liftmods fixes on purpose
  (docs/coming-from-linen.md, "Linen issues that work in liftmods"): a
  map_variables(init=True) drops the read-only mapped collections after
  its init pass, so apply with another mutable collection finds 'params'
  empty (flax#2773); a scan whose body creates a collection it carries
  fails JAX's carry check during init (flax#2052)."""
  if (stage.startswith('init') and isinstance(err, TypeError) and
      'carry' in str(err) and 'variable_carry=' in case.src):
    return True
  return (stage.startswith('apply') and
          type(err).__name__ == 'ScopeCollectionNotFound' and
          'init=True' in case.src and 'map_variables(' in case.src)


def compare(case: Case, linen, ours, optimize: bool = False,
            scaled: bool = False, exact_cols=None):
  """Runs ``case`` under both namespaces; returns ``(verdict, detail)``.
  ``optimize=False`` compiles without XLA's optimizations (faster);
  ``scaled`` is ``diff_trees``'s; ``exact_cols`` (default: all) are the
  collections whose init must be bit for bit."""
  with xla_optimizations(optimize):
    ra, rb = run(case, linen, case.ref_src), run(case, ours)
  for (stage, va), (stage_b, vb) in zip(ra, rb):
    ea, eb = isinstance(va, Exception), isinstance(vb, Exception)
    if stage != stage_b:
      raise AssertionError('stages out of step')
    if ea and eb:
      if compatible_errors(va, vb):
        return 'both_raise', f'{stage}: {type(va).__name__}'
      return 'mismatch', (
          f'{stage}: linen raised {type(va).__name__}, liftmods raised '
          f'{type(vb).__name__}\n--- liftmods:\n{vb.__traceback_text__}'
          f'--- linen:\n{va.__traceback_text__}')
    if ea and not eb and linen_bug_fixed(case, stage, va):
      return 'linen_fails', f'{stage}: {type(va).__name__} (fixed in liftmods)'
    if ea or eb:
      who, err = ('linen', va) if ea else ('liftmods', vb)
      return 'mismatch', (f'{stage}: only {who} raised {type(err).__name__}'
                          f'\n{err.__traceback_text__}')
    if stage.startswith('init'):
      d = _diff_init(va, vb, exact_cols, scaled)
    else:
      d = diff_trees(va, vb, exact=False, scaled=scaled)
    if d:
      return 'mismatch', f'{stage}: {d}'
  if len(ra) != len(rb):
    return 'mismatch', 'different number of stages'
  return 'ok', ''
