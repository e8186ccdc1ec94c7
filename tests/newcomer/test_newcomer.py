"""What a new user meets first: tracebacks that end at their own line, a
warning for misspelled logical axis names, and docs free of words about how
the project is made."""
import pathlib
import re
import subprocess
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import pytest

import liftmods as nn
from liftmods import errors
from liftmods.traceback_util import PACKAGE_DIR

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEY = jax.random.key(0)
X = jnp.ones((1, 2))


# -- tracebacks ----------------------------------------------------------------


class Grows(nn.Module):
  """Maps 2 features to 3: not a valid fold block."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x)


class BadDense(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(x, 'an extra argument')  # the user's mistake


def _init_bad(x):
  return BadDense().init(KEY, x)


def _apply_bad(x):
  variables = nn.Dense(2).init(KEY, x)
  return BadDense().apply({'params': {'Dense_0': variables['params']}}, x)


def _vmap_bad(x):
  return nn.vmap(BadDense, variable_axes={'params': 0},
                 split_rngs={'params': True}, in_axes=0)().init(KEY, x[None])


def _stack_bad(x):
  return nn.Stack(Grows, 4)().init(KEY, x)


def _frames(err):
  return [(f.filename, f.name) for f in traceback.extract_tb(err.__traceback__)]


@pytest.mark.parametrize('call,error,last', [
    (_init_bad, TypeError, '__call__'),
    (_apply_bad, TypeError, '__call__'),
    (_vmap_bad, TypeError, '__call__'),
    (_stack_bad, errors.StackError, '_stack_bad'),
])
def test_traceback_hides_liftmods_frames(call, error, last):
  with pytest.raises(error) as info:
    call(X)
  frames = _frames(info.value)
  inside = [f for f in frames if f[0].startswith(PACKAGE_DIR)]
  assert not inside, inside
  assert frames[-1] == (__file__, last), frames


def test_traceback_filtering_off_shows_liftmods_frames():
  code = ('import jax, jax.numpy as jnp, liftmods as nn\n'
          'class B(nn.Module):\n'
          '  @nn.compact\n'
          '  def __call__(self, x):\n'
          '    return nn.Dense(3)(x)\n'
          'nn.Stack(B, 4)().init(jax.random.key(0), jnp.ones((1, 2)))\n')
  env = {'JAX_TRACEBACK_FILTERING': 'off', 'PYTHONPATH': str(ROOT),
         'JAX_PLATFORMS': 'cpu', 'PATH': '/usr/bin:/bin'}
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, env=env, cwd=ROOT, check=False).stderr
  assert 'StackError' in out
  assert f'{PACKAGE_DIR}/stack.py' in out


# -- sharding typos ------------------------------------------------------------


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'mlp')))(x)


MESH = jax.make_mesh((1, 1), ('fsdp', 'tensor'))
INPUT = jnp.ones((2, 4))


def test_misspelled_rule_warns_once_naming_both():
  init = nn.init_sharded(MLP(), MESH, (('embed', 'fsdp'), ('mpl', 'tensor')))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    variables, shardings = init(KEY, INPUT)
    init(KEY, INPUT)
  typo = [w for w in caught if issubclass(w.category, nn.LogicalNamesWarning)]
  assert len(typo) == 1, [str(w.message) for w in caught]
  message = str(typo[0].message)
  assert "('mlp',) match no rule" in message
  assert "'mpl' (did you mean 'mlp'?) match no variable" in message
  assert 'warn_unmapped=False' in message
  assert typo[0].filename == __file__  # points at the user's call
  # Linen's default result: the unmatched dimension is replicated.
  assert shardings['params']['Dense_0']['kernel'].spec == jax.sharding.PartitionSpec(
      'fsdp', None)
  assert variables['params']['Dense_0']['kernel'].shape == (4, 8)


class ConstrainedMLP(MLP):
  """Constrains its activations with the 'batch' name, which no variable
  of the model carries."""

  def __call__(self, x):
    return nn.with_logical_constraint(super().__call__(x), ('batch', 'mlp'))


@pytest.mark.parametrize('model,rules,kwargs', [
    (MLP, (('embed', 'fsdp'), ('mlp', 'tensor')), {}),
    (ConstrainedMLP, (('embed', None), ('mlp', 'tensor'), ('batch', 'fsdp')),
     {}),
    (MLP, (('embed', 'fsdp'), ('mpl', 'tensor')), {'warn_unmapped': False}),
])
def test_correct_or_silenced_rules_do_not_warn(model, rules, kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter('error', nn.LogicalNamesWarning)
    _, shardings = nn.init_sharded(model(), MESH, rules, **kwargs)(KEY, INPUT)
  assert shardings['params']['Dense_0']['kernel'].spec[1] in ('tensor', None)


def test_a_rule_the_model_never_uses_warns():
  rules = (('embed', 'fsdp'), ('mlp', 'tensor'), ('batch', 'fsdp'))
  with pytest.warns(nn.LogicalNamesWarning,
                    match=r"names 'batch' match no variable and no "
                    r"with_logical_constraint"):
    nn.init_sharded(MLP(), MESH, rules)(KEY, INPUT)


def test_raise_error_names_the_unmapped_name():
  with pytest.raises(errors.LogicalAxisUnmappedError,
                     match=r"'mlp' is unmapped\. Add a rule \('mlp', "):
    nn.init_sharded(MLP(), MESH, (('embed', 'fsdp'), ('mpl', 'tensor')),
                    fallback=nn.spmd.RulesFallback.RAISE_ERROR,
                    warn_unmapped=False)(KEY, INPUT)


# -- the stack's length message ------------------------------------------------


class Residual(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(x.shape[-1])(x)


def test_wrong_length_checkpoint_names_both_lengths():
  variables = nn.Stack(Residual, 5)(name='blocks').init(KEY, X)
  with pytest.raises(errors.VariableAxisError,
                     match='the checkpoint has 5 layers, the stack 4') as info:
    nn.Stack(Residual, 4)(name='blocks').apply(variables, X)
  assert 'variable_axes' not in str(info.value)


# -- no words about how the project is made ------------------------------------

# Each pattern is about the making of the project, not what it does:
# "equivalent" or "helper function" must not match.
PROCESS_WORDS = re.compile(
    r'\blent\b|\b(?:this|a|each|earlier|later|next|the) session\b'
    r'|\bsessions\b|\bworktree\b|\bhelper branch'
    r'|\bthis task\b|\bissue \d+\b|\bnot met\b|\bno (?:gpu|accelerator) was\b',
    re.IGNORECASE)
TEXT_SUFFIXES = {'.py', '.md', '.toml', '.yml', '.yaml', '.txt', '.cfg', '.ini',
                 ''}


def _tracked_text_files():
  names = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.splitlines()
  for name in names:
    path = ROOT / name
    if path.suffix in TEXT_SUFFIXES and path.is_file():
      yield name, path


def test_no_tracked_text_speaks_of_the_process():
  found = []
  for name, path in _tracked_text_files():
    if name == 'tests/newcomer/test_newcomer.py':
      continue  # the word list itself
    try:
      text = path.read_text(encoding='utf-8')
    except UnicodeDecodeError:
      continue
    for n, line in enumerate(text.splitlines(), 1):
      if PROCESS_WORDS.search(line):
        found.append(f'{name}:{n}: {line.strip()}')
  assert not found, '\n'.join(found)


def test_process_word_list_catches_and_spares():
  assert PROCESS_WORDS.search('No GPU was lent to this task')
  assert PROCESS_WORDS.search("this project's sessions")
  assert PROCESS_WORDS.search('the target is not met')
  for fine in ('the equivalent program', 'a helper function',
               'a silent failure', 'an issue with shapes',
               "@pytest.fixture(scope='session')",
               'jax.distributed finds the coordinator'):
    assert not PROCESS_WORDS.search(fine), fine
