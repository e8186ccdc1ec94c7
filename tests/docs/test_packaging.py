"""liftmods runs on its runtime dependencies alone (jax, jaxlib, numpy)."""
import subprocess
import sys


def test_import_without_test_dependencies():
  code = ('import sys\n'
          'for name in ("flax", "optax", "chex", "absl", "hypothesis"):\n'
          '  sys.modules[name] = None  # any import of these now fails\n'
          'import liftmods.core, liftmods\n'
          'import jax, jax.numpy as jnp\n'
          'v = liftmods.Dense(2).init(jax.random.key(0), jnp.ones((1, 3)))\n'
          'print(sorted(v["params"]))\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, check=True)
  assert out.stdout.strip() == "['bias', 'kernel']"
