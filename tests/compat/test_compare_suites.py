"""tools/compare_suites.py: a third-party suite on both sides of the switch."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

SUITE = textwrap.dedent('''
    import flax.linen as nn
    import liftmods

    def test_dense_field():
      assert nn.Dense(2).features == 2

    def test_switched():
      assert nn.Dense is liftmods.Dense

    def test_not_switched():
      assert nn.Dense is not liftmods.Dense
''')


def test_reports_counts_differences_and_regressions(tmp_path):
  (tmp_path / 'test_suite.py').write_text(SUITE)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'tools', 'compare_suites.py'),
       '--workdir', str(tmp_path), '--', 'test_suite.py'],
      capture_output=True, text=True, check=False, timeout=300,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  out = proc.stdout
  assert 'flax.linen: 2/3 passed; liftmods: 2/3 passed' in out, out
  assert ('differs: test_suite.py::test_not_switched: flax.linen passed, '
          'liftmods failed') in out
  assert ('differs: test_suite.py::test_switched: flax.linen failed, '
          'liftmods passed') in out
  assert 'failing under flax.linen itself (1):\n  test_suite.py::test_switched' in out
  assert proc.returncode == 1  # test_not_switched regressed
  assert not list(tmp_path.glob('.compare-*.xml'))
