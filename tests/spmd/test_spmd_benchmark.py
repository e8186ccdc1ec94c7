"""benchmarks.spmd's rows for a mesh with Explicit axes, at a tiny size.

The binary runs in a process of its own: it asks XLA for 8 CPU devices and
defines absl flags that other benchmark binaries define too."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

_SCRIPT = """
import contextlib, io, json, os
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
from absl import flags
import jax
from jax.sharding import AxisType
import liftmods as lnn
from benchmarks import spmd
flags.FLAGS(['spmd', '--layers=1', '--hidden=32', '--heads=2', '--vocab=64',
             '--batch=8', '--seq=8', '--repeats=1', '--step_repeats=1'])
key = jax.random.key(0)
tokens = jax.random.randint(jax.random.key(1), (8, 9), 0, 64)
rows = {}
for kind in (AxisType.Auto, AxisType.Explicit):
  mesh = spmd.make_mesh(kind)
  rows[str(kind)] = spmd.measure(str(kind), lnn, mesh, key, tokens,
                                 spmd.batch_on(mesh, tokens))
linen = spmd.linen_failure(spmd.make_mesh(AxisType.Explicit), key, tokens)
spmd.time_all(list(rows.values()))
out = io.StringIO()
with contextlib.redirect_stdout(out):
  spmd.print_explicit(*rows.values(), linen)
keep = ('param_bytes', 'init_temp', 'step_temp', 'collectives', 'loss')
print('JSON', json.dumps(dict(
    linen=linen, table=out.getvalue(),
    **{k: {f: r[f] for f in keep} for k, r in rows.items()})))
"""


def run_script():
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run([sys.executable, '-c', _SCRIPT], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(l for l in reversed(proc.stdout.splitlines())
              if l.startswith('JSON '))
  return json.loads(line[5:])


@pytest.mark.integration  # compiles the decoder's step on two 8-device meshes
def test_explicit_rows_beside_auto_and_linen_failure():
  r = run_script()
  auto, explicit = r['AxisType.Auto'], r['AxisType.Explicit']
  # The same shardings of the parameters on both meshes.
  assert explicit['param_bytes'] == auto['param_bytes'] > 0
  # Both steps communicate (the batch and the weights are split).
  assert auto['collectives'] > 0 and explicit['collectives'] > 0
  # The same computation: the losses agree to float32 rounding.
  assert explicit['loss'] == pytest.approx(auto['loss'], rel=1e-6)
  # flax.linen cannot build the step on the Explicit mesh; the binary
  # reports its error's class and message.
  assert re.fullmatch(r'\w+(Error|Exception): .+', r['linen']), r['linen']
  table = r['table'].strip('\n').splitlines()
  assert table[1].split() == ['Auto', 'Explicit', 'Expl/Auto']
  printed = {l[:34].strip(): l[34:].split() for l in table[2:]}
  for label, key in (('train step temp / device', 'step_temp'),
                     ('sharded init temp / device', 'init_temp'),
                     ('step collectives / device', 'collectives')):
    ratio = max(explicit[key], 1) / max(auto[key], 1)
    assert printed[label][-1] == f'{ratio:.2f}x', label
  assert printed['flax.linen on the Explicit mesh'] == (
      ['fails:'] + r['linen'].split())
