"""Run by the multi-process tests in each child process: sharded init of the
tiny LM on a (4, 2) mesh over every process's devices, then what a user
would do with the result. Process 0 writes ``out.npz`` / ``out.json``."""
import json
import pathlib
import sys

from liftmods.testing.multiprocess import initialize_from_env

initialize_from_env()

# pylint: disable=wrong-import-position
import jax
import numpy as np

import jax.numpy as jnp

import liftmods as nn
from liftmods import serialization
from examples.lm.model import LOGICAL_RULES, Config, TransformerLM
from examples.lm.train import TrainConfig, init_state, make_optimizer
from examples.lm.train import make_mesh, on_all_processes

TINY = Config(max_len=32, num_layers=2, num_heads=2, d_model=32)


def state_tools(params):
  """The state tools on arrays spread over processes: they move leaves
  between trees without reading them, so every leaf out is a leaf in."""
  leaves = {id(x) for x in jax.tree_util.tree_leaves(params)}
  blocks, rest = nn.state.split(params, 'blocks', ...)
  merged = nn.state.merge(blocks, rest)
  renamed = nn.state.rename(params, {'blocks': 'layers'})
  grafted = nn.state.graft(params, renamed, {'layers': 'blocks'})
  kept = nn.state.select(params, nn.state.PathRegex('.*kernel'))
  outs = (blocks, rest, merged, renamed, grafted, kept)
  return {
      'state_same_leaves': all(id(x) in leaves for t in outs
                               for x in jax.tree_util.tree_leaves(t)),
      'state_merge_paths': nn.state.paths(merged) == nn.state.paths(params),
      'state_mask_true': sum(jax.tree_util.tree_leaves(
          nn.state.mask(params, 'blocks'))),
      'state_kernels': len(nn.state.paths(kept)),
  }


def main(out: pathlib.Path):
  cfg = TrainConfig(model=TINY, batch_size=8, devices=8)
  model = TransformerLM(TINY)
  mesh = make_mesh(cfg)
  state, _ = init_state(model, make_optimizer(cfg), 0, mesh)
  params = state['params']
  leaves = jax.tree_util.tree_leaves(params)
  report = {
      'process_count': jax.process_count(),
      'fully_addressable': [x.is_fully_addressable for x in leaves],
      'total_bytes': sum(x.nbytes for x in leaves),
      'device_bytes': sum(x.addressable_shards[0].data.nbytes
                          for x in leaves),
  }
  try:
    serialization.to_bytes(params)
    report['to_bytes_error'] = None
  except ValueError as e:
    report['to_bytes_error'] = str(e)
  report.update(state_tools(params))
  tokens = jnp.zeros((2, TINY.max_len), jnp.int32)
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
    report['tabulate'] = model.tabulate(jax.random.key(0), tokens,
                                        console_kwargs={'width': 200})
  whole = on_all_processes(params, mesh)
  if jax.process_index() == 0:
    flat = jax.tree_util.tree_flatten_with_path(whole)[0]
    np.savez(out / 'out.npz', **{jax.tree_util.keystr(k): np.asarray(v)
                                 for k, v in flat})
    (out / 'out.json').write_text(json.dumps(report))


if __name__ == '__main__':
  main(pathlib.Path(sys.argv[1]))
