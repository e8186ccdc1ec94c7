"""install() looks through every loaded module for references to the real
flax.linen; objects there may raise on any attribute access."""
import sys
import types
import warnings

from liftmods import compat


class _RaisesOnEveryAttribute:
  """Like trimesh's stand-in for a missing optional dependency (brax imports
  trimesh): reading any attribute but ``__class__`` raises."""

  def __getattribute__(self, name):
    if name == '__class__':
      return type(None)
    raise ModuleNotFoundError("No module named 'not_installed'")


def test_install_skips_objects_that_raise_on_attribute_access():
  holder = types.ModuleType('holds_a_stand_in')
  holder.stand_in = _RaisesOnEveryAttribute()
  sys.modules[holder.__name__] = holder
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      with compat.flax_linen_as_liftmods():
        import flax.linen  # pylint: disable=import-outside-toplevel
        import liftmods  # pylint: disable=import-outside-toplevel
        assert flax.linen.Dense is liftmods.Dense
    for warning in caught:
      assert holder.__name__ not in str(warning.message)
  finally:
    del sys.modules[holder.__name__]
  assert not compat.is_installed()
