"""Which XLA flags this jaxlib knows, found without risking the process.

XLA reads ``XLA_FLAGS`` when JAX creates its first backend and aborts the
process (``Unknown flag in XLA_FLAGS``) on a name it does not know; there is
no API to ask first, and flags come and go between jaxlib releases. So a
child Python starts a CPU backend with the candidate flags: if it survives,
they are all known. Otherwise each flag is tried alone (a handful of
children, only on a jaxlib that dropped one).
"""
import os
import subprocess
import sys
from typing import Sequence

_START_CPU = 'import jax; jax.devices("cpu")'


def _starts(flags: Sequence[str]) -> bool:
  env = dict(os.environ, XLA_FLAGS=' '.join(flags), JAX_PLATFORMS='cpu')
  result = subprocess.run([sys.executable, '-c', _START_CPU], env=env,
                          capture_output=True, timeout=120, check=False)
  return result.returncode == 0


def usable(flags: Sequence[str]) -> list[str]:
  """The flags of ``flags`` that this jaxlib accepts, in order.

  Args:
    flags: ``--name=value`` XLA flags.

  Returns:
    Those a CPU backend starts with (checked in child processes).
  """
  if _starts(flags):
    return list(flags)
  return [flag for flag in flags if _starts([flag])]
