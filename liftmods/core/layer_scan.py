"""The loop over a stack of layers that share one carry.

``layer_scan(fn, length=L)`` runs a scope function ``fn(scope, c, *args)``
over ``L`` layers. Every collection is stacked on axis 0 and every rng
sequence is split per layer, as ``lift.scan(variable_axes={True: 0},
split_rngs={True: True})`` does, and each layer sees the keys and rng
counters of that scan. On top of the scan it offers:

- ``rolled=False``: a Python loop over the same stacked variables;
- ``remat``: each layer under ``jax.checkpoint`` with a ``Remat`` policy,
  optionally in groups (an inner rematerialized loop per group inside a
  rolled outer one, for about √L memory);
- ``schedule``: a ``Schedule`` that takes the loop over (a pipeline);
- ``explain``: the caller's wording of the errors (``Explain``).

It shares its prologue (``axes_scan.slice_groups``), its carry check
(``axes_scan.carry_mismatch``) and its rng replay
(``axes_scan.trace_loop``) with ``lift.scan``.

>>> import jax, jax.numpy as jnp
>>> from liftmods.core import init
>>> def layer(scope, x):
...   w = scope.param('w', jax.nn.initializers.normal(), (3, 3))
...   return x @ w
>>> y, variables = init(layer_scan(layer, length=4))(jax.random.key(0),
...                                                  jnp.ones((2, 3)))
>>> y.shape, variables['params']['w'].shape
((2, 3), (4, 3, 3))
"""
import dataclasses
import functools
import math
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from liftmods import errors
from liftmods.core import meta
from liftmods.core.axes_scan import carry_mismatch, slice_groups, trace_loop
from liftmods.core.pack import broadcast, has_rngs, outer_scopes, pack
from liftmods.core.rng_counters import (RngReplay, restore_scopes,
                                        snapshot_scopes)


@dataclasses.dataclass(frozen=True)
class Remat:
  """How each layer of a ``layer_scan`` is rematerialized.

  Attributes:
    policy: the ``jax.checkpoint`` policy of one layer.
    prevent_cse: passed to ``jax.checkpoint``; None means ``False`` in a
      rolled loop and ``True`` when unrolled.
    names: the checkpoint names given to the incoming carry, the per-layer
      inputs and the per-layer outputs, for ``policy`` to refer to.
    group_size: ``(length, carry bytes, sliced bytes) -> layers per group``,
      or None for one flat loop; a group size of None or ``length`` means
      flat too.
    offload_group_carry: a checkpoint name under which each group's
      incoming carry goes to pinned host memory; None keeps it on the device.
  """
  policy: Callable[..., Any]
  prevent_cse: bool | None = None
  names: tuple[str, str, str] = ('layer_carry', 'layer_inputs',
                                 'layer_outputs')
  group_size: Callable[[int, int, int], int | None] | None = None
  offload_group_carry: str | None = None


class Explain(Protocol):
  """The errors a ``layer_scan`` raises, worded by its caller."""

  def output(self, out: Any) -> Exception:
    """A scanning layer returned ``out``, which is not a ``(carry, ys)``
    pair."""

  def carry(self, c_in: Any, out: Any, mismatch: str) -> Exception:
    """A layer's carry changed: ``mismatch`` says how (see
    ``axes_scan.carry_mismatch``); ``out`` is what the layer returned."""

  def axis(self, scope: Any, where: str, shape: tuple) -> Exception:
    """The variable ``where`` of ``scope`` has ``shape``, without a leading
    axis of the number of layers."""


class Schedule(Protocol):
  """Runs the layers in another order than one after the other."""

  def takes_over(self, scopes: Sequence[Any], stacked: Any) -> bool:
    """Whether the schedule runs this call (False: the plain loop runs)."""

  def run_layers(self, layer: Callable[..., Any],
                 policy: Callable[..., Any] | None, c: Any, stacked: Any,
                 keys: Any, per_layer: tuple, length: int,
                 scopes: Sequence[Any]) -> tuple:
    """``(carry, per-layer variables out)`` of the layers on the schedule;
    ``layer(c, (variables, keys, per_layer)) -> (c, (ys, variables))``."""

  def store(self, variables: Any) -> Any:
    """The stacked variables of a plain-loop run, in the schedule's
    layout."""


class _Generic:
  """Errors worded for a bare ``layer_scan``."""

  def __init__(self, kind, path, length):
    self.kind, self.path, self.length = kind, path, length

  def output(self, out):
    return errors.ScanCarryError(
        f'{self.kind} at {self.path}: a scanning layer must return a pair '
        f'(carry, ys), got {type(out).__name__}.')

  def carry(self, c_in, out, mismatch):
    del c_in, out
    return errors.ScanCarryError(f'{self.kind} at {self.path}: {mismatch}')

  def axis(self, scope, where, shape):
    return errors.VariableAxisError(
        f'{self.kind} at {scope.path_text}: {where} has shape {shape}; '
        f'expected a leading axis of {self.length} layers.')


def layer_scan(fn: Callable[..., Any], *, length: int, fold: bool = True,
               in_axes: Sequence[Any] = (), rolled: bool = True,
               unroll: int = 1, remat: Remat | None = None,
               metadata_params: Mapping[str, Any] | None = None,
               site: Hashable = None, explain: Explain | None = None,
               schedule: Schedule | None = None,
               name: str = 'layer_scan') -> Callable[..., Any]:
  """Runs ``fn(scope, c, *args, **kwargs)`` over ``length`` stacked layers.

  Args:
    fn: one layer; it returns the new carry (``fold``) or a pair
      ``(carry, ys)``.
    length: the number of layers.
    fold: ``True`` when ``fn`` returns the carry alone.
    in_axes: per positional argument after the carry, ``0`` (one slice per
      layer) or ``broadcast`` (the same for every layer). Keyword arguments
      are the same for every layer.
    rolled: a ``lax.scan`` over the layers, or (False) a Python loop.
    unroll: passed to ``lax.scan``.
    remat: rematerialize each layer (and group them) as it says.
    metadata_params: passed to boxed variables when the layer axis is
      removed and added.
    site: what identifies the call site (hashable), so that a repeated
      trace can replay the rng counters instead of tracing a layer twice.
    explain: the caller's error wording.
    schedule: takes the loop over when it says so (a pipeline).
    name: the transform's name in errors.

  Returns:
    ``f(scope, c, *args, **kwargs)`` returning the carry (``fold``) or
    ``(carry, ys stacked on axis 0)``.

  Raises:
    ValueError: ``in_axes`` does not have one entry per argument.
  """
  loop = _LayerLoop(fn, length, fold, tuple(in_axes), rolled, unroll, remat,
                    {} if metadata_params is None else metadata_params, site,
                    explain, schedule, name)
  return pack(loop.packed, (True,), (True,), (True,), name=name,
              enable_kwargs=True)


@dataclasses.dataclass(frozen=True)
class _LayerLoop:
  """The arguments of one ``layer_scan``; ``packed`` is its ``pack`` body."""
  fn: Callable[..., Any]
  length: int
  fold: bool
  in_axes: tuple
  rolled: bool
  unroll: int
  remat: Remat | None
  metadata_params: Mapping[str, Any]
  site: Hashable
  explain: Explain | None
  schedule: Schedule | None
  name: str

  def packed(self, make_scopes, repack, variable_groups, rng_groups, c,
             *args, **kwargs):
    scopes = outer_scopes(make_scopes)
    why = self.explain or _Generic(self.name, scopes[0].path_text,
                                   self.length)
    if len(self.in_axes) != len(args):
      raise ValueError(f'{self.name}: in_axes has {len(self.in_axes)} '
                       f'entries for {len(args)} arguments after the carry.')
    (stacked,), (keys,) = slice_groups(
        self.name, scopes, variable_groups, (0,), rng_groups, (True,),
        self.length, 'length', self.metadata_params, why.axis)
    per_layer = tuple(a for a, ax in zip(args, self.in_axes) if ax == 0)
    shared = tuple(a for a, ax in zip(args, self.in_axes) if ax is broadcast)
    xs = (stacked, keys, per_layer)
    make_layer = functools.partial(self.layer, make_scopes, repack, why,
                                   shared, kwargs)
    schedule = self.schedule
    scheduled = schedule is not None and schedule.takes_over(scopes, stacked)

    def loop(_, verify):
      if scheduled:
        c_out, var_out = schedule.run_layers(
            make_layer(verify), self.remat and self.remat.policy, c, stacked,
            keys, per_layer, self.length, scopes)
        return c_out, ((), var_out)
      return self.all_layers(make_layer(verify), c, xs,
                             snapshot_scopes(scopes), scopes)

    replay = None
    if has_rngs(rng_groups):  # Linen's scan traces a layer once beforehand
      replay = RngReplay(scopes, (self.site,
                                  jax.tree_util.tree_structure((c, xs))))

    def first():
      if replay is not None:
        jax.eval_shape(make_layer(None), c, _take(xs, 0))

    c, (ys, var_out) = trace_loop(replay, first, loop)
    if schedule is not None and not scheduled:
      var_out = schedule.store(var_out)
    var_out = meta.add_axis(var_out, 0, self.metadata_params)
    return (c if self.fold else (c, ys)), (var_out,)

  def layer(self, make_scopes, repack, why, shared, kwargs, verify):
    """``layer(c, (variables, keys, per_layer)) -> (c, (ys, variables))``,
    one layer of the loop; ``verify()`` runs after it when given."""
    remat = self.remat

    def layer(c_in, sliced):
      variables, layer_keys, per = sliced
      if remat is not None:
        c_in, per = _tag(c_in, remat.names[0]), _tag(per, remat.names[1])
      inner_scopes = make_scopes((variables,), (layer_keys,))
      per_it, shared_it = iter(per), iter(shared)
      args = [next(per_it) if axis == 0 else next(shared_it)
              for axis in self.in_axes]
      out = self.fn(inner_scopes, c_in, *args, **kwargs)
      c_out, ys = _split_output(out, self.fold, c_in, why)
      if remat is not None:
        ys = _tag(ys, remat.names[2])
      if verify is not None:
        verify()
      return c_out, (ys, repack(inner_scopes)[0])

    return layer

  def all_layers(self, layer, c, xs, ready, scopes):
    """Every layer, flat or grouped, each traced from the counters
    ``ready``."""
    remat, rolled = self.remat, self.rolled
    if remat is not None:
      cse = rolled is False if remat.prevent_cse is None else remat.prevent_cse
      layer = jax.checkpoint(layer, policy=remat.policy, prevent_cse=cse)

    def layers(c, sliced, n):
      if rolled:
        restore_scopes(scopes, ready)
        return lax.scan(layer, c, sliced, length=n, unroll=self.unroll)
      outs = []
      for i in range(n):
        restore_scopes(scopes, ready)
        c, out = layer(c, _take(sliced, i))
        outs.append(out)
      return c, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)

    group = None
    if remat is not None and remat.group_size is not None:
      group = remat.group_size(self.length, _nbytes(c), _nbytes(xs))
    if group is None or group >= self.length:
      return layers(c, xs, self.length)
    return _grouped(layers, c, xs, self.length, group,
                    remat.offload_group_carry, rolled)


def _split_output(out, fold, c_in, why):
  """``(carry, ys)`` of a layer's output, or the caller's error."""
  if fold:
    c_out, ys = out, ()
  elif not isinstance(out, (tuple, list)) or len(out) != 2:
    raise why.output(out)
  else:
    c_out, ys = out
  mismatch = carry_mismatch(c_in, c_out)
  if mismatch:
    raise why.carry(c_in, out, mismatch)
  return c_out, ys


def _grouped(layers, c, xs, length, group, offload_name, rolled):
  """``length`` layers in groups of ``group``: each group is an inner loop
  under ``jax.checkpoint``; the full groups run in an outer loop (rolled
  when the layers are) and the rest as one more group."""
  n_full, rest = divmod(length, group)
  group_policy = None
  if offload_name is not None:
    group_policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(
            offload_name,), offload_src='device', offload_dst='pinned_host')

  def one_group(n, looped):
    def body(c, sliced):
      if offload_name is not None:
        c = _tag(c, offload_name)
      return layers(c, sliced, n)
    # Outside a loop, XLA could merge the recomputation into the forward
    # pass and keep every activation; prevent_cse stops that.
    return jax.checkpoint(body, policy=group_policy, prevent_cse=not looped)

  full = one_group(group, rolled)
  main = jax.tree_util.tree_map(
      lambda a: a[:n_full * group].reshape((n_full, group) + a.shape[1:]), xs)
  if rolled:
    c, outs = lax.scan(full, c, main)
    outs = jax.tree_util.tree_map(
        lambda a: a.reshape((n_full * group,) + a.shape[2:]), outs)
  else:
    parts = []
    for g in range(n_full):
      c, out = full(c, _take(main, g))
      parts.append(out)
    outs = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *parts)
  if rest:
    c, tail = one_group(rest, False)(c, _take(xs, n_full * group, length))
    outs = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), outs,
                                  tail)
  return c, outs


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _nbytes(tree) -> int:
  return sum(math.prod(a.shape) * a.dtype.itemsize
             for a in jax.tree_util.tree_leaves(tree) if _is_array(a))


def _tag(tree, name):
  return jax.tree_util.tree_map(
      lambda x: checkpoint_name(x, name) if _is_array(x) else x, tree)


def _take(tree, start, stop=None):
  if stop is None:
    return jax.tree_util.tree_map(lambda a: a[start], tree)
  return jax.tree_util.tree_map(lambda a: a[start:stop], tree)
