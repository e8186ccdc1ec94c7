"""What the TPU test files share: the repository root (for subprocesses)
and the skip marker for tests that compile with libtpu."""
import os

import pytest

from benchmarks import aot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_available(),
    reason='libtpu is not installed (pip install -e ".[tpu]"): nothing can '
    'be compiled for a TPU slice')
