"""Layer stacks: ``L`` copies of one block with a checkpoint policy.

``nn.Stack(Block, length=L, policy=...)`` returns a Module class (named
``StackBlock``) whose instances hold ``L`` copies of ``Block``: every variable
gets a leading layer axis, exactly as ``nn.scan(Block, variable_axes={True:
0}, split_rngs={True: True}, length=L)`` would create it. Its fields are
``Block``'s, so the static configuration is shared by all layers.

- ``stack(x, *args)`` *folds*: the block maps ``x -> x``.
- ``stack.scan(x, *args)`` *scans*: the block maps ``x -> (x, y)`` and the
  per-layer ``y`` come back stacked.

Extra positional arguments are shared by every layer unless ``in_axes``
declares them per-layer (leading axis ``L``, sliced for each layer);
keyword arguments are always shared. ``mode='unrolled'`` runs a Python loop
over the same stacked variables, so one checkpoint serves both modes.

>>> import jax, jax.numpy as jnp, liftmods as nn
>>> class Block(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return x + nn.Dense(x.shape[-1])(x)
>>> Blocks = nn.Stack(Block, length=4, policy='full')
>>> variables = Blocks(name='blocks').init(jax.random.key(0), jnp.ones((2, 3)))
>>> variables['params']['Dense_0']['kernel'].shape
(4, 3, 3)
"""
import dataclasses
import functools
import inspect
import math
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable, checkpoint_name

from liftmods import errors, pipeline as pipelining
from liftmods.core import meta
from liftmods.core.pack import (broadcast, check_variable_axes, has_rngs,
                                outer_scopes, pack, split_keys)
from liftmods.core.rng_counters import (RngReplay, restore_scopes,
                                        snapshot_scopes)
from liftmods.module import Module
from liftmods.transforms import call_lifted

CARRY = 'stack_carry'
INPUTS = 'stack_inputs'
OUTPUTS = 'stack_outputs'
GROUP_CARRY = 'stack_group_carry'

_SAVE_FLAGS = (True, False, 'offload')
_PINNED_HOST_PLATFORMS = ('tpu', 'gpu', 'cuda', 'rocm')


class StackOffloadWarning(UserWarning):
  """An offload policy runs on a backend without a host memory space."""


# -- the policy -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StackPolicy:
  """What the backward pass of a stack keeps and what it recomputes.

  Each layer runs under ``jax.checkpoint``. Inside it, the incoming carry is
  named ``'stack_carry'``, the per-layer inputs ``'stack_inputs'`` and the
  per-layer outputs of a scan ``'stack_outputs'``; the block may name its own
  values with ``nn.checkpoint_name``.

  Attributes:
    save_carries: ``True`` keeps each layer's incoming carry on the device,
      ``'offload'`` moves it to pinned host memory. The carry is what a
      layer is recomputed from, so ``False`` still keeps it as the
      checkpoint's input (on the device).
    save_inputs: the same for per-layer inputs (``in_axes=0`` arguments).
    save_outputs: the same for the per-layer outputs of ``stack.scan``.
    save_block_internals: names (tagged with ``nn.checkpoint_name`` inside
      the block) to keep, or ``True`` to keep every intermediate.
    offload_block_internals: names to keep in pinned host memory.
    prevent_cse: passed to ``jax.checkpoint``; ``None`` means ``False`` for
      layers inside a loop and ``True`` for unrolled ones (where XLA could
      otherwise merge the recomputation into the forward pass).
    nested: ``False``; ``True`` for about ``sqrt(L)`` groups; or a number of
      groups. Groups of ``ceil(L / groups)`` layers (the last one holds the
      rest when that does not divide ``L``) run as a rematerialized inner
      scan inside a rolled outer scan: the backward pass keeps one carry per
      group plus, while one group is recomputed, one per layer of that
      group. The parameter layout stays ``(L, ...)``.

  >>> StackPolicy.of('nested').nested
  True
  >>> StackPolicy(save_block_internals=('mlp_up',)).saved_names()
  ('mlp_up', 'stack_carry', 'stack_outputs')
  """
  save_carries: Any = True
  save_inputs: Any = False
  save_outputs: Any = True
  save_block_internals: Any = False
  offload_block_internals: Sequence[str] = ()
  prevent_cse: bool | None = None
  nested: bool | int = False

  def __post_init__(self):
    for name in ('save_carries', 'save_inputs', 'save_outputs'):
      if getattr(self, name) not in _SAVE_FLAGS:
        raise ValueError(f'StackPolicy.{name} must be True, False or '
                         f"'offload'; got {getattr(self, name)!r}.")
    internals = self.save_block_internals
    if isinstance(internals, str):
      object.__setattr__(self, 'save_block_internals', (internals,))
    elif internals not in (True, False):
      object.__setattr__(self, 'save_block_internals', tuple(internals))
    offload = self.offload_block_internals
    object.__setattr__(self, 'offload_block_internals',
                       (offload,) if isinstance(offload, str) else
                       tuple(offload))
    nested = self.nested
    if not isinstance(nested, bool) and (not isinstance(nested, int) or
                                         nested < 1):
      raise ValueError('StackPolicy.nested must be False, True or a positive '
                       f'number of groups; got {nested!r}.')

  @classmethod
  def of(cls, spec) -> 'StackPolicy | None':
    """A policy from a shorthand: ``None``/``False`` (no rematerialization),
    ``True``/``'full'`` (keep carries, recompute block internals),
    ``'save_all'`` (keep everything), ``'nested'`` (√L groups),
    ``'offload'`` (carries to pinned host memory), or a StackPolicy."""
    if spec is None or spec is False:
      return None
    if isinstance(spec, cls):
      return spec
    shorthands = {
        'full': cls(),
        'save_all': cls(save_block_internals=True),
        'nested': cls(nested=True),
        'offload': cls(save_carries='offload'),
    }
    if spec is True:
      return shorthands['full']
    if isinstance(spec, str) and spec in shorthands:
      return shorthands[spec]
    raise ValueError(
        'policy must be None, True, a StackPolicy or one of '
        f"{sorted(shorthands)}; got {spec!r}.")

  def saved_names(self) -> tuple:
    """The checkpoint names kept on the device (sorted)."""
    names = {n for n, flag in ((CARRY, self.save_carries),
                               (INPUTS, self.save_inputs),
                               (OUTPUTS, self.save_outputs)) if flag is True}
    if self.save_block_internals not in (True, False):
      names.update(self.save_block_internals)
    return tuple(sorted(names))

  def offloaded_names(self) -> tuple:
    """The checkpoint names moved to pinned host memory (sorted)."""
    names = {n for n, flag in ((CARRY, self.save_carries),
                               (INPUTS, self.save_inputs),
                               (OUTPUTS, self.save_outputs))
             if flag == 'offload'}
    names.update(self.offload_block_internals)
    return tuple(sorted(names))

  def groups(self, length: int, carry_bytes: int = 1,
             sliced_bytes: int = 0) -> int | None:
    """The group size of the nested form for ``length`` layers, or None
    for the flat form.

    With ``nested=True`` the size is the one that keeps the fewest bytes
    for the backward pass by this estimate: one carry per group, one per
    layer of the group being recomputed, and one copy of the
    ``sliced_bytes`` of per-layer values (parameters, keys, inputs) that
    the groups read — two when the groups are uneven, since the remainder
    group reads its own slice. When no grouping beats keeping every
    layer's carry (``length * carry_bytes``), it is None: ``'nested'`` is
    then the same as ``'full'``, so it never keeps more. An explicit number
    of groups is used as given.

    >>> StackPolicy(nested=True).groups(64)
    8
    >>> StackPolicy(nested=True).groups(3) is None  # 2 + 2 carries > 3
    True
    """
    if self.nested is False:
      return None
    if self.nested is not True:
      return -(-length // min(self.nested, length))
    def cost(size):  # bytes kept; ties: even groups, then size near √L
      uneven = length % size != 0
      kept = ((-(-length // size) + size) * carry_bytes +
              (1 + uneven) * sliced_bytes)
      return kept, uneven, abs(size - math.sqrt(length))

    best = min(range(2, length), key=cost, default=None)
    if best is None or cost(best)[0] >= length * carry_bytes:
      return None
    return best

  def jax_policy(self, offload: bool):
    """The ``jax.checkpoint`` policy; ``offload=False`` keeps the offloaded
    names on the device instead."""
    save_all = self.save_block_internals is True
    saved = set(self.saved_names())
    offloaded = set(self.offloaded_names())
    if not offload:
      saved |= offloaded
      offloaded = set()
    to_host = Offloadable(src='device', dst='pinned_host')

    def policy(prim, *_, **params):
      if getattr(prim, 'name', None) == 'name':
        if params['name'] in offloaded:
          return to_host
        if params['name'] in saved or save_all:
          return Saveable
        return Recompute
      return Saveable if save_all else Recompute

    return policy


def target_platform() -> str:
  """The platform of the devices the program being traced is for.

  That is the platform of the mesh set with ``jax.set_mesh`` (or
  ``jax.sharding.use_abstract_mesh``) when the mesh names its devices, so a
  program traced under a mesh of ``jax.experimental.topologies`` TPU devices
  targets ``'tpu'`` on a CPU-only machine; without such a mesh, the default
  backend.

  >>> target_platform() == jax.default_backend()
  True
  """
  device = getattr(meta.get_global_mesh(), 'abstract_device', None)
  return jax.default_backend() if device is None else device.platform


def offload_supported() -> bool:
  """Whether the target devices (see ``target_platform``) have a host memory
  space distinct from the device's. XLA:CPU lists one but keeps every buffer
  in device memory; TPUs and GPUs have pinned host memory."""
  device = getattr(meta.get_global_mesh(), 'abstract_device', None)
  if device is not None:
    return device.platform in _PINNED_HOST_PLATFORMS
  if jax.default_backend() == 'cpu':
    return False
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  return 'pinned_host' in kinds


# -- tagging and block outputs ----------------------------------------------------------


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _nbytes(tree) -> int:
  return sum(math.prod(a.shape) * a.dtype.itemsize
             for a in jax.tree_util.tree_leaves(tree) if _is_array(a))


def _tag(tree, name):
  return jax.tree_util.tree_map(
      lambda x: checkpoint_name(x, name) if _is_array(x) else x, tree)


def _avals(tree):
  return jax.tree_util.tree_map(
      lambda x: (tuple(jnp.shape(x)), jnp.result_type(x)), tree)


def _check_carry(path, block, fold, c_in, out):
  """Returns ``(carry, ys)`` from a block output, or raises StackError."""
  if fold:
    c_out, ys = out, ()
  else:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      raise errors.StackError(
          f'Stack at {path}: stack.scan needs {block}.__call__ to return a '
          f'pair (carry, output); it returned {type(out).__name__}. Call the '
          'stack itself to fold a block that maps x -> x.')
    c_out, ys = out
  if jax.tree_util.tree_structure(c_in) != jax.tree_util.tree_structure(
      c_out) or _avals(c_in) != _avals(c_out):
    what = ('a fold block must map x -> x' if fold else
            'a scan block must return (x, output) with x')
    hint = (' It returned a pair: for a block returning (carry, output) use '
            'stack.scan.' if fold and isinstance(out, tuple) and len(out) == 2
            else '')
    raise errors.StackError(
        f'Stack at {path}: {block}.__call__ returned a carry of '
        f'{_avals(c_out)}, but received {_avals(c_in)}; {what} of the same '
        f'structure, shape and dtype.{hint}')
  return c_out, ys


# -- the loop over layers ----------------------------------------------------------------


def _take(tree, start, stop=None):
  if stop is None:
    return jax.tree_util.tree_map(lambda a: a[start], tree)
  return jax.tree_util.tree_map(lambda a: a[start:stop], tree)


def _stack_transform(layer_fn, *, length, policy, mode, unroll,
                     metadata_params, path, site, pipeline=None):
  """A core transform running ``layer_fn(scope, c, per_layer) -> (c, ys)``
  over ``length`` layers. Every collection is stacked on axis 0 and every
  rng sequence is split per layer, as in ``scan(variable_axes={True: 0},
  split_rngs={True: True})``; the keys and rng counters each layer sees are
  those of that scan, whatever the mode and policy. ``site`` (hashable)
  identifies the stack for replaying rng counters on a repeated trace.
  With a ``pipeline`` the layers run on its schedule, except in ``init``,
  which creates the variables as the unpipelined stack does and stores them
  in the pipeline's (stage-major) order."""
  offload = False
  if policy is not None and policy.offloaded_names():
    offload = offload_supported()
    if not offload:
      warnings.warn(
          f'Stack at {path}: the policy offloads {policy.offloaded_names()} '
          f'to pinned host memory, but the target platform '
          f'({target_platform()}) has no host memory space separate from the '
          'device (XLA:CPU keeps everything in device memory); keeping these '
          'values in device memory instead. To compile for other devices, '
          'trace under jax.set_mesh(mesh) with a mesh of those devices.',
          StackOffloadWarning, stacklevel=4)
  in_loop = mode == 'scan'
  jax_policy = policy.jax_policy(offload) if policy is not None else None

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, c, per_layer):
    scopes = outer_scopes(scope_fn)
    stacked = meta.remove_axis(variable_groups[0], 0, metadata_params)
    check_variable_axes('Stack', scopes, (stacked,), (0,), length, 'length')
    keys = split_keys(rng_groups[0], length)
    xs = (stacked, keys, per_layer)
    pipelined = pipeline is not None and not pipelining.initializing(
        scopes, stacked)
    verify = []  # while replaying: checks the counters after a layer trace

    def layer(c, sliced):
      variables, layer_keys, xs = sliced
      inner_scopes = scope_fn((variables,), (layer_keys,))
      c, ys = layer_fn(inner_scopes, c, xs)
      for check in verify:
        check()
      return c, (ys, repack_fn(inner_scopes)[0])

    if policy is not None:
      cse = policy.prevent_cse
      layer_ck = jax.checkpoint(layer, policy=jax_policy,
                                prevent_cse=(not in_loop) if cse is None else cse)
    else:
      layer_ck = layer

    def run(c, sliced, n, ready):
      """``n`` layers, looped or unrolled, each traced from ``ready``."""
      if in_loop:
        restore_scopes(scopes, ready)
        return lax.scan(layer_ck, c, sliced, length=n, unroll=unroll)
      outs = []
      for i in range(n):
        restore_scopes(scopes, ready)
        c, out = layer_ck(c, _take(sliced, i))
        outs.append(out)
      return c, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)

    group = None if policy is None else policy.groups(
        length, _nbytes(c), _nbytes(xs))

    def all_layers(ready):
      if pipelined:
        restore_scopes(scopes, ready)
        c_out, var_out = pipelining.run(
            pipeline, layer, jax_policy, c, stacked, keys, per_layer,
            length=length, is_mutable=scopes[0].is_mutable_collection,
            path=path)
        return c_out, ((), var_out)
      step = functools.partial(run, ready=ready)
      if group is None or group >= length:  # one group: nothing to nest
        return step(c, xs, length)
      return _nested(step, c, xs, length, group, policy, offload, in_loop)

    c, (ys, var_out) = _replaying_rngs(scopes, rng_groups, site, layer, c, xs,
                                       all_layers, verify)
    if pipeline is not None and not pipelined:
      var_out = pipeline.stage_major(var_out)
    var_out = meta.add_axis(var_out, 0, metadata_params)
    return (c, ys), (var_out,)

  return pack(inner, (True,), (True,), (True,), name='Stack')


def _replaying_rngs(scopes, rng_groups, site, layer, c, xs, all_layers,
                    verify):
  """``all_layers(ready_counters) -> (c, outs)`` with Linen's rng counters.

  A lifted scan traces its body once outside the loop when rngs cross it,
  and the loop body sees the counters that trace left. The first time a
  site is traced this does the same (one abstract trace of ``layer``) and
  records the counters; a repeated trace at the same site and counter state
  jumps to the recorded counters and traces the layers once, checking
  after each layer trace that the counters moved as recorded (else it
  starts over the first way).
  """
  if not has_rngs(rng_groups):
    return all_layers(snapshot_scopes(scopes))
  replay = RngReplay(
      scopes, (site, jax.tree_util.tree_structure((c, xs))))

  def checked(check):
    verify.append(check)
    try:
      return all_layers(replay.hit[0])
    finally:
      verify.clear()

  replayed = replay.replayed(checked)
  if replayed is not None:
    return replayed[0]
  jax.eval_shape(layer, c, _take(xs, 0))
  ready = replay.state()
  out = all_layers(ready)
  replay.record(ready, replay.state())
  return out


def _nested(run, c, xs, length, group, policy, offload, in_loop):
  """``length`` layers in groups of ``group``: each group is an inner loop
  under ``jax.checkpoint``; the full groups run in a rolled outer scan
  (a Python loop when unrolled) and the rest as one more group."""
  n_full, rest = divmod(length, group)
  group_policy = None
  if offload and policy.save_carries == 'offload':
    group_policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(
            GROUP_CARRY,), offload_src='device', offload_dst='pinned_host')

  def one_group(n, looped):
    def body(c, sliced):
      if group_policy is not None:
        c = _tag(c, GROUP_CARRY)
      return run(c, sliced, n)
    # Outside a loop, XLA could merge the recomputation into the forward
    # pass and keep every activation; prevent_cse stops that.
    return jax.checkpoint(body, policy=group_policy, prevent_cse=not looped)

  full = one_group(group, in_loop)
  main = jax.tree_util.tree_map(
      lambda a: a[:n_full * group].reshape((n_full, group) + a.shape[1:]), xs)
  if in_loop:
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


# -- the module ------------------------------------------------------------------------


def _normalize_in_axes(in_axes, n_args, path):
  if not isinstance(in_axes, (tuple, list)):
    in_axes = (in_axes,) * n_args
  if len(in_axes) != n_args:
    raise errors.StackError(
        f'Stack at {path}: in_axes has {len(in_axes)} entries but the stack '
        f'was called with {n_args} argument(s) after the carry; give one '
        'entry (0 for per-layer, nn.broadcast for shared) per argument.')
  out = []
  for axis in in_axes:
    if axis is None or axis is broadcast:
      out.append(broadcast)
    elif axis == 0:
      out.append(0)
    else:
      raise errors.StackError(
          f'Stack at {path}: in_axes entries must be 0 (per-layer, leading '
          f'layer axis) or nn.broadcast (shared); got {axis!r}.')
  return tuple(out)


def _check_per_layer(path, index, arg, length):
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
    shape = jnp.shape(leaf)
    if not shape or shape[0] != length:
      where = f'argument {index + 1}{jax.tree_util.keystr(key_path)}'
      raise errors.StackError(
          f'Stack at {path}: {where} is declared per-layer (in_axes=0), so '
          f'its leading axis must be the number of layers {length}; got '
          f'shape {tuple(shape)}.')


def _check_signature(block, path, n_args, kw_names):
  try:
    sig = inspect.signature(block.__call__)
  except (TypeError, ValueError):
    return
  try:
    sig.bind(None, None, *([None] * n_args), **dict.fromkeys(kw_names))
  except TypeError as e:
    raise errors.StackError(
        f'Stack at {path}: {block.__name__}.__call__{sig} cannot be called as '
        f'block(x, <{n_args} more argument(s)>'
        f'{", " + ", ".join(kw_names) if kw_names else ""}): {e}. A stacked '
        'block takes the carry first, then the stack call\'s arguments.'
    ) from None


def _run(self, block, config, fold, x, args, kwargs):
  path = self.scope.path_text
  length, mode = config['length'], config['mode']
  axes = _normalize_in_axes(config['in_axes'], len(args), path)
  _check_signature(block, path, len(args), tuple(kwargs))
  for i, (arg, axis) in enumerate(zip(args, axes)):
    if axis == 0:
      _check_per_layer(path, i, arg, length)
  per_layer = tuple(a for a, axis in zip(args, axes) if axis == 0)
  shared = [a for a, axis in zip(args, axes) if axis is broadcast]
  policy = config['policy']
  if config['pipeline'] is not None and not fold:
    raise errors.StackError(
        f'Stack at {path}: a pipelined stack folds (stack(x)); stack.scan '
        'has no pipelined form.')
  if config['pipeline'] is not None:
    pipelining.note_stack(self.scope.path, config['pipeline'])
    given = pipelining.substituted(config['pipeline'], self.scope.path, x)
    if given is not None:  # 1F1B: the loop ran the stack on this microbatch
      return given
  name = block.__name__
  block_call = block.__call__

  def call_block(module, c, per):
    it_per, it_shared = iter(per), iter(shared)
    merged = [next(it_per) if axis == 0 else next(it_shared) for axis in axes]
    return block_call(module, c, *merged, **kwargs)

  def transform(scope_fn):

    def layer_fn(scopes, c, per):
      if policy is not None:
        c = _tag(c, CARRY)
        per = _tag(per, INPUTS)
      out = scope_fn(scopes, c, per)
      c, ys = _check_carry(path, name, fold, c, out)
      if policy is not None:
        ys = _tag(ys, OUTPUTS)
      return c, ys

    return _stack_transform(layer_fn, length=length, policy=policy, mode=mode,
                            unroll=config['unroll'],
                            metadata_params=config['metadata_params'],
                            path=path, pipeline=config['pipeline'],
                            site=(block, fold, axes, length, policy, mode,
                                  config['unroll'], config['pipeline']))

  c, ys = call_lifted(self, transform, (call_block,), ('__call__',), (), {},
                      (x, per_layer), {}, cls=block)
  return c if fold else (c, ys)


def Stack(block, length: int, *, policy=None, mode: str = 'scan',  # pylint: disable=invalid-name
          in_axes=broadcast, unroll: int = 1,
          metadata_params: dict | None = None, pipeline=None):
  """A Module class holding ``length`` stacked copies of ``block``.

  Args:
    block: a Module class. Its ``__call__`` takes the carry first; for
      ``stack(x)`` it returns the new carry, for ``stack.scan(x)`` a pair
      ``(carry, output)``.
    length: the number of layers ``L``.
    policy: how the backward pass trades memory for recomputation: ``None``
      (no rematerialization, like a plain ``nn.scan``), a
      :class:`StackPolicy`, or a shorthand (``'full'``, ``'save_all'``,
      ``'nested'``, ``'offload'``; see ``StackPolicy.of``).
    mode: ``'scan'`` (a ``lax.scan`` over layers) or ``'unrolled'`` (a
      Python loop over the same stacked variables; compiles each layer
      separately, applies the same policy per layer).
    in_axes: for the positional arguments after the carry, ``0`` (per-layer:
      leading axis ``L``, one slice per layer) or ``nn.broadcast`` (shared);
      one value for all or a tuple with one entry per argument. Keyword
      arguments are always shared.
    unroll: passed to ``lax.scan`` (for the layer loop).
    metadata_params: for boxed variables (``nn.Partitioned``) the name of
      the layer axis; default ``{nn.PARTITION_NAME: 'layers'}``.
    pipeline: an ``nn.Pipeline`` to run the layers as stages over a mesh
      axis (see ``docs/pipeline.md``); the variables are then stored
      stage-major (the layer order itself when ``repeats=1``).

  Returns:
    A subclass ``Stack{Block}`` of ``block`` whose ``__call__`` folds and
    whose ``scan`` method scans.
  """
  if not (inspect.isclass(block) and issubclass(block, Module)):
    raise errors.TransformTargetError(block)
  if not isinstance(length, int) or length < 1:
    raise ValueError(f'Stack: length must be a positive int; got {length!r}.')
  if mode not in ('scan', 'unrolled'):
    raise ValueError(f"Stack: mode must be 'scan' or 'unrolled'; got "
                     f'{mode!r}.')
  policy = StackPolicy.of(policy)
  pipelining.check_stack(pipeline, length, policy, mode)
  config = dict(pipeline=pipeline,
      length=length, policy=policy, mode=mode,
      in_axes=in_axes, unroll=unroll,
      metadata_params=({meta.PARTITION_NAME: 'layers'}
                       if metadata_params is None else dict(metadata_params)))

  def __call__(self, x, *args, **kwargs):  # pylint: disable=invalid-name
    return _run(self, block, config, True, x, args, kwargs)

  def scan(self, x, *args, **kwargs):
    return _run(self, block, config, False, x, args, kwargs)

  __call__.__doc__ = f'Folds x through the {length} layers.'
  scan.__doc__ = (f'Scans x through the {length} layers; returns (x, '
                  'per-layer outputs stacked on axis 0).')
  cls = type('Stack' + block.__name__, (block,),
             {'__call__': __call__, 'scan': scan, '__module__':
              block.__module__})
  cls.stack_config = property(lambda self: dict(config))
  return cls


# -- layouts ----------------------------------------------------------------------------


def unstack_layers(stacked, prefix: str = 'layers',
                   metadata_params: dict | None = None) -> dict:
  """Splits a stacked tree (leading layer axis) into per-layer trees named
  ``{prefix}_0 ... {prefix}_{L-1}``, the names an unscanned Linen model
  gives its layers. Boxed values lose their layer-axis name.

  >>> import jax.numpy as jnp
  >>> layers = unstack_layers({'Dense_0': {'bias': jnp.zeros((3, 2))}})
  >>> sorted(layers), layers['layers_2']['Dense_0']['bias'].shape
  (['layers_0', 'layers_1', 'layers_2'], (2,))
  """
  params = metadata_params or {meta.PARTITION_NAME: 'layers'}
  tree = meta.remove_axis(stacked, 0, params)
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    raise ValueError('unstack_layers: the tree has no arrays.')
  length = jnp.shape(leaves[0])[0]
  for leaf in leaves:
    if not jnp.shape(leaf) or jnp.shape(leaf)[0] != length:
      raise ValueError('unstack_layers: every array needs the same leading '
                       f'layer axis; found shapes {jnp.shape(leaves[0])} and '
                       f'{jnp.shape(leaf)}.')
  return {f'{prefix}_{i}': _take(tree, i) for i in range(length)}


def stack_layers(layers: dict, prefix: str = 'layers',
                 metadata_params: dict | None = None):
  """Inverse of :func:`unstack_layers`: stacks ``{prefix}_i`` entries (all
  ``i`` from 0, same structure) along a new leading axis.

  >>> import jax.numpy as jnp
  >>> tree = stack_layers({'layers_0': {'w': jnp.zeros(2)},
  ...                      'layers_1': {'w': jnp.ones(2)}})
  >>> tree['w'].shape
  (2, 2)
  """
  indices = {}
  for key in layers:
    head, _, index = str(key).rpartition('_')
    if head != prefix or not index.isdigit():
      raise ValueError(f'stack_layers: unexpected entry {key!r}; expected '
                       f'{prefix}_0 ... {prefix}_<L-1>.')
    indices[int(index)] = key
  if sorted(indices) != list(range(len(indices))):
    raise ValueError(f'stack_layers: layer indices {sorted(indices)} are not '
                     f'0 ... {len(indices) - 1}.')
  trees = [layers[indices[i]] for i in range(len(indices))]
  structures = {jax.tree_util.tree_structure(t) for t in trees}
  if len(structures) != 1:
    raise ValueError('stack_layers: the layers have different structures.')
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)
  params = metadata_params or {meta.PARTITION_NAME: 'layers'}
  return meta.add_axis(stacked, 0, params)
