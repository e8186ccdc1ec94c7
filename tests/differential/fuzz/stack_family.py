"""``nn.Stack`` against Linen's ``nn.scan`` over the same random block.

The block is a random Linen program (``programs.Generator``, without the
lifted transforms other than ``nn.remat``), wrapped in a ``Layer`` that adds
a shared or per-layer argument. liftmods runs ``nn.Stack(Layer, length=L,
policy=..., mode=..., in_axes=..., unroll=...)``, folding or scanning;
flax.linen runs ``nn.scan(Layer, variable_axes={True: 0}, split_rngs={True:
True}, length=L, in_axes=...)``, the layout ``nn.Stack`` promises to equal:
same variable trees, init bit for bit, outputs, mutated collections and
gradients allclose (``compare.compare`` with the reference source). The
policy changes what the backward pass keeps, never a value, so every policy
is held to the one plain scan.
"""
from . import compare, programs

# What a block may hold: layers, variables and nn.remat, no other transform
# (those are the linen family's business, and nn.scan has to equal them).
BLOCK_FEATURES = {f: False for f in programs.FEATURES}
BLOCK_FEATURES.update({f: True for f in (
    'dense', 'dense_general', 'conv', 'layer_norm', 'rms_norm', 'group_norm',
    'batch_norm', 'dropout', 'attention', 'activation', 'param', 'sow',
    'variable', 'submodule', 'remat')})

POLICIES = ('None', "'full'", "'save_all'", "'nested'",
            'nn.StackPolicy(nested=2)', 'nn.StackPolicy(save_carries=False)',
            "nn.StackPolicy(save_block_internals=True, prevent_cse=True)")


def _layer(returns: str) -> str:
  return '\n'.join([
      'class Layer(nn.Module):', '  train: bool = False', '',
      '  @nn.compact', '  def __call__(self, x, s):',
      "    h = Block(train=self.train, name='block')(x + s)",
      f'    return {returns}'])


def _model(make: str, call: list, per_layer: bool, length: int) -> str:
  shift = (f'jnp.linspace(-1.0, 1.0, {length * programs.F}).reshape('
           f'{length}, {programs.F})' if per_layer else
           f'jnp.full(({programs.F},), 0.5)')
  return '\n'.join([
      'class Model(nn.Module):', '  train: bool = False', '',
      '  @nn.compact', '  def __call__(self, x):', f'    s = {shift}',
      f'    stack = {make}(train=self.train, name=\'stack\')'] +
      [f'    {line}' for line in call] + ['    return x'])


def draw(c: programs.Chooser) -> compare.Case:
  """A random block, stack configuration and run (a ``compare.Case`` whose
  ``src`` uses ``nn.Stack`` and ``ref_src`` Linen's ``nn.scan``)."""
  gen = programs.Generator(c, BLOCK_FEATURES, max_depth=3)
  gen.node(c.integer(1, 3), len(programs.INPUT_SHAPE), pure=False,
           name='Block')
  blocks = '\n\n'.join(gen.classes)
  length = c.integer(1, 4)
  fold = c.boolean(0.6)
  per_layer = c.boolean(0.4)
  policy = c.choice(POLICIES)
  mode = c.choice(["'scan'", "'unrolled'"])
  unroll = c.choice([1, 2])
  in_axes = '0' if per_layer else 'nn.broadcast'
  ours = (f'nn.Stack(Layer, length={length}, policy={policy}, mode={mode}, '
          f'in_axes={in_axes}, unroll={unroll})')
  ref = (f'nn.scan(Layer, variable_axes={{True: 0}}, '
         f'split_rngs={{True: True}}, length={length}, in_axes={in_axes}, '
         f'unroll={unroll})')
  if fold:
    src = [_layer('h'), _model(ours, ['x = stack(x, s)'], per_layer, length)]
    ref_src = [_layer('h, None'),
               _model(ref, ['x, _ = stack(x, s)'], per_layer, length)]
  else:
    call = ['x, ys = stack{}(x, s)', 'x = x + ys.sum(0)']
    src = [_layer('h, 2 * h'),
           _model(ours, [call[0].format('.scan'), call[1]], per_layer,
                  length)]
    ref_src = [_layer('h, 2 * h'),
               _model(ref, [call[0].format(''), call[1]], per_layer, length)]
  mutable = tuple(col for col in ('batch_stats', 'intermediates', 'state')
                  if c.boolean(0.7))
  return compare.Case('\n\n'.join([blocks] + src) + '\n', c.boolean(),
                      c.boolean(), mutable,
                      ref_src='\n\n'.join([blocks] + ref_src) + '\n')


def check(case: compare.Case) -> tuple:
  """``compare.compare`` of the stack with its Linen scan."""
  import flax.linen as fnn  # pylint: disable=g-import-not-at-top
  import liftmods as lnn  # pylint: disable=g-import-not-at-top
  # Unrolled layers are separate programs: XLA without its optimizations
  # rounds their initializers' last bit differently from the scanned loop
  # (seed 12: 6e-8 in layer 3 of a Conv kernel); with them, bit for bit.
  # The scan and the stack are different programs, so gradients are held
  # to a tolerance scaled to each array (seed 10: BatchNorm on a dropped-out
  # batch, 9.19e-3 against 9.22e-3 beside 47.9; flax alone moves 4e-6 with
  # XLA's optimizations on or off).
  # Initializers must agree bit for bit; a variable init computes from
  # activations (a running sum) rounds as its program does (seed 101).
  return compare.compare(case, fnn, lnn,
                         optimize="mode='unrolled'" in case.src, scaled=True,
                         exact_cols=('params',))
