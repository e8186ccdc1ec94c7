"""The loops of a pipelined layer stack, over one layer function.

A pipeline lays ``S`` stages along one mesh axis; each holds ``K`` layers
per repeat (``R`` repeats, ``L = R·S·K``) and the batch is cut into ``M``
microbatches. Two loops run the layers:

- :func:`run_pipeline` without ``training``: the forward loop of GPipe (and
  of the circular schedule, ``R > 1``). Each iteration every stage runs its
  layers on one microbatch and passes the result to the next stage with a
  collective permute; ``jax.grad`` differentiates the whole loop.
- with ``training`` (a :class:`Training`): one forward and one backward
  (1F1B). Each iteration a stage runs one microbatch forward and another
  backward, recomputing the latter from the stage input it stored, so a
  stage holds at most ``2S − 1`` microbatch inputs whatever ``M`` is. The
  loop calls the loss itself, on stage 0 up to the stack and on the last
  stage from it, and returns a surrogate loss that carries every gradient.

The caller supplies the pipeline's shape (a :class:`Layout`), the mesh, the
layer function and the stacked variables in the layout's stored
(stage-major) order, and words the errors (an :class:`Explain`).

>>> import jax.numpy as jnp
>>> microbatches({'x': jnp.arange(6)}, 3, None)['x'].tolist()
[[0, 3], [1, 4], [2, 5]]
>>> joined({'x': jnp.array([[0, 3], [1, 4], [2, 5]])})['x'].tolist()
[0, 1, 2, 3, 4, 5]
"""
import dataclasses
import functools
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from liftmods import jax_private

tree_map = jax.tree_util.tree_map
leaves_of = jax.tree_util.tree_leaves


class Layout(Protocol):
  """What the loops read of a pipeline's configuration."""
  stages: int
  microbatches: int
  repeats: int
  axis: str
  remat_iterations: bool
  per_microbatch: Sequence[str]

  @property
  def iterations(self) -> int:
    """The number of iterations the loop runs."""

  def stage_major(self, tree: Any) -> Any:
    """``tree``'s leading (layer) axis from layer order to stored order."""


class Explain(Protocol):
  """The errors of the pipeline loops, worded by their caller."""

  def batch(self, shape: tuple, microbatches: int) -> Exception:
    """A carry leaf of ``shape`` has no leading axis divisible by
    ``microbatches``."""

  def mutable(self, collection: str) -> Exception:
    """The layers may update ``collection``, which a pipeline would update
    once per microbatch."""

  def wrote(self, updated: Any, held: Any) -> Exception:
    """The layers wrote mutable variables of tree structure ``updated``
    where the stack holds ``held``."""

  def argument(self, shape: tuple, microbatches: int) -> Exception:
    """A batched argument of the loss has shape ``shape``, whose leading
    axis ``microbatches`` does not divide."""

  def not_in_params(self) -> Exception:
    """The loss's params do not hold the stack's variables."""

  def input_shape(self, got: Any, want: Any) -> Exception:
    """On one microbatch the stack got an input of shapes ``got``, not
    ``want``."""

  def explicit_training(self, axes: tuple) -> Exception:
    """The one-forward-one-backward loop on a mesh whose ``axes`` are
    Explicit."""


class Training(Protocol):
  """What the 1F1B loop needs of the loss it differentiates.

  Attributes:
    params: the variables the loss is differentiated by (the stack's and
      the other layers').
    arrays: the array leaves of the loss's other arguments.
    batched: for each of ``arrays``, whether its leading axis is the batch
      (split into microbatches) or it is passed whole.
    has_aux: the loss returns ``(loss, aux)``.
  """
  params: Any
  arrays: Sequence[Any]
  batched: Sequence[bool]
  has_aux: bool

  def call(self, params: Any, arrays: Sequence[Any], given: Any) -> Any:
    """The loss on ``arrays`` (one microbatch's), with the stack's call
    answered by ``given``: a :class:`Capture` records the stack's input and
    the loss runs on; any other value is the stack's output."""


class Capture:
  """Given to :meth:`Training.call` to learn the stack's input on one
  microbatch: the stack stores it in ``value`` and returns it."""
  value: Any = None


def run_pipeline(layout: Layout, mesh: Any, layer: Callable[..., Any],
                 policy: Callable[..., Any] | None, c: Any,
                 stacked: Sequence[dict], keys: Any, per_layer: tuple, *,
                 length: int, is_mutable: Callable[[str], bool],
                 explain: Explain, training: Training | None = None):
  """Runs ``length`` layers on the carry ``c`` on the pipeline's schedule.

  Args:
    layout: the pipeline's shape.
    mesh: a mesh with the axis ``layout.axis`` of ``layout.stages`` devices.
    layer: ``layer(c, (variables, keys, per_layer)) -> (c, (ys, mutable))``,
      one layer of the stack.
    policy: the ``jax.checkpoint`` policy of a layer, or None.
    c: the carry; its leaves' leading axis is the batch.
    stacked: one dict of collections per scope, every array with a leading
      axis of ``length`` layers in stored (stage-major) order.
    keys: the layers' rng keys, in layer order.
    per_layer: the per-layer arguments, in layer order.
    length: the number of layers; divisible by ``stages·repeats``.
    is_mutable: whether the layers update a collection.
    explain: the errors' wording.
    training: the loss, to run one-forward-one-backward; None runs the
      forward loop.

  Returns:
    ``(c, mutable, loss)``: the carry after the layers (under ``training``
    without ``has_aux`` only the input, which nothing reads), the updated
    mutable collections (stage-major) and, under ``training``, the
    surrogate loss (see :func:`surrogate`), otherwise None.
  """
  run = functools.partial(_run_pipeline, layout, mesh, layer, policy,
                          length=length, is_mutable=is_mutable,
                          explain=explain, training=training)
  context = jax.sharding.get_abstract_mesh()
  explicit = tuple(name for name, kind in zip(context.axis_names,
                                              context.axis_types)
                   if kind == jax.sharding.AxisType.Explicit)
  if not explicit:
    return run(c, stacked, keys, per_layer)
  if training is not None:
    raise explain.explicit_training(explicit)
  run = functools.partial(_run_pipeline, layout, None, layer, policy,
                          length=length, is_mutable=is_mutable,
                          explain=explain)
  # On Explicit axes an array's type carries its sharding, and the loops
  # slice and reshape along sharded axes (the stage axis, the batch into
  # microbatches), which JAX allows only where it can infer the result's
  # layout. So the loops run with those axes Auto (their shard_map on the
  # context's mesh, mesh=None), and the results come back laid out as the
  # inputs were.
  _, mutable = split_collections(layout, stacked, is_mutable, explain)
  out = (_specs(c), _specs(mutable), None if training is None else
         PartitionSpec())
  trees = (c, stacked, keys, per_layer)
  if training is not None:
    trees += (training.params, list(training.arrays))
  unique, rebuild = _distinct_leaves(trees)

  def region(*inner):
    c, stacked, keys, per_layer, *loss_inputs = rebuild(inner)
    inner_training = training and _Within(training, *loss_inputs)
    return run(c, stacked, keys, per_layer, training=inner_training)

  return jax.sharding.auto_axes(region, axes=explicit, out_sharding=out)(
      *unique)


def _specs(tree):
  return tree_map(lambda a: jax.typeof(a).sharding.spec, tree)


def _distinct_leaves(trees):
  """The distinct leaves of ``trees`` (by identity), and a function making
  ``trees`` again from replacements for them: the 1F1B loop finds the
  stack's parameters among the loss's by identity, which a transform
  boundary keeps only if a leaf crosses it once."""
  leaves, treedef = jax.tree_util.tree_flatten(trees)
  index, unique = {}, []
  for leaf in leaves:
    if id(leaf) not in index:
      index[id(leaf)] = len(unique)
      unique.append(leaf)
  positions = [index[id(leaf)] for leaf in leaves]
  return unique, lambda new: jax.tree_util.tree_unflatten(
      treedef, [new[i] for i in positions])


class _Within:
  """A :class:`Training` whose params and arrays are those inside a
  transform boundary (the loss itself is the caller's)."""

  def __init__(self, outer, params, arrays):
    self.outer, self.params, self.arrays = outer, params, arrays
    self.batched, self.has_aux = outer.batched, outer.has_aux

  def call(self, params, arrays, given):
    return self.outer.call(params, arrays, given)


def _run_pipeline(layout, mesh, layer, policy, c, stacked, keys, per_layer, *,
                  length, is_mutable, explain, training):
  fixed, mutable = split_collections(layout, stacked, is_mutable, explain)
  micro = microbatches(c, layout.microbatches, explain)
  staged = tuple(_staged(tree, layout) for tree in (
      fixed, mutable, layout.stage_major(keys),
      layout.stage_major(per_layer)))
  stage = stage_fn(layer, policy,
                   length // (layout.stages * layout.repeats), explain)
  if training is None:
    out, mutable = _shard(layout, mesh, functools.partial(
        _forward_stage, layout, stage), (micro,), staged)
    return joined(_at(out, 0)), _unstaged(mutable), None
  return _one_f_one_b(layout, training, stage, mesh, micro, fixed, staged,
                      explain)


# -- pieces ---------------------------------------------------------------------


def microbatches(c: Any, m: int, explain: Explain | None) -> Any:
  """``(B, ...) -> (M, B/M, ...)``, microbatch ``i`` holding rows ``i::M``
  (so a batch sharded over a data axis stays sharded in each)."""
  def split(x):
    shape = jnp.shape(x)
    if not shape or shape[0] % m:
      raise explain.batch(tuple(shape), m)
    return jnp.swapaxes(x.reshape((shape[0] // m, m) + shape[1:]), 0, 1)
  return tree_map(split, c)


def joined(c: Any) -> Any:
  """Inverse of :func:`microbatches`."""
  def join(x):
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
  return tree_map(join, c)


def _staged(tree, layout):
  """``(L, ...)`` stage-major -> ``(S, R, K, ...)``."""
  s, r = layout.stages, layout.repeats
  return tree_map(
      lambda a: a.reshape((s, r, a.shape[0] // (s * r)) + a.shape[1:]), tree)


def _unstaged(tree):
  return tree_map(lambda a: a.reshape((-1,) + a.shape[3:]), tree)


def _at(tree, i):
  return tree_map(lambda a: a[i], tree)


def _lead(tree):
  return tree_map(lambda a: a[None], tree)


def _select(pred, a, b):
  return tree_map(lambda x, y: jnp.where(pred, x, y), a, b)


def _put(buffer, i, value, ok):
  """``buffer`` with slot ``i`` set to ``value`` where ``ok``."""
  return tree_map(lambda b, a: b.at[i].set(jnp.where(ok, a, b[i])), buffer,
                  value)


def _garbage(fill):
  """What arrives before a stage has real work: NaN, so that any leak of it
  into outputs or gradients shows."""
  return tree_map(lambda a: jnp.full_like(a, jnp.nan), fill)


def _neighbours(n_stages, step):
  return [(i, (i + step) % n_stages) for i in range(n_stages)]


def split_collections(layout: Layout, stacked: Sequence[dict],
                      is_mutable: Callable[[str], bool],
                      explain: Explain) -> tuple[tuple, tuple]:
  """``stacked`` -> (read-only, updated) collections per scope; raises
  ``explain.mutable`` for an updated collection the layout does not allow
  to change once per microbatch."""
  for cols in stacked:
    for col in cols:
      if is_mutable(col) and col not in layout.per_microbatch:
        raise explain.mutable(col)
  fixed = tuple({c: v for c, v in cols.items() if not is_mutable(c)}
                for cols in stacked)
  mutable = tuple({c: v for c, v in cols.items() if is_mutable(c)}
                  for cols in stacked)
  return fixed, mutable


_SLICING = frozenset({'dynamic_slice', 'gather', 'slice', 'squeeze',
                      'reshape'})


def _save_all_but_slices(prim, *_, **__):
  return prim.name not in _SLICING


def stage_fn(layer: Callable[..., Any], policy: Callable[..., Any] | None,
             n_layers: int, explain: Explain) -> Callable[..., Any]:
  """``stage(x, fixed, r, mutable, keys, per_layer) -> (x, updated)``: a
  stage's ``n_layers`` layers of repeat ``r`` on one microbatch, each under
  ``jax.checkpoint`` with ``policy`` (by default: save all but the slices
  of the parameters)."""

  def stage(x, fixed, r, mutable, keys, per_layer):
    # The parameters are sliced inside the checkpoint: the backward pass
    # slices them again instead of keeping a copy per iteration.
    def one(x, sliced):
      l, mutable, keys, per_layer = sliced
      own = _at(_at(fixed, r), l)
      variables = tuple({**f, **m} for f, m in zip(own, mutable))
      return layer(x, (variables, keys, per_layer))

    one = jax.checkpoint(one, policy=policy or _save_all_but_slices,
                         prevent_cse=False)
    x, (_, updated) = lax.scan(
        one, x, (jnp.arange(n_layers), mutable, keys, per_layer))
    held = jax.tree_util.tree_structure(mutable)
    if jax.tree_util.tree_structure(updated) != held:
      raise explain.wrote(jax.tree_util.tree_structure(updated), held)
    return x, updated

  return stage


def _shard(layout, mesh, per_stage, whole, staged):
  """``per_stage(*whole, *staged)`` on every stage: ``whole`` replicated,
  ``staged`` split on its leading (stage) axis, outputs stacked on it."""
  spec = PartitionSpec(layout.axis)
  return jax.shard_map(
      per_stage, mesh=mesh,
      in_specs=(PartitionSpec(),) * len(whole) + (spec,) * len(staged),
      out_specs=spec, axis_names={layout.axis},
      check_vma=False)(*whole, *staged)


# -- the forward loop (GPipe, circular) ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Forward:
  """The forward loop on one stage ``s`` (a traced index)."""
  layout: Any
  stage: Callable[..., Any]
  s: Any
  fill: Any
  fixed: Any
  keys: Any
  per_layer: Any

  @property
  def work(self):
    return self.layout.microbatches * self.layout.repeats

  def store(self, buffer, arrived, t):
    """The last stage's output of the work item it finished at ``t − 1``
    (what ``arrived`` on stage 0) into the batch buffer."""
    done = t - self.layout.stages
    ok = (done >= 0) & (done < self.work)
    return _put(buffer, jnp.mod(done, self.layout.microbatches), arrived, ok)

  def iteration(self, carry, t):
    arrived, buffer, mutable = carry
    buffer = self.store(buffer, arrived, t)
    j = t - self.s
    valid = (j >= 0) & (j < self.work)
    r = jnp.clip(j, 0, self.work - 1) // self.layout.microbatches
    x = _select(self.s == 0,
                _at(buffer, jnp.mod(t, self.layout.microbatches)), arrived)
    x = _select(valid, x, self.fill)
    y, updated = self.stage(x, self.fixed, r, _at(mutable, r),
                            _at(self.keys, r), _at(self.per_layer, r))
    mutable = tree_map(
        lambda old, new: old.at[r].set(jnp.where(valid, new, old[r])),
        mutable, updated)
    arrived = lax.ppermute(y, self.layout.axis,
                           _neighbours(self.layout.stages, 1))
    return (arrived, buffer, mutable), None


def _forward_stage(layout, stage, micro, fixed, mutable, keys, per_layer):
  """The forward loop on this stage: every microbatch through its layers."""
  fixed, mutable, keys, per_layer = _at((fixed, mutable, keys, per_layer), 0)
  if layout.remat_iterations:
    # The backward pass keeps each iteration's input microbatch (not the
    # batch buffers the loop carries) and reruns the stage from it.
    stage = jax.checkpoint(
        stage, policy=jax.checkpoint_policies.nothing_saveable,
        prevent_cse=False)
  fill = tree_map(lax.stop_gradient, _at(micro, 0))
  loop = _Forward(layout, stage, lax.axis_index(layout.axis), fill, fixed,
                  keys, per_layer)
  iterations = loop.work + layout.stages - 1
  (arrived, buffer, mutable), _ = lax.scan(
      loop.iteration, (_garbage(fill), micro, mutable),
      jnp.arange(iterations))
  buffer = loop.store(buffer, arrived, jnp.asarray(iterations))
  return _lead(buffer), _lead(mutable)


# -- one forward, one backward --------------------------------------------------


def _inexact(tree):
  """``(floating leaves, rebuild)``: the leaves gradients are taken of, and
  ``rebuild(leaves)`` -> ``tree`` with them put back."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  where = [i for i, a in enumerate(leaves)
           if jnp.issubdtype(jnp.result_type(a), jnp.inexact)]

  def rebuild(new):
    out = list(leaves)
    for i, a in zip(where, new):
      out[i] = a
    return treedef.unflatten(out)

  return [leaves[i] for i in where], rebuild


def _without(tree, dropped):
  """``tree`` with None for every leaf that is one of the arrays in
  ``dropped`` (compared by identity)."""
  ids = {id(a) for a in leaves_of(dropped)}
  return tree_map(lambda a: None if id(a) in ids else a, tree)


def surrogate(loss: Any, pairs: Sequence[tuple[Any, Any]]) -> Any:
  """``loss`` whose gradient by ``v`` is ``g``, for each ``(v, g)`` in
  ``pairs``: ``loss + Σ g·(v − v)``, each term exactly zero and the only
  path ``jax.grad`` can take (the loop's inputs are behind stop_gradient).
  """
  total = lax.stop_gradient(loss)
  for value, grad in pairs:
    total = total + jnp.sum(lax.stop_gradient(grad) *
                            (value - lax.stop_gradient(value)))
  return total


def _one_f_one_b(layout, training, stage, mesh, micro, fixed, staged,
                 explain):
  """1F1B across the stages: ``(c, mutable, surrogate loss)`` (see
  :func:`run_pipeline`)."""
  m = layout.microbatches
  for a, is_batch in zip(training.arrays, training.batched):
    if is_batch and jnp.shape(a)[0] % m:
      raise explain.argument(tuple(jnp.shape(a)), m)
  # (B/M, M, ...): microbatch b is [:, b], rows b, b + M, ...; a view of
  # the batch, where microbatches()'s (M, B/M, ...) would be a copy of it.
  batches = [a.reshape((a.shape[0] // m, m) + a.shape[1:]) if is_batch
             else a for a, is_batch in zip(training.arrays, training.batched)]
  # The other layers' parameters travel into the loop; the stack's own
  # (which the loss's calls in the loop never read) must not, or every
  # stage would get all of them.
  outer = _without(training.params, fixed)
  if len(leaves_of(outer)) == len(leaves_of(training.params)):
    raise explain.not_in_params()
  sg = lambda tree: tree_map(lax.stop_gradient, tree)
  shape = tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                   micro)
  per_stage = functools.partial(_one_f_one_b_stage, layout, training, stage,
                                shape, explain)
  outputs, mutable, grads, outer_grads, loss = _shard(
      layout, mesh, per_stage, (batches, sg(outer)), sg(staged))
  # The gradients enter jax.grad's trace through the stack's variables (in
  # stored order: (L, ...)) and the other layers' parameters (stage 0 holds
  # those of the layers before the stack, the last stage those after).
  last = layout.stages - 1
  total = surrogate(
      loss[last],
      list(zip(_inexact(fixed)[0], leaves_of(_unstaged(grads)))) +
      list(zip(_inexact(outer)[0], [g.sum(0) for g in leaves_of(outer_grads)])))
  out = joined(_at(outputs, last)) if training.has_aux else joined(micro)
  return out, _unstaged(mutable), total


def _zeros(tree):
  return tree_map(jnp.zeros_like, tree)


def _repeated(tree, n):
  return tree_map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), tree)


def _one_f_one_b_stage(layout, training, stage, shape, explain, batches,
                       outer, fixed, mutable, keys, per_layer):
  """1F1B on this stage: ``(outputs, mutable, grads, outer grads, loss)``,
  each with a leading stage axis of one."""
  fixed, mutable, keys, per_layer = _at((fixed, mutable, keys, per_layer), 0)
  outer_diff, rebuild_outer = _inexact(outer)
  fixed_diff, rebuild_fixed = _inexact(fixed)
  fill = tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shape)

  def stage_once(x, fixed_diff, mutable):
    return stage(x, rebuild_fixed(fixed_diff), 0, mutable, _at(keys, 0),
                 _at(per_layer, 0))

  # The stage is traced once, and its program run by the forward and by
  # the backward's recomputation: tracing the blocks again would move
  # their rng counters, and the recomputation would draw other dropout
  # masks than the forward did.
  traced, out_shape = jax.make_jaxpr(stage_once, return_shape=True)(
      fill, fixed_diff, _at(mutable, 0))
  s = lax.axis_index(layout.axis)
  loop = _OneFOneB(
      layout, training, explain, s, s == 0, s == layout.stages - 1, fill,
      shape, batches, outer_diff, rebuild_outer, fixed_diff,
      jax_private.jaxpr_as_fun(traced),
      jax.tree_util.tree_structure(out_shape))
  window = loop.window
  carry = (_garbage(fill), _garbage(fill), _repeated(fill, window),
           _repeated(_at(mutable, 0), window), mutable, _zeros(fixed_diff),
           _zeros(outer_diff), jnp.zeros(()),
           _repeated(fill, layout.microbatches if training.has_aux else 0))
  # In the first S - 1 iterations no stage has a backward to run, in the
  # last S - 1 none a forward: three loops (fill, steady, drain) leave
  # those halves out, so the step takes M + S - 1 forwards and as many
  # backwards of time, as GPipe's. (A lax.cond on t would do it in one
  # loop, but kept XLA:TPU from updating the gradient sums in place: a
  # copy of the stage's parameters in temp memory.)
  n_stages, n_micro = layout.stages, layout.microbatches
  for start, stop, forwards, backwards in (
      (0, n_stages - 1, True, False),
      (n_stages - 1, n_micro + n_stages - 1, True, True),
      (n_micro + n_stages - 1, layout.iterations, False, True)):
    if stop > start:
      carry, _ = lax.scan(
          functools.partial(loop.iteration, forwards=forwards,
                            backwards=backwards),
          carry, jnp.arange(start, stop))
  _, _, _, _, mutable, grads, outer_grads, loss, outputs = carry
  return _lead((outputs, mutable, grads, outer_grads, loss))


@dataclasses.dataclass(frozen=True)
class _OneFOneB:
  """The 1F1B loop on one stage ``s`` (a traced index). Stage ``s`` runs
  forward microbatch ``f = t − s`` and backward ``b = t − 2S + 2 + s`` at
  iteration ``t``; the latter's vjp is recomputed from the stage input it
  stored in a ring of ``2S − 1`` slots. Stage 0 runs the loss up to the
  stack for its input (and that part's vjp), the last stage the loss from
  the stack's output (and its vjp)."""
  layout: Any
  training: Any
  explain: Any
  s: Any
  first: Any  # s == 0, computed once outside the loops
  last: Any   # s == S - 1
  fill: Any
  shape: Any
  batches: Sequence[Any]
  outer_diff: list
  rebuild_outer: Callable[..., Any]
  fixed_diff: list
  program: Callable[..., Any]
  out_tree: Any

  @property
  def window(self) -> int:
    """The microbatch inputs a stage holds at most."""
    return 2 * self.layout.stages - 1

  def call(self, outer_diff, b, given):
    """The loss on microbatch ``b``, the stack answered by ``given``."""
    arrays = [a[:, b] if is_batch else a
              for a, is_batch in zip(self.batches, self.training.batched)]
    return self.training.call(self.rebuild_outer(outer_diff), arrays, given)

  def embed(self, outer_diff, b):
    """The stack's input on microbatch ``b`` (the layers before it)."""
    capture = Capture()
    self.call(outer_diff, b, capture)
    got = tree_map(jnp.shape, capture.value)
    want = tree_map(lambda a: a.shape, self.shape)
    if got != want:
      raise self.explain.input_shape(got, want)
    return capture.value

  def head(self, outer_diff, b, y):
    """The loss of microbatch ``b`` from the stack's output ``y``."""
    out = self.call(outer_diff, b, y)
    return (out[0] if self.training.has_aux else out) / (
        self.layout.microbatches)

  def forward(self, x, fixed_diff, mutable):
    return self.out_tree.unflatten(
        self.program(*leaves_of((x, fixed_diff, mutable))))

  def head_vjp(self, b, y):
    loss, pull = jax.vjp(lambda o, y: self.head(o, b, y), self.outer_diff, y)
    return (loss,) + pull(jnp.ones_like(loss))

  def embed_vjp(self, b, d_x):
    _, pull = jax.vjp(lambda o: self.embed(o, b), self.outer_diff)
    return pull(d_x)[0]

  def forward_half(self, t, arrived, inputs, states, mutable, outputs):
    """Forward of microbatch ``f = t − s`` (as in GPipe)."""
    n_micro = self.layout.microbatches
    f = t - self.s
    f_ok = (f >= 0) & (f < n_micro)
    f_at = jnp.clip(f, 0, n_micro - 1)
    x = lax.cond(self.first, lambda: self.embed(self.outer_diff, f_at),
                 lambda: arrived)
    x = _select(f_ok, x, self.fill)
    state = _at(mutable, 0)
    y, updated = self.forward(x, self.fixed_diff, state)
    inputs = _put(inputs, jnp.mod(f, self.window), x, f_ok)
    states = _put(states, jnp.mod(f, self.window), state, f_ok)
    mutable = tree_map(
        lambda old, new: old.at[0].set(jnp.where(f_ok, new, old[0])),
        mutable, updated)
    if self.training.has_aux:
      outputs = _put(outputs, f_at, y, f_ok & self.last)
    return y, inputs, states, mutable, outputs

  def backward_half(self, t, y, cotangent, inputs, states, grads,
                    outer_grads, loss):
    """Backward of microbatch ``b = t − (2S − 2 − s)``: on the last stage
    the one just run forward, its cotangent from the loss; elsewhere the
    cotangent the next stage sent."""
    n_micro = self.layout.microbatches
    b = t - (2 * self.layout.stages - 2) + self.s
    b_ok = (b >= 0) & (b < n_micro)
    b_at = jnp.clip(b, 0, n_micro - 1)
    l_b, d_head, d_y = lax.cond(
        self.last, self.head_vjp,
        lambda b, y: (jnp.zeros(()), _zeros(self.outer_diff), _zeros(y)),
        b_at, y)
    ct = _select(self.last, d_y, cotangent)
    ct = _select(b_ok, ct, _zeros(ct))
    slot = jnp.mod(b, self.window)
    stored = _at(states, slot)
    _, pull = jax.vjp(lambda x, p: self.forward(x, p, stored)[0],
                      _at(inputs, slot), self.fixed_diff)
    d_x, d_fixed = pull(ct)
    d_embed = lax.cond(self.first, self.embed_vjp,
                       lambda b, d_x: _zeros(self.outer_diff), b_at, d_x)
    grads = _added(grads, d_fixed, b_ok)
    outer_grads = _added(outer_grads, d_head, b_ok & self.last)
    outer_grads = _added(outer_grads, d_embed, b_ok & self.first)
    loss = loss + jnp.where(b_ok & self.last, l_b, 0.)
    return d_x, grads, outer_grads, loss

  def iteration(self, carry, t, forwards, backwards):
    (arrived, cotangent, inputs, states, mutable, grads, outer_grads, loss,
     outputs) = carry
    y = d_x = _garbage(self.fill)
    if forwards:
      y, inputs, states, mutable, outputs = self.forward_half(
          t, arrived, inputs, states, mutable, outputs)
    if backwards:
      d_x, grads, outer_grads, loss = self.backward_half(
          t, y, cotangent, inputs, states, grads, outer_grads, loss)
    n_stages = self.layout.stages
    arrived = lax.ppermute(y, self.layout.axis, _neighbours(n_stages, 1))
    cotangent = lax.ppermute(d_x, self.layout.axis,
                             _neighbours(n_stages, -1))
    return (arrived, cotangent, inputs, states, mutable, grads, outer_grads,
            loss, outputs), None


def _added(acc, d, ok):
  """``acc + d`` where ``ok``."""
  return tree_map(lambda a, g: a + jnp.where(ok, g, jnp.zeros_like(g)), acc, d)
