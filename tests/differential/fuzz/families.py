"""The fuzz families, by the name ``--family=`` selects.

Each is a ``harness.Family``: a generator of random programs (random models
and random configurations of one feature) and the reference the feature
must equal. A family's module is imported only by ``get``: a family that needs several
devices runs in a process started with that many simulated CPU devices, and
the soak's parent process starts no backend.
"""
import importlib

from . import harness

# name: (module, devices, seconds a program may take: generous, since a
# loaded 2-core machine runs a 2 s program for a minute; the newest-JAX soak
# saw state seed 2000 take 51 s at load 17); the module defines
# ``draw`` and ``check`` (``module:suffix``: ``draw_suffix``, ``check_suffix``).
_FAMILIES = {
    'linen': ('linen_family', 1, 180.0),
    'stack': ('stack_family', 1, 180.0),
    'attention': ('attention_family', 1, 120.0),
    'lifted': ('lifted_family', 1, 120.0),
    'state': ('state_family', 1, 180.0),
    'sharded_init': ('spmd_family:init', 8, 240.0),
    'shard_map': ('spmd_family:map', 8, 240.0),
    'pipeline': ('pipeline_family', 8, 300.0),
    'explicit': ('spmd_family:explicit', 8, 240.0),
}


def names() -> list:
  """Every family, in the order ``all`` runs them."""
  return list(_FAMILIES)


def devices(name: str) -> int:
  """The simulated devices family ``name`` needs."""
  return _FAMILIES[name][1]


def limit_s(name: str) -> float:
  """How long one program of family ``name`` may take."""
  return _FAMILIES[name][2]


def get(name: str) -> harness.Family:
  """Family ``name`` (imports its module).

  Args:
    name: one of ``names()``.

  Raises:
    KeyError: an unknown family, naming the known ones.
  """
  if name not in _FAMILIES:
    raise KeyError(f'unknown fuzz family {name!r}; known: {names()}')
  module_name, n_devices, limit = _FAMILIES[name]
  module_name, _, suffix = module_name.partition(':')
  module = importlib.import_module(f'{__package__}.{module_name}')
  suffix = f'_{suffix}' if suffix else ''
  return harness.Family(name, getattr(module, 'draw' + suffix),
                        getattr(module, 'check' + suffix), n_devices, limit)
