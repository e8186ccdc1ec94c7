"""liftmods.traverse_util against flax.traverse_util."""
import pytest
from flax import traverse_util as theirs

from liftmods import traverse_util as ours

TREE = {'params': {'Dense_0': {'kernel': 1, 'bias': 2}, 'empty': {}},
        'batch_stats': {'BN': {'mean': 3}}, 'top': 4}


@pytest.mark.parametrize('kwargs', [
    {}, {'keep_empty_nodes': True}, {'sep': '/'},
    {'is_leaf': lambda path, node: path == ('params', 'Dense_0')},
])
def test_flatten_matches_flax(kwargs):
  got, want = ours.flatten_dict(TREE, **kwargs), theirs.flatten_dict(
      TREE, **kwargs)
  assert list(got) == list(want)
  for k in want:
    if want[k] is theirs.empty_node:
      assert got[k] is ours.empty_node
    else:
      assert got[k] == want[k]


@pytest.mark.parametrize('sep', [None, '/'])
def test_unflatten_round_trip_matches_flax(sep):
  flat = ours.flatten_dict(TREE, keep_empty_nodes=True, sep=sep)
  assert ours.unflatten_dict(flat, sep=sep) == theirs.unflatten_dict(
      theirs.flatten_dict(TREE, keep_empty_nodes=True, sep=sep), sep=sep)
  assert ours.unflatten_dict(flat, sep=sep) == TREE


def test_flatten_rejects_a_leaf():
  with pytest.raises(TypeError, match='expects a mapping'):
    ours.flatten_dict(3)
