r"""Walk every transformers Flax model family on flax.linen and on liftmods.

For each ``transformers/models/<family>/modeling_flax_<family>.py`` the
family's base model class (``Flax<Name>Model``, else its first model class)
is built from its config class with every size attribute shrunk (hidden size
32, one layer, two heads, ...). Building runs the model's full forward pass
under ``init``; the initial parameters are then compared bit for bit between
the two sides. Each side runs in its own process (``--side``); without it
the script runs both and prints the table.

  python tools/hf_families.py [--families bert,gpt2] [--timeout 120]
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

TINY = {'hidden_size': 32, 'num_hidden_layers': 1, 'num_attention_heads': 2,
        'intermediate_size': 37, 'd_model': 32, 'encoder_layers': 1,
        'decoder_layers': 1, 'encoder_attention_heads': 2,
        'decoder_attention_heads': 2, 'encoder_ffn_dim': 37,
        'decoder_ffn_dim': 37, 'n_embd': 32, 'n_layer': 1, 'n_head': 2,
        'num_layers': 1, 'num_heads': 2, 'd_ff': 37, 'd_kv': 8,
        'num_key_value_heads': 2, 'vocab_size': 99, 'n_positions': 64,
        'max_position_embeddings': 64, 'image_size': 32, 'patch_size': 8,
        'embedding_size': 32, 'hidden_sizes': [8, 16], 'depths': [1, 1],
        'projection_dim': 16, 'num_decoder_layers': 1, 'rotary_dim': 8,
        'head_dim': 16, 'num_mel_bins': 8, 'max_source_positions': 32,
        'max_target_positions': 32, 'decoder_start_token_id': 0}


def _families():
  import transformers
  root = pathlib.Path(transformers.__file__).parent / 'models'
  return sorted(p.parent.name for p in root.glob('*/modeling_flax_*.py'))


def _shrink(config):
  for key, value in TINY.items():
    if hasattr(config, key):
      setattr(config, key, value)
  for key in ('text_config', 'vision_config', 'encoder', 'decoder'):
    sub = getattr(config, key, None)
    if sub is not None and hasattr(sub, 'to_dict'):
      _shrink(sub)
  return config


def _run_family(family):
  import importlib
  import numpy as np
  import jax
  mod = importlib.import_module(
      f'transformers.models.{family}.modeling_flax_{family}')
  classes = [n for n in dir(mod) if n.startswith('Flax') and
             n.endswith('Model') and 'PreTrained' not in n]
  if not classes:
    raise RuntimeError('no Flax model class')
  name = next((n for n in classes if n.lower() == f'flax{family}model'),
              classes[0])
  cls = getattr(mod, name)
  config = _shrink(cls.config_class())
  model = cls(config, seed=0)
  leaves = jax.tree_util.tree_flatten_with_path(model.params)[0]
  return name, {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def side_main(side, families, out_dir):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
  if side == 'liftmods':
    from liftmods import compat
    compat.install()
  from tests.compat.hf_side import shim_jnp_clip
  shim_jnp_clip()
  import numpy as np
  for family in families:
    try:
      name, arrays = _run_family(family)
      np.savez(os.path.join(out_dir, f'{side}-{family}.npz'), **arrays)
      status = {'ok': name}
    except Exception as e:  # pylint: disable=broad-except
      status = {'error': f'{type(e).__name__}: {str(e)[:160]}'}
    print(json.dumps({family: status}), flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--side', choices=['flax', 'liftmods'])
  parser.add_argument('--families', default='')
  parser.add_argument('--out', default='/tmp/hf_families')
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  families = args.families.split(',') if args.families else _families()
  if args.side:
    side_main(args.side, families, args.out)
    return
  procs = {s: subprocess.Popen([sys.executable, __file__, '--side', s,
                                '--families', ','.join(families),
                                '--out', args.out],
                               stdout=subprocess.PIPE, text=True)
           for s in ('flax', 'liftmods')}
  status = {s: {} for s in procs}
  for s, p in procs.items():
    for line in p.communicate()[0].splitlines():
      if line.startswith('{'):
        status[s].update(json.loads(line))
  import numpy as np
  same, differ, flax_fails = [], [], []
  for family in families:
    f, l = status['flax'].get(family, {}), status['liftmods'].get(family, {})
    if 'ok' not in f:
      flax_fails.append((family, f.get('error', 'did not finish')))
      continue
    if 'ok' not in l:
      differ.append((family, 'liftmods: ' + l.get('error', 'did not finish')))
      continue
    a = np.load(os.path.join(args.out, f'flax-{family}.npz'))
    b = np.load(os.path.join(args.out, f'liftmods-{family}.npz'))
    equal = (sorted(a.files) == sorted(b.files) and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k])
        for k in a.files))
    (same if equal else differ).append((family, f['ok']))
  runs = len(same) + len(differ)
  print(f'bit-identical under liftmods.compat: {len(same)} of {runs} '
        f'families that run under flax.linen ({len(families)} walked)')
  for family, why in differ:
    print(f'  differs: {family}: {why}')
  for family, why in flax_fails:
    print(f'  fails under flax.linen: {family}: {why}')


if __name__ == '__main__':
  main()
