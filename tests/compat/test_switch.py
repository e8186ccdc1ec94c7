"""liftmods.compat: the switch that resolves flax.linen to liftmods."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import liftmods
from liftmods import compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _linen_entries():
  return {n: m for n, m in sys.modules.items()
          if n == 'flax.linen' or n.startswith('flax.linen.')}


def _run(code, *args, env=None):
  return subprocess.run([sys.executable, *args, '-c', code] if not args else
                        [sys.executable, *args],
                        capture_output=True, text=True, cwd=ROOT,
                        env={**os.environ, **(env or {})}, check=False)


def test_install_uninstall_round_trip_restores_sys_modules_exactly():
  import flax
  import flax.linen  # the real one, imported by flax itself
  before = _linen_entries()
  before_attr = flax.linen
  before_path = list(sys.meta_path)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', compat.SwitchWarning)
    compat.install()
  try:
    import flax.linen as nn
    from flax.linen import partitioning
    from flax.linen.attention import dot_product_attention_weights
    from flax import linen
    assert nn.Dense is liftmods.Dense and linen is nn
    assert partitioning.remat is liftmods.partitioning.remat
    assert dot_product_attention_weights is (
        liftmods.attention.dot_product_attention_weights)
    assert nn.__name__ == 'flax.linen'
    # The rest of flax stays flax's own.
    import flax.core
    import flax.serialization
    import flax.struct
    import flax.traverse_util
    for mod in (flax.core, flax.struct, flax.traverse_util,
                flax.serialization):
      assert mod.__file__.startswith(os.path.dirname(flax.__file__))
  finally:
    compat.uninstall()
  assert not compat.is_installed()
  after = _linen_entries()
  assert after.keys() == before.keys()
  assert all(after[k] is before[k] for k in before)
  assert flax.linen is before_attr and sys.meta_path == before_path
  import flax.linen as nn2
  assert nn2.Dense is not liftmods.Dense


def test_context_manager_uninstalls_on_exit_and_on_error():
  with pytest.raises(RuntimeError, match='boom'):
    with compat.flax_linen_as_liftmods(warn=False):
      import flax.linen as nn
      assert nn.Module is liftmods.Module
      raise RuntimeError('boom')
  assert not compat.is_installed()
  import flax.linen as nn
  assert nn.Module is not liftmods.Module


def test_module_imported_before_switch_keeps_real_linen_and_warns():
  code = textwrap.dedent("""
      import sys, types, warnings
      import flax.linen as real
      third = types.ModuleType('thirdparty')
      exec('import flax.linen as nn', third.__dict__)
      sys.modules['thirdparty'] = third
      from liftmods import compat
      with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        compat.install()
      print([str(x.message) for x in w if
             issubclass(x.category, compat.SwitchWarning)])
      import flax.linen as nn
      import liftmods
      print(third.nn is real, nn.Dense is liftmods.Dense)
      """)
  result = _run(code)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert 'keep the real flax.linen: __main__, thirdparty.' in lines[0]
  assert lines[1] == 'True True'


def test_no_warning_when_only_flax_itself_imported_linen():
  result = _run('import flax, warnings\n'
                'warnings.simplefilter("error")\n'
                'from liftmods import compat\ncompat.install()\n'
                'import flax.linen, liftmods\n'
                'print(flax.linen.Module is liftmods.Module)')
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == 'True'


@pytest.mark.parametrize('statement,name', [
    ('from flax.linen import NoSuchLayer', 'flax.linen.NoSuchLayer'),
    ('from flax.linen.attention import NoSuchFn',
     'flax.linen.attention.NoSuchFn'),
    ('import flax.linen.experimental', 'flax.linen.experimental'),
])
def test_missing_name_error_names_it_and_the_version(statement, name):
  with compat.flax_linen_as_liftmods(warn=False):
    with pytest.raises(ImportError) as info:
      exec(statement, {})
  message = str(info.value)
  assert f"'{name}'" in message
  assert f'liftmods {liftmods.__version__}' in message


def test_missing_attribute_error_names_it_and_the_version():
  with compat.flax_linen_as_liftmods(warn=False):
    import flax.linen as nn
    with pytest.raises(AttributeError,
                       match=f"'flax.linen.NoSuch' is not provided by "
                             f"liftmods {liftmods.__version__}"):
      nn.NoSuch  # pylint: disable=pointless-statement
    assert not hasattr(nn, 'NoSuch')


def test_entry_point_runs_script_under_switch_and_env_var_turns_it_off(
    tmp_path):
  script = tmp_path / 'script.py'
  script.write_text('import sys, flax.linen as nn\n'
                    'print(nn.Dense.__module__, sys.argv[1:])\n')
  on = _run(None, '-m', 'liftmods.compat', str(script), 'a')
  assert on.returncode == 0, on.stderr
  assert on.stdout.strip() == "liftmods.layers.linear ['a']"
  off = _run(None, '-m', 'liftmods.compat', str(script),
             env={compat.ENV_VAR: '0'})
  assert off.stdout.strip() == 'flax.linen.linear []'


def test_liftmods_never_imports_flax():
  code = textwrap.dedent("""
      import sys
      class Block:
        def find_spec(self, name, path=None, target=None):
          if name == 'flax' or name.startswith('flax.'):
            raise ImportError('flax is blocked')
      sys.meta_path.insert(0, Block())
      import liftmods, liftmods.compat
      import liftmods.traverse_util, liftmods.core.scope
      print(sorted(m for m in sys.modules if m.split('.')[0] == 'flax'))
      """)
  result = _run(code)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == '[]'
