"""Families on 8 simulated CPU devices: ``init_sharded``, ``nn.shard_map``
and Explicit meshes.

Imported only in a process started with 8 devices (``families.get``; the
soak's worker, or a cases file run by ``multidevice.assert_cases_pass``).

- ``sharded_init``: a random stack of Dense / LayerNorm layers whose
  variables carry random logical names, random rules and a random mesh over
  the 8 devices (1 to 3 axes, Auto or Explicit). ``nn.init_sharded`` must
  give ``jax.jit(model.init)``'s values bit for bit, each array placed as
  Linen's ``logical_to_mesh_axes`` says (the oracle), and the returned
  shardings equal the arrays'. A dimension its mesh axes do not divide must
  raise ``ShardingDivisibilityError``.
- ``shard_map``: a random per-shard block (layers, optionally a ``pmean``
  over the batch axes) under ``nn.shard_map`` with a random mesh, batch
  spec and ``axis_names`` subset, the block's own layers possibly under
  ``nn.remat``, ``nn.scan`` or ``nn.remat_scan`` and the mapped module
  possibly under ``nn.remat``, against a hand-written ``jax.shard_map``
  of ``Block().apply`` on the same parameters (under ``jax.checkpoint``
  where the map is under ``nn.remat``): outputs and gradients
  allclose, the same output sharding, and no more per-device flops
  (``cost_analysis``) than the hand-written one. Batches the mesh axes do
  not divide must raise a ``ValueError`` on both. The block may hold
  dropout, run in training with a random ``split_rngs`` for its sequence
  (``False``, ``True`` or one manual axis); the hand-written map folds the
  key with the shard's index over those axes, as docs/shard_map.md
  promises. And ``init`` through the map (``split_rngs={'params': False}``)
  must give the unmapped block's parameters: bit for bit those of a
  hand-written ``jax.shard_map`` of its ``init`` with the same keys, and
  to float32 rounding those of ``jax.jit`` of it (XLA may round an
  initializer's scale one ulp apart in the two programs).
- ``explicit``: the ``sharded_init`` family's models, initialized with
  ``init_sharded`` and differentiated on a batch sharded over ``'data'``,
  on an Explicit (or mixed Explicit and Auto) mesh against the same on an
  Auto mesh: loss and gradients allclose, and no more bytes through
  collectives in the compiled step, whose gradients both sides return laid
  out as their parameters.
"""
import dataclasses
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from . import compare, programs

MESHES = (((8,), ('data',)), ((4, 2), ('data', 'model')),
          ((2, 4), ('data', 'model')), ((2, 2, 2), ('data', 'model', 'x')),
          ((1, 8), ('data', 'model')))
NAMES = ('embed', 'mlp', 'heads', None)
TARGETS = (None, 'data', 'model', ('data', 'model'), 'x')


def _mesh(shape, names, explicit, explicit_axes=()):
  """A mesh whose axes are all Explicit (``explicit``) or Auto, or, given
  ``explicit_axes``, Explicit on those only."""
  if explicit_axes:
    kinds = tuple(AxisType.Explicit if n in explicit_axes else AxisType.Auto
                  for n in names)
    return jax.make_mesh(shape, names, axis_types=kinds)
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


# -- sharded_init -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InitProgram:
  """Layers ``(kind, features, names)``, rules, mesh."""
  layers: tuple
  rules: tuple
  mesh: int  # index into MESHES
  explicit: bool
  in_features: int
  # explicit family: which mesh axes are Explicit on the side compared
  # with the all-Auto mesh (a mixed mesh when some are not; () all are)
  explicit_axes: tuple = ()


def draw_init(c: programs.Chooser) -> InitProgram:
  """A random model, rules and mesh."""
  mesh = c.integer(0, len(MESHES) - 1)
  axes = MESHES[mesh][1]
  layers = []
  for _ in range(c.integer(1, 3)):
    kind = c.choice(['dense', 'dense', 'norm'])
    first = c.choice(NAMES)
    # A name twice in one array is refused (Linen too): now and then.
    second = c.choice([n for n in NAMES if n != first or n is None]
                      if c.boolean(0.9) else NAMES)
    layers.append((kind, c.choice([8, 16, 4, 6]), (first, second)))
  rules = []
  for name in NAMES[:-1]:
    if c.boolean(0.85):
      target = c.choice([t for t in TARGETS if t is None or all(
          a in axes for a in ((t,) if isinstance(t, str) else t))])
      rules.append((name, target))
  return InitProgram(tuple(layers), tuple(rules), mesh, c.boolean(0.3),
                     c.choice([8, 4]))


def _init_model(nn, prog: InitProgram):
  """The module for ``prog`` (written with ``nn``)."""

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      features = x.shape[-1]
      for kind, width, (a, b) in prog.layers:
        if kind == 'norm':
          x = nn.LayerNorm(scale_init=nn.with_logical_partitioning(
              nn.initializers.ones, (b,)), bias_init=nn.with_logical_partitioning(
                  nn.initializers.zeros, (b,)))(x)
          continue
        x = nn.Dense(width, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), (a, b)),
                     bias_init=nn.with_logical_partitioning(
                         nn.initializers.normal(0.1), (b,)))(x)
        features = width
      del features
      return x

  return Model()


def _divides(shape, spec, mesh) -> bool:
  for dim, axes in zip(shape, spec):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    if dim % int(np.prod([mesh.shape[a] for a in axes] or [1])):
      return False
  return True


def _same_programs(fn_a, fn_b, *args) -> bool:
  """Whether two jitted functions compile to the same per-device program
  (tests/program_compare.py's canonical optimized HLO)."""
  tests = str(pathlib.Path(__file__).resolve().parents[2])
  if tests not in sys.path:  # run by benchmarks.fuzz, outside pytest
    sys.path.append(tests)
  import program_compare  # pylint: disable=g-import-not-at-top
  return (program_compare.optimized_hlo(fn_a, *args) ==
          program_compare.optimized_hlo(fn_b, *args))


def check_init(prog: InitProgram) -> tuple:
  """``init_sharded`` against ``jax.jit(init)`` and Linen's rules."""
  import flax.linen as fnn  # pylint: disable=g-import-not-at-top
  import liftmods as nn  # pylint: disable=g-import-not-at-top
  mesh = _mesh(*MESHES[prog.mesh], prog.explicit)
  model = _init_model(nn, prog)
  x = jax.random.normal(jax.random.key(1), (4, prog.in_features))
  key = jax.random.key(0)
  boxed = jax.eval_shape(model.init, key, x)['params']
  expected = {}
  fits, linen_error = True, None
  for path, box in jax.tree_util.tree_flatten_with_path(
      boxed, is_leaf=lambda b: hasattr(b, 'names'))[0]:
    try:
      spec = fnn.logical_to_mesh_axes(box.names, prog.rules) or P()
    except ValueError as e:  # a name twice in one array
      linen_error = linen_error or e
      continue
    expected[jax.tree_util.keystr(path)] = spec
    fits &= _divides(box.value.shape, spec, mesh)
  try:
    with jax.set_mesh(mesh) if prog.explicit else _null():
      variables, shardings = nn.init_sharded(model, mesh, prog.rules,
                                             warn_unmapped=False)(key, x)
  except ValueError as e:
    if linen_error is not None:
      return 'both_raise', f'{type(e).__name__} (Linen: {linen_error})'
    if not fits and isinstance(e, nn.errors.ShardingDivisibilityError):
      return 'both_raise', 'ShardingDivisibilityError'
    return 'mismatch', f'refused a valid model: {type(e).__name__}: {e}'
  if linen_error is not None:
    return 'mismatch', f'accepted what Linen refuses: {linen_error}'
  if not fits:
    return 'mismatch', 'accepted a dimension its mesh axes do not divide'
  with jax.set_mesh(mesh) if prog.explicit else _null():
    plain = jax.jit(model.init)(key, x)
    # Bit for bit where the two per-device programs are the same; else to
    # float32 rounding (jax 0.12 rounds a few entries of a sharded normal
    # init one ulp apart from the unsharded program's).
    same = _same_programs(nn.init_sharded(model, mesh, prog.rules,
                                          warn_unmapped=False),
                          jax.jit(model.init), key, x)
  plain = nn.meta.unbox(plain)
  d = compare.diff_trees(compare._plain(plain), compare._plain(variables),  # pylint: disable=protected-access
                         exact=same)
  if d:
    return 'mismatch', f'values: {d}'
  got = jax.tree_util.tree_flatten_with_path(variables['params'])[0]
  given = jax.tree_util.tree_leaves(shardings['params'])
  for (path, value), sharding in zip(got, given):
    name = jax.tree_util.keystr(path)
    want = NamedSharding(mesh, expected[name])
    if not value.sharding.is_equivalent_to(want, value.ndim):
      return 'mismatch', (f'{name}: placed {value.sharding.spec}, rules say '
                          f'{expected[name]}')
    if not sharding.is_equivalent_to(want, value.ndim):
      return 'mismatch', f'{name}: returned sharding {sharding.spec}'
  return 'ok', ''


class _null:  # pylint: disable=invalid-name

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


# -- shard_map ------------------------------------------------------------------

BLOCK_FEATURES = {f: False for f in programs.FEATURES}
BLOCK_FEATURES.update({f: True for f in (
    'dense', 'dense_general', 'layer_norm', 'rms_norm', 'activation',
    'param', 'submodule', 'conv', 'dropout', 'remat', 'scan',
    'remat_scan')})


@dataclasses.dataclass(frozen=True)
class MapProgram:
  """A per-shard block and how it is mapped."""
  src: str
  mesh: int
  explicit: bool
  batch_axes: tuple   # mesh axes the batch is split over
  manual: tuple | None  # axis_names (None: all)
  pmean: bool
  batch: int
  train: bool = False
  split: bool | str = False  # split_rngs of the 'dropout' sequence
  remat: bool = False  # the mapped module under nn.remat


def draw_map(c: programs.Chooser) -> MapProgram:
  """A random block, mesh, batch spec and manual axes."""
  gen = programs.Generator(c, BLOCK_FEATURES, max_depth=2)
  # Not pure, for dropout; BLOCK_FEATURES leaves out the other ops that
  # write collections, which do not cross this map.
  gen.node(c.integer(1, 2), len(programs.INPUT_SHAPE), pure=False,
           name='Block')
  mesh = c.integer(0, len(MESHES) - 1)
  axes = MESHES[mesh][1]
  manual = None if c.boolean(0.5) else tuple(
      a for a in axes if c.boolean(0.6)) or axes[:1]
  usable = axes if manual is None else manual
  batch_axes = tuple(a for a in usable if c.boolean(0.6))
  explicit, pmean = c.boolean(0.4), c.boolean(0.3)
  batch = c.weighted([(8, 4), (16, 2), (6, 1)])
  train = c.boolean(0.5)
  split = c.choice((False, True) + tuple(sorted(usable)))
  return MapProgram('\n\n'.join(gen.classes) + '\n', mesh, explicit,
                    batch_axes, manual, pmean, batch, train, split,
                    remat=c.boolean(0.3))


def _per_shard(block, prog):
  def fn(apply_block, x):
    y = apply_block(x)
    if prog.pmean and prog.batch_axes:
      y = y + jax.lax.pmean(y, prog.batch_axes)
    return y
  return fn


def _key_split_over(prog, mesh) -> tuple:
  """The mesh axes the dropout keys differ along (docs/shard_map.md)."""
  manual = prog.manual or mesh.axis_names
  if prog.split is True:
    return tuple(manual)
  return (prog.split,) if prog.split else ()


def _shard_key(key, mesh, axes):
  """``key`` folded with this shard's row-major index over ``axes``."""
  if not axes:
    return key
  index = 0
  for name in mesh.axis_names:
    if name in axes:
      index = index * mesh.shape[name] + jax.lax.axis_index(name)
  return jax.random.fold_in(key, index)


def _outcome(fn, mesh, *args):
  """``(outputs, compiled)`` of ``jax.jit(fn)``, or the exception."""
  try:
    with jax.set_mesh(mesh):
      compiled = jax.jit(fn).lower(*args).compile()
      return compiled(*args), compiled
  except Exception as e:  # pylint: disable=broad-except
    return e


def _both_raised(a, b):
  """The verdict when either side raised, else None."""
  if not isinstance(a, Exception) and not isinstance(b, Exception):
    return None
  if isinstance(a, Exception) and isinstance(b, Exception):
    if isinstance(b, ValueError) and not isinstance(a, ValueError):
      return 'mismatch', (f'jax.shard_map raised ValueError, liftmods '
                          f'{type(a).__name__}: {a}')
    return 'both_raise', f'{type(b).__name__} ({type(a).__name__})'
  who = 'liftmods' if isinstance(a, Exception) else 'jax.shard_map'
  err = a if isinstance(a, Exception) else b
  return 'mismatch', f'only {who} raised {type(err).__name__}: {err}'


def check_map(prog: MapProgram) -> tuple:
  """``nn.shard_map`` against ``jax.shard_map`` (module docstring)."""
  import liftmods as nn  # pylint: disable=g-import-not-at-top
  mesh = _mesh(*MESHES[prog.mesh], prog.explicit)
  block = programs.build(prog.src.replace('class Block', 'class Model'), nn)
  per_shard = _per_shard(block, prog)
  spec = P(prog.batch_axes or None)
  names = set(prog.manual) if prog.manual else set(mesh.axis_names)
  x = jax.random.normal(jax.random.key(42), (prog.batch,) +
                        programs.INPUT_SHAPE[1:])
  drop_key = jax.random.key(7)
  split_over = _key_split_over(prog, mesh)

  class Ref(nn.Module):  # the block at the path it has inside Mapped

    @nn.compact
    def __call__(self, x):
      return block(train=prog.train, name='block')(x)

  class Mapped(nn.Module):

    @nn.compact
    def __call__(self, x):
      def body(mdl, x):
        return per_shard(mdl, x)
      return nn.shard_map(body, mesh, in_specs=spec, out_specs=spec,
                          variable_specs={'params': P()},
                          split_rngs={'params': False, 'dropout': prog.split},
                          axis_names=prog.manual)(
                              block(train=prog.train, name='block'), x)

  if prog.remat:
    Mapped = nn.remat(Mapped)  # pylint: disable=invalid-name
  rngs = {'params': jax.random.key(0), 'dropout': drop_key}
  try:
    ref_vars = jax.jit(lambda: Ref().init(rngs, x[:1]))()
  except Exception as e:  # pylint: disable=broad-except
    # A block that cannot initialize (a scan writing a broadcast
    # collection) must fail through the map: the same way, or refused
    # before it for the map's own configuration (a ValueError: a batch the
    # mesh axes do not divide, seed 61296).
    got = _outcome(lambda: Mapped().init(rngs, x), mesh)
    if isinstance(got, Exception) and (type(got) is type(e) or
                                       isinstance(got, ValueError)):
      return 'both_raise', f'init: {type(e).__name__}'
    return 'mismatch', (f'the unmapped init raised {type(e).__name__}; '
                        f'through the map: {got!r:.300}')
  params = ref_vars.get('params', {})

  def ours(p, x):
    return Mapped().apply({'params': p}, x, rngs={'dropout': drop_key})

  def theirs(p, x):
    if prog.explicit:  # jax.shard_map takes Explicit inputs as they are laid
      x = jax.sharding.reshard(x, spec)
    body = lambda p, x: per_shard(lambda x: Ref().apply(
        {'params': p}, x,
        rngs={'dropout': _shard_key(drop_key, mesh, split_over)}), x)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), spec),
                           out_specs=spec, axis_names=names)
    return (jax.checkpoint(mapped) if prog.remat else mapped)(p, x)

  results = []
  for fn in (ours, theirs):
    loss = lambda p, x, fn=fn: jnp.sum(fn(p, x) ** 2)
    results.append(_outcome(
        lambda p, x, fn=fn, loss=loss: (fn(p, x), jax.grad(loss, (0, 1))(
            p, x)), mesh, params, x))
  raised = _both_raised(*results)
  if raised:
    return raised
  (out_a, comp_a), (out_b, comp_b) = results
  d = compare.diff_trees(compare._plain(out_b), compare._plain(out_a),  # pylint: disable=protected-access
                         exact=False)
  if d:
    return 'mismatch', f'values: {d}'
  if not out_a[0].sharding.is_equivalent_to(out_b[0].sharding, 3):
    return 'mismatch', (f'output sharding {out_a[0].sharding} vs '
                        f'{out_b[0].sharding}')
  flops_a, flops_b = _flops(comp_a), _flops(comp_b)
  if flops_a > flops_b * 1.05 + 64:
    return 'mismatch', (f'per-device flops {flops_a:.0f} vs the hand-written '
                        f'{flops_b:.0f}')
  def hand_init(x):  # the unmapped block's init, per shard, same keys
    if prog.explicit:
      x = jax.sharding.reshard(x, spec)
    return jax.shard_map(
        lambda x: Ref().init(rngs, x[:1]).get('params', {}), mesh=mesh,
        in_specs=spec, out_specs=P(), axis_names=names, check_vma=False)(x)

  return _check_map_init(Mapped, ref_vars, hand_init, rngs, mesh, x)


def _check_map_init(mapped, ref_vars, hand_init, rngs, mesh, x) -> tuple:
  """``init`` through the map against the unmapped block's: bit for bit
  ``hand_init``'s (a ``jax.shard_map`` of it), to float32 rounding
  ``ref_vars`` (``jax.jit`` of it, another program)."""
  got = _outcome(lambda: mapped().init(rngs, x), mesh)
  if isinstance(got, Exception):
    return 'mismatch', (f'init through nn.shard_map raised '
                        f'{type(got).__name__}: {got}')
  got = compare._plain(got[0].get('params', {}))  # pylint: disable=protected-access
  hand = _outcome(hand_init, mesh, x)
  if isinstance(hand, Exception):
    return 'mismatch', (f'the hand-written jax.shard_map init raised '
                        f'{type(hand).__name__}: {hand}')
  d = (compare.diff_trees(compare._plain(hand[0]), got, exact=True) or  # pylint: disable=protected-access
       compare.diff_trees(compare._plain(ref_vars.get('params', {})),  # pylint: disable=protected-access
                          got, exact=False))
  if d:
    return 'mismatch', f'init through the map: {d}'
  return 'ok', ''


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float((cost or {}).get('flops', 0.0))


# -- explicit -------------------------------------------------------------------


# The batch of the explicit family's step: 8 rows per device. With one row
# per device (8 in all) the partitioner on the Auto mesh gathers the
# activations rather than the weights wherever a row is smaller than a
# weight shard (seeds 3005, 3061: 388 and 924 bytes where Explicit moves 772
# and 1436); from 32 rows on both move the same bytes for those programs,
# and Auto more than Explicit for others (seed 3072 at 512 rows: 13,660
# against 3,600).
EXPLICIT_ROWS = 64
GROWTH_ROWS = 1024  # where the excess over Auto is measured again


def draw_explicit(c: programs.Chooser) -> InitProgram:
  """A random model, rules and mesh (the sharded_init family's), run on a
  mesh whose axes are all Explicit or, a third of the time, some Explicit
  and the others Auto (``explicit`` is ignored: both meshes are run)."""
  prog = draw_init(c)
  names = MESHES[prog.mesh][1]
  if len(names) == 1 or c.boolean(0.67):
    return prog
  chosen = tuple(n for n in names if c.boolean()) or names[:1]
  return dataclasses.replace(prog, explicit_axes=chosen)


_COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter',
                'collective-permute', 'all-to-all')


def collective_bytes(hlo: str) -> int:
  """Bytes of the results of the collectives in compiled HLO text."""
  op = re.compile(r'=\s*(.*?)\s(?:' + '|'.join(_COLLECTIVES) +
                  r')(?:-start)?\(')
  total = 0
  for line in hlo.splitlines():
    match = op.search(line)
    if not match:
      continue
    for dtype, dims in re.findall(r'([a-z]+\d*)\[([\d,]*)\]',
                                  match.group(1)):
      bits = int(re.sub(r'\D', '', dtype) or 8)
      size = int(np.prod([int(d) for d in dims.split(',') if d] or [1]))
      total += size * max(bits, 8) // 8
  return total


def check_explicit(prog: InitProgram) -> tuple:
  """The model initialized with ``init_sharded`` and trained one step on
  an Explicit mesh, against the same on an Auto mesh: values, gradients,
  and no more collective bytes in the compiled step. Where it moves more,
  the report says whether the excess grows with the batch (measured again
  at ``GROWTH_ROWS``), is the same (weight-sized), shrinks, or is gone at
  that size."""
  verdict, detail, moved = _check_explicit(prog, EXPLICIT_ROWS)
  if verdict == 'mismatch' and moved:
    _, again_detail, again = _check_explicit(prog, GROWTH_ROWS)
    if again is None:
      return verdict, f'{detail}; at {GROWTH_ROWS} rows: {again_detail}'
    excess, first = again[0] - again[1], moved[0] - moved[1]
    verdict_text = ('no excess at that size' if excess <= 0 else
                    'the excess grows with the batch' if excess > first else
                    'the excess is the same' if excess == first else
                    'the excess shrinks with the batch')
    detail += (f'; at {GROWTH_ROWS} rows Explicit {again[0]}, Auto '
               f'{again[1]} ({verdict_text})')
  return verdict, detail


def _check_explicit(prog: InitProgram, rows: int) -> tuple:
  """``(verdict, detail, moved)`` of the step at ``rows`` rows: ``moved``
  is the collective bytes (Explicit, Auto) where both steps ran and agree
  in value, else None."""
  import liftmods as nn  # pylint: disable=g-import-not-at-top
  model = _init_model(nn, prog)
  results = {}
  for explicit in (False, True):
    mesh = _mesh(*MESHES[prog.mesh], explicit,
                 prog.explicit_axes if explicit else ())
    x = jax.random.normal(jax.random.key(1), (rows, prog.in_features))
    try:
      with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P('data')))
        variables, shardings = nn.init_sharded(model, mesh, prog.rules,
                                               warn_unmapped=False)(
                                                   jax.random.key(0), x)
        loss = lambda p, x: jnp.sum(model.apply({'params': p}, x) ** 2)
        # The gradients laid out as their parameters, as an update of the
        # parameters needs them: left free, the Auto step returns some in
        # another layout and leaves the resharding out of its count.
        step = jax.jit(jax.value_and_grad(loss), out_shardings=(
            NamedSharding(mesh, P()), shardings.get('params', {})))
        compiled = step.lower(variables['params'], x).compile()
        out = compiled(variables['params'], x)
    except ValueError as e:
      results[explicit] = e
      continue
    results[explicit] = (compare._plain(out),  # pylint: disable=protected-access
                         collective_bytes(compiled.as_text()))
  auto, explicit = results[False], results[True]
  if isinstance(auto, Exception) or isinstance(explicit, Exception):
    if isinstance(auto, Exception) and isinstance(explicit, Exception):
      return 'both_raise', type(explicit).__name__, None
    who = 'Auto' if isinstance(auto, Exception) else 'Explicit'
    err = auto if isinstance(auto, Exception) else explicit
    return 'mismatch', (f'only the {who} mesh raised {type(err).__name__}: '
                        f'{str(err)[:300]}'), None
  # The two meshes' programs sum in different orders, and a LayerNorm's
  # input gradient is a difference of terms as large as its scale's
  # gradient (seed 2017 at 64 rows: 1e-5 apart on a kernel gradient of 4e-4,
  # beside a scale gradient of 212): held to ATOL of the largest magnitude.
  d = compare.diff_trees(auto[0], explicit[0], exact=False, scaled=True)
  if d:
    return 'mismatch', f'values: {d}', None
  moved = (explicit[1], auto[1])
  if explicit[1] > auto[1]:
    return 'mismatch', (f'collective bytes: Explicit {explicit[1]}, Auto '
                        f'{auto[1]}'), moved
  return 'ok', '', moved
