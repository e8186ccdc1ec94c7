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
import inspect
import math
import types
import warnings
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from liftmods import errors, pipeline as pipelining
from liftmods.core import meta
from liftmods.core.layer_scan import Remat, layer_scan
from liftmods.core.pack import broadcast
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


# -- the stack's errors and rematerialization, as layer_scan wants them ------------------


def _avals(tree):
  return jax.tree_util.tree_map(
      lambda x: (tuple(jnp.shape(x)), jnp.result_type(x)), tree)


class _Explain:
  """The errors of a stack's loop (``layer_scan.Explain``), worded for the
  block and the stack call."""

  def __init__(self, path: str, block: str, fold: bool, length: int):
    self.path, self.block, self.fold, self.length = path, block, fold, length

  def output(self, out):
    return errors.StackError(
        f'Stack at {self.path}: stack.scan needs {self.block}.__call__ to '
        f'return a pair (carry, output); it returned {type(out).__name__}. '
        'Call the stack itself to fold a block that maps x -> x.')

  def carry(self, c_in, out, mismatch):
    del mismatch  # the avals of both carries say it in full
    c_out = out if self.fold else out[0]
    what = ('a fold block must map x -> x' if self.fold else
            'a scan block must return (x, output) with x')
    hint = (' It returned a pair: for a block returning (carry, output) use '
            'stack.scan.' if self.fold and isinstance(out, tuple) and
            len(out) == 2 else '')
    return errors.StackError(
        f'Stack at {self.path}: {self.block}.__call__ returned a carry of '
        f'{_avals(c_out)}, but received {_avals(c_in)}; {what} of the same '
        f'structure, shape and dtype.{hint}')

  def axis(self, scope, where, shape):
    # Layers are stored on axis 0: a mismatch is a checkpoint saved for
    # another number of layers.
    if not shape:
      got = f'has shape {shape}, with no layer axis'
    else:
      got = f'has shape {shape}: the checkpoint has {shape[0]} layers'
    return errors.VariableAxisError(
        f'Stack at {scope.path_text}: {where} {got}, the stack {self.length}. '
        f'Load variables saved for {self.length} layers, build the stack with '
        "the checkpoint's length, or re-initialize.")


def _remat(policy: StackPolicy | None, path: str) -> Remat | None:
  """The policy as layer_scan's Remat, offloading only where the target
  platform has host memory (else warning once per trace)."""
  if policy is None:
    return None
  offload = False
  if policy.offloaded_names():
    offload = offload_supported()
    if not offload:
      warnings.warn(
          f'Stack at {path}: the policy offloads {policy.offloaded_names()} '
          f'to pinned host memory, but the target platform '
          f'({target_platform()}) has no host memory space separate from the '
          'device (XLA:CPU keeps everything in device memory); keeping these '
          'values in device memory instead. To compile for other devices, '
          'trace under jax.set_mesh(mesh) with a mesh of those devices.',
          StackOffloadWarning, stacklevel=5)
  return Remat(
      policy=policy.jax_policy(offload), prevent_cse=policy.prevent_cse,
      names=(CARRY, INPUTS, OUTPUTS),
      group_size=None if policy.nested is False else policy.groups,
      offload_group_carry=(GROUP_CARRY if offload and
                           policy.save_carries == 'offload' else None))


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


def _run(self, block, config: 'StackConfig', fold, x, args, kwargs):
  path = self.scope.path_text
  axes = _normalize_in_axes(config.in_axes, len(args), path)
  _check_signature(block, path, len(args), tuple(kwargs))
  for i, (arg, axis) in enumerate(zip(args, axes)):
    if axis == 0:
      _check_per_layer(path, i, arg, config.length)
  pipeline = config.pipeline
  if pipeline is not None and not fold:
    raise errors.StackError(
        f'Stack at {path}: a pipelined stack folds (stack(x)); stack.scan '
        'has no pipelined form.')
  if pipeline is not None:
    pipelining.note_stack(self.scope.path, pipeline)
    given = pipelining.substituted(pipeline, self.scope.path, x)
    if given is not None:  # 1F1B: the loop ran the stack on this microbatch
      return given
  remat = _remat(config.policy, path)
  initializing = self.is_initializing()
  if initializing and remat is not None and remat.group_size is not None:
    # init is not differentiated, so the groups save nothing there, and
    # their program rounds an initializer differently from the plain
    # scan's (a few ulp under jit): init runs the plain scan's program.
    remat = dataclasses.replace(remat, group_size=None)
  loop = dict(
      length=config.length, fold=fold, in_axes=axes,
      rolled=config.mode == 'scan', unroll=config.unroll, remat=remat,
      metadata_params=config.metadata_params,
      site=(block, fold, axes, config, initializing),
      explain=_Explain(path, block.__name__, fold, config.length),
      schedule=(None if pipeline is None else
                pipelining.StackSchedule(pipeline, path)),
      name='Stack')
  return call_lifted(self, layer_scan, (block.__call__,), ('__call__',), (),
                     loop, (x,) + tuple(args), kwargs, cls=block)


@dataclasses.dataclass(frozen=True)
class StackConfig:
  """The configuration of a stack class, as ``Stack`` was called.

  Attributes:
    length: the number of layers.
    policy: the rematerialization policy, or None.
    mode: ``'scan'`` or ``'unrolled'``.
    in_axes: the per-argument layer axes (``0`` or ``broadcast``).
    unroll: passed to ``lax.scan``.
    pipeline: the ``nn.Pipeline``, or None.
    metadata_params: the boxed variables' layer-axis parameters (not
      compared: they change no trace).
  """
  length: int
  policy: StackPolicy | None
  mode: str
  in_axes: Any
  unroll: int
  pipeline: Any
  metadata_params: Mapping[str, Any] = dataclasses.field(compare=False)

  @classmethod
  def of(cls, length: int, policy: Any, mode: str, in_axes: Any, unroll: int,
         metadata_params: Mapping[str, Any] | None,
         pipeline: Any) -> 'StackConfig':
    """The checked configuration of ``Stack``'s arguments (see there).

    Raises:
      ValueError: ``length``, ``mode``, ``policy`` or ``pipeline`` is
        invalid.
    """
    if not isinstance(length, int) or length < 1:
      raise ValueError(f'Stack: length must be a positive int; got '
                       f'{length!r}.')
    if mode not in ('scan', 'unrolled'):
      raise ValueError(f"Stack: mode must be 'scan' or 'unrolled'; got "
                       f'{mode!r}.')
    policy = StackPolicy.of(policy)
    pipelining.check_stack(pipeline, length, policy, mode)
    return cls(length=length, policy=policy, mode=mode,
               in_axes=tuple(in_axes) if isinstance(in_axes, list) else
               in_axes, unroll=unroll, pipeline=pipeline,
               metadata_params=types.MappingProxyType(
                   {meta.PARTITION_NAME: 'layers'} if metadata_params is None
                   else dict(metadata_params)))


def Stack(block: type[Module], length: int, *,  # pylint: disable=invalid-name
          policy: 'StackPolicy | str | bool | None' = None,
          mode: str = 'scan', in_axes: Any = broadcast, unroll: int = 1,
          metadata_params: Mapping[str, Any] | None = None,
          pipeline: 'pipelining.Pipeline | None' = None) -> type[Module]:
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
    whose ``scan`` method scans; its ``stack_config`` is the
    :class:`StackConfig` built from these arguments.

  Raises:
    TransformTargetError: ``block`` is not a Module class.
    ValueError: ``length``, ``mode`` or ``policy`` is not one of the values
      above, or ``pipeline`` does not fit the stack.

  >>> import jax, jax.numpy as jnp, liftmods as nn
  >>> class Scanned(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     y = nn.Dense(x.shape[-1])(x)
  ...     return x + y, y.sum()
  >>> Layers = nn.Stack(Scanned, length=3, policy='nested')
  >>> (x, sums), variables = Layers().init_with_output(
  ...     jax.random.key(0), jnp.ones((2, 4)), method='scan')
  >>> x.shape, sums.shape, Layers.stack_config.length
  ((2, 4), (3,), 3)
  """
  if not (inspect.isclass(block) and issubclass(block, Module)):
    raise errors.TransformTargetError(block)
  config = StackConfig.of(length, policy, mode, in_axes, unroll,
                          metadata_params, pipeline)

  def __call__(self, x, *args, **kwargs):  # pylint: disable=invalid-name
    return _run(self, block, config, True, x, args, kwargs)

  def scan(self, x, *args, **kwargs):
    return _run(self, block, config, False, x, args, kwargs)

  def setup(self):
    # The block's setup runs in each layer (the clones ``_run`` lifts are
    # ``block``s); run here, on the stack's own scope, variables it declares
    # would be created once, without their layer axis.
    del self

  __call__.__doc__ = f'Folds x through the {config.length} layers.'
  scan.__doc__ = (f'Scans x through the {config.length} layers; returns (x, '
                  'per-layer outputs stacked on axis 0).')
  return type('Stack' + block.__name__, (block,),
              {'__call__': __call__, 'scan': scan, 'setup': setup,
               'stack_config': config,
               '__module__': block.__module__})


# -- layouts ----------------------------------------------------------------------------


def unstack_layers(stacked: Mapping[str, Any], prefix: str = 'layers',
                   metadata_params: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
  """Splits a stacked tree into one tree per layer.

  The names are ``{prefix}_0 ... {prefix}_{L-1}``, the ones an unscanned
  Linen model gives its layers; boxed values lose their layer-axis name.

  Args:
    stacked: a variable tree whose arrays share a leading layer axis.
    prefix: the layers' name before ``_i``.
    metadata_params: the boxes' layer-axis parameters; default
      ``{nn.PARTITION_NAME: 'layers'}``.

  Returns:
    ``{f'{prefix}_{i}': layer i's tree}``.

  Raises:
    ValueError: the tree has no arrays, or their leading axes differ.

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
  return {f'{prefix}_{i}': jax.tree_util.tree_map(lambda a, i=i: a[i], tree)
          for i in range(length)}


def stack_layers(layers: Mapping[str, Any], prefix: str = 'layers',
                 metadata_params: Mapping[str, Any] | None = None) -> Any:
  """Stacks per-layer trees on a new leading axis (the inverse of
  :func:`unstack_layers`).

  Args:
    layers: ``{f'{prefix}_{i}': tree}`` for every ``i`` from 0, all trees of
      the same structure.
    prefix: the layers' name before ``_i``.
    metadata_params: the boxes' layer-axis parameters; default
      ``{nn.PARTITION_NAME: 'layers'}``.

  Returns:
    One tree whose arrays have a leading axis of ``len(layers)``.

  Raises:
    ValueError: an entry is not named ``{prefix}_i``, indices are missing,
      or the trees differ in structure.

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
