"""Variables to bytes and back: state dicts and msgpack, as in Linen.

``to_state_dict`` turns a tree of dicts, lists, tuples, namedtuples,
``FrozenDict``s and ``Partitioned`` boxes into nested dicts with string keys;
``from_state_dict(target, state)`` rebuilds ``target``'s structure (and its
container types) around the leaves of ``state``. ``msgpack_serialize`` /
``msgpack_restore`` encode a tree of plain containers and arrays;
``to_bytes`` / ``from_bytes`` combine the two. The bytes are the ones
``flax.serialization`` writes, so checkpoints move between the two
libraries. One addition: typed PRNG keys (``jax.random.key``) are encoded
with their implementation name and restored as typed keys (Linen cannot
encode them at all).

>>> import jax.numpy as jnp
>>> from liftmods import serialization
>>> from liftmods.core import freeze
>>> variables = freeze({'params': {'w': jnp.arange(3.)}})
>>> data = serialization.to_bytes(variables)
>>> restored = serialization.from_bytes(variables, data)
>>> type(restored).__name__, restored['params']['w'].tolist()
('FrozenDict', [0.0, 1.0, 2.0])
"""
import enum
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np

from liftmods.core import meta
from liftmods.core.frozen_dict import FrozenDict

__all__ = ['to_state_dict', 'from_state_dict', 'register_serialization_state',
           'is_serializable', 'current_path', 'msgpack_serialize',
           'msgpack_restore', 'to_bytes', 'from_bytes']

# -- state dicts ---------------------------------------------------------------

_REGISTRY = {}


class _Path(threading.local):

  def __init__(self):
    self.parts = []


_PATH = _Path()


def current_path() -> str:
  """The position in the target that ``from_state_dict`` is restoring.

  Returns:
    The ``'/'``-joined path, for error messages of restore handlers.
  """
  return '/'.join(_PATH.parts)


class _NamedTupleType:
  """Registry key standing for every namedtuple class."""


def _registry_key(x):
  if isinstance(x, tuple) and hasattr(x, '_fields'):
    return _NamedTupleType
  return type(x)


def register_serialization_state(ty: type,
                                 ty_to_state_dict: Callable[[Any], Any],
                                 ty_from_state_dict: Callable[[Any, Any], Any],
                                 override: bool = False) -> None:
  """Teaches ``to_state_dict``/``from_state_dict`` about the type ``ty``.

  Args:
    ty: the type.
    ty_to_state_dict: ``fn(x) -> state`` (a dict with string keys, or a
      leaf).
    ty_from_state_dict: ``fn(target, state) -> restored x``.
    override: replace a handler already registered for ``ty``.

  Raises:
    ValueError: ``ty`` has a handler and ``override`` is False.
  """
  if ty in _REGISTRY and not override:
    raise ValueError(f'a serialization handler for "{ty.__name__}" is '
                     'already registered')
  _REGISTRY[ty] = (ty_to_state_dict, ty_from_state_dict)


def is_serializable(target: Any) -> bool:
  """Whether a handler is registered for ``target`` (a type or a value).

  Args:
    target: a type or an instance.

  Returns:
    True when registered.
  """
  ty = target if isinstance(target, type) else type(target)
  return ty in _REGISTRY


def to_state_dict(target: Any) -> dict[str, Any]:
  """The state of ``target`` as nested dicts with string keys.

  Args:
    target: a registered container (dict, list, tuple, namedtuple, ...) or
      a leaf.

  Returns:
    The state; leaves (and values of unregistered types) as they are.

  Raises:
    ValueError: a handler returned a dict with non-string keys.
  """
  handler = _REGISTRY.get(_registry_key(target))
  if handler is None:
    return target
  state = handler[0](target)
  if isinstance(state, dict) and not all(isinstance(k, str) for k in state):
    raise ValueError(f'state dict keys must be strings, got {list(state)}')
  return state


def from_state_dict(target: Any, state: dict[str, Any],
                    name: str = '.') -> Any:
  """A copy of ``target`` holding the values of ``state``.

  Args:
    target: a tree of the wanted structure (e.g. freshly initialized
      variables).
    state: the state, as ``to_state_dict`` makes it.
    name: the name of this level, for ``current_path``.

  Returns:
    The restored copy (``state`` itself for an unregistered ``target``).
  """
  handler = _REGISTRY.get(_registry_key(target))
  if handler is None:
    return state
  _PATH.parts.append(name)
  try:
    return handler[1](target, state)
  finally:
    _PATH.parts.pop()


def _sequence_state(xs):
  return {str(i): to_state_dict(x) for i, x in enumerate(xs)}


def _restore_list(xs, state):
  if len(state) != len(xs):
    raise ValueError(f'the target has {len(xs)} entries but the state dict '
                     f'{len(state)}, at {current_path()}')
  return [from_state_dict(x, state[str(i)], name=str(i))
          for i, x in enumerate(xs)]


def _dict_state(xs):
  keys = {str(k) for k in xs}
  if len(keys) != len(xs):
    raise ValueError(f'dict keys {list(xs)} are not distinct as strings')
  return {str(k): to_state_dict(v) for k, v in xs.items()}


def _restore_dict(xs, state):
  missing = {str(k) for k in xs} - set(state)
  if missing:
    raise ValueError(f'the state dict lacks keys {sorted(missing)} of the '
                     f'target, at {current_path()}')
  return {k: from_state_dict(v, state[str(k)], name=str(k))
          for k, v in xs.items()}


def _restore_namedtuple(xs, state):
  if set(state) != set(xs._fields):
    raise ValueError(f'namedtuple fields {xs._fields} do not match the state '
                     f'dict keys {sorted(state)}, at {current_path()}')
  return type(xs)(**{k: from_state_dict(getattr(xs, k), v, name=k)
                     for k, v in state.items()})


register_serialization_state(dict, _dict_state, _restore_dict)
register_serialization_state(list, _sequence_state, _restore_list)
register_serialization_state(
    tuple, _sequence_state, lambda xs, s: tuple(_restore_list(list(xs), s)))
register_serialization_state(
    _NamedTupleType,
    lambda nt: {k: to_state_dict(getattr(nt, k)) for k in nt._fields},
    _restore_namedtuple)
register_serialization_state(
    FrozenDict, lambda fd: _dict_state(dict(fd)),
    lambda fd, s: FrozenDict(_restore_dict(dict(fd), s)))
register_serialization_state(
    meta.Partitioned, lambda p: {'value': to_state_dict(p.value)},
    lambda p, s: p.replace_boxed(from_state_dict(p.value, s['value'],
                                                 name='value')))
register_serialization_state(
    jax.tree_util.Partial,
    lambda p: {'args': to_state_dict(p.args),
               'keywords': to_state_dict(p.keywords)},
    lambda p, s: jax.tree_util.Partial(
        p.func, *from_state_dict(p.args, s['args']),
        **from_state_dict(p.keywords, s['keywords'])))

# -- msgpack -------------------------------------------------------------------
#
# Arrays travel as msgpack extension values whose payload is itself msgpack:
# (shape, dtype name, C-order bytes). Arrays larger than _CHUNK bytes are
# split into a dict of flat chunks, since msgpack caps one object at 2**31-1
# bytes.


class _Ext(enum.IntEnum):
  ndarray = 1
  native_complex = 2
  npscalar = 3
  prng_key = 4  # liftmods only: (impl name, key data as an ndarray payload)


_CHUNK = 2**30
_CHUNKED = '__msgpack_chunked_array__'


def _is_key(x) -> bool:
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype,
                                                     jax.dtypes.prng_key)


def _array_payload(arr) -> bytes:
  arr = np.asarray(arr)
  if arr.dtype.hasobject or arr.dtype.isalignedstruct:
    raise ValueError('arrays of objects or structured dtypes cannot be '
                     'serialized')
  if not arr.dtype.isnative:
    # The payload names the dtype without its byte order and is read back
    # in native order (Linen writes the foreign bytes and reads garbage).
    arr = arr.astype(arr.dtype.newbyteorder('='))
  return msgpack.packb((arr.shape, arr.dtype.name, arr.tobytes('C')),
                       use_bin_type=True)


def _array_from_payload(data: bytes) -> np.ndarray:
  shape, name, buffer = msgpack.unpackb(data, raw=True)
  dtype = jnp.dtype(name.decode())  # jnp knows bfloat16 and friends
  return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def _pack(x):
  if _is_key(x):
    impl = str(jax.random.key_impl(x))
    return msgpack.ExtType(_Ext.prng_key, msgpack.packb(
        (impl, _array_payload(jax.random.key_data(x))), use_bin_type=True))
  if isinstance(x, (np.ndarray, jax.Array)):
    return msgpack.ExtType(_Ext.ndarray, _array_payload(x))
  if isinstance(x, np.generic):
    return msgpack.ExtType(_Ext.npscalar, _array_payload(np.asarray(x)))
  if isinstance(x, complex):
    return msgpack.ExtType(_Ext.native_complex, msgpack.packb((x.real,
                                                               x.imag)))
  return x


def _unpack(code, data):
  if code == _Ext.ndarray:
    return _array_from_payload(data)
  if code == _Ext.npscalar:
    return _array_from_payload(data)[()]
  if code == _Ext.native_complex:
    real, imag = msgpack.unpackb(data)
    return complex(real, imag)
  if code == _Ext.prng_key:
    impl, payload = msgpack.unpackb(data, raw=False)
    return jax.random.wrap_key_data(_array_from_payload(payload), impl=impl)
  return msgpack.ExtType(code, data)


def _sorted_keys(d):
  try:
    return sorted(d)
  except TypeError:  # keys of mixed types keep their order
    return list(d)


def check_readable_here(x: Any, path: str) -> None:
  """Checks that this process can read all of ``x``'s values.

  Args:
    x: any value; only ``jax.Array``s are checked.
    path: where ``x`` is in the tree, for the message.

  Raises:
    ValueError: ``x`` is sharded across processes and some shards live on
      other hosts.

  >>> check_readable_here(jnp.ones(3), 'params/bias')  # one process: fine
  """
  if (isinstance(x, jax.Array) and not x.is_fully_addressable
      and not x.is_fully_replicated):
    raise ValueError(
        f'{path or "<root>"}: a {x.dtype}{list(x.shape)} array sharded '
        f'across {jax.process_count()} processes ({x.sharding}); this '
        f'process holds only some of its shards, so its values cannot be '
        'serialized here. Write it with orbax.checkpoint (every process '
        'saves its own shards), or gather it first with '
        'jax.experimental.multihost_utils.process_allgather(x, tiled=True), '
        f'which copies all {x.nbytes:,} bytes to every process.')


def _to_wire(x, sort, path=''):
  """A copy of the container tree with arrays as numpy, big ones chunked.
  With ``sort``, dict keys are sorted (as a pytree copy of the input would
  order them, which is what Linen's non-in-place serialization writes)."""
  if isinstance(x, dict):
    keys = _sorted_keys(x) if sort else list(x)
    return {k: _to_wire(x[k], sort, f'{path}/{k}'.lstrip('/')) for k in keys}
  if type(x) in (list, tuple):
    return type(x)(_to_wire(v, sort, f'{path}/{i}'.lstrip('/'))
                   for i, v in enumerate(x))
  if isinstance(x, jax.Array) and not _is_key(x):
    check_readable_here(x, path)
    x = np.asarray(x)
  if isinstance(x, np.ndarray) and x.nbytes > _CHUNK:
    flat = x.reshape(-1)
    step = max(1, _CHUNK // x.dtype.itemsize)
    chunks = [flat[i:i + step] for i in range(0, flat.size, step)]
    return {_CHUNKED: True,
            'shape': {str(i): n for i, n in enumerate(x.shape)},
            'chunks': {str(i): c for i, c in enumerate(chunks)}}
  return x


def _from_wire(x):
  if isinstance(x, dict):
    if _CHUNKED in x:
      shape = tuple(x['shape'][str(i)] for i in range(len(x['shape'])))
      chunks = [x['chunks'][str(i)] for i in range(len(x['chunks']))]
      return np.concatenate(chunks).reshape(shape)
    return {k: _from_wire(v) for k, v in x.items()}
  return x


def msgpack_serialize(pytree: Any, in_place: bool = False) -> bytes:
  """msgpack bytes of a tree of dicts, lists, tuples, Python scalars and arrays.

  Args:
    pytree: the tree.
    in_place: write dict keys in their own order (default: sorted, as
      Linen does); the input is never modified either way.

  Returns:
    The encoded bytes.

  Raises:
    ValueError: an array is sharded across processes (see
      ``check_readable_here``).
  """
  return msgpack.packb(_to_wire(pytree, sort=not in_place), default=_pack,
                       strict_types=True)


def msgpack_restore(encoded_pytree: bytes) -> Any:
  """The tree that ``msgpack_serialize`` encoded.

  Args:
    encoded_pytree: the bytes.

  Returns:
    The tree; tuples come back as lists, arrays as numpy arrays.
  """
  tree = msgpack.unpackb(encoded_pytree, ext_hook=_unpack, raw=False,
                         strict_map_key=False)
  return _from_wire(tree)


def to_bytes(target: Any) -> bytes:
  """msgpack bytes of ``to_state_dict(target)``.

  Args:
    target: e.g. a variables dict.

  Returns:
    The encoded bytes.
  """
  return msgpack_serialize(to_state_dict(target), in_place=True)


def from_bytes(target: Any, encoded_bytes: bytes) -> Any:
  """``target`` rebuilt with the values stored in ``encoded_bytes``.

  Args:
    target: a tree of the wanted structure.
    encoded_bytes: bytes from ``to_bytes``.

  Returns:
    The restored tree.
  """
  return from_state_dict(target, msgpack_restore(encoded_bytes))
