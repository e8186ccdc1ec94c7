"""The original family: random Linen programs under flax.linen and liftmods
(``programs`` and ``compare``), as a ``harness.Family``."""
from . import compare, programs

# Set by the soak's flags (--max_depth, --disable/--enable, --optimize).
MAX_DEPTH = 4
FEATURES = {}
OPTIMIZE = False


def draw(c: programs.Chooser) -> compare.Case:
  """A random Linen program and how it is run."""
  return compare.draw_case(c, FEATURES, max_depth=MAX_DEPTH)


def check(case: compare.Case) -> tuple:
  """``compare.compare`` under flax.linen and liftmods."""
  import flax.linen as fnn  # pylint: disable=g-import-not-at-top
  import liftmods as lnn  # pylint: disable=g-import-not-at-top
  return compare.compare(case, fnn, lnn, optimize=OPTIMIZE)
