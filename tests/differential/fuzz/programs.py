"""Random Linen programs, written as Python source over a namespace ``nn``.

A program is the text of a few ``nn.Module`` classes ending with ``Model``;
``build(src, nn)`` executes it against ``flax.linen`` or ``liftmods``, so the
two builds are the same program by construction, and a failing program can be
pasted into a regression test as it is printed.

Choices are made through a ``Chooser`` so the same generator serves
hypothesis (``HypothesisChooser``: derandomized in CI, shrinkable) and the
soak binary (``RandomChooser``: one ``random.Random`` seed per program).
Options are listed simplest first, so that shrinking moves towards them.

Every module maps ``x`` of shape ``(..., 4)`` to the same shape; the root
input is ``(2, 3, 4)`` and ``vmap``/``scan`` each take one leading axis off,
so the generator tracks the rank and only places rank-hungry layers (Conv,
attention, RNN cells, positional Embed) where a sequence axis is left.
"""
import dataclasses
import random

import jax
import jax.numpy as jnp

F = 4  # the feature size of every activation
MAX_LOOPS = 1  # scan/remat_scan/while_loop nesting: deeper nests compile
               # for minutes in XLA, which the comparison does not need
INPUT_SHAPE = (2, 3, F)

# Generator features, all on by default. A feature that another branch is
# still changing (or that hits a known mismatch) can be turned off here and
# switched back on by the lead after the merge.
FEATURES = {
    'dense': True, 'dense_general': True, 'conv': True, 'embed': True,
    'layer_norm': True, 'rms_norm': True, 'group_norm': True,
    'batch_norm': True, 'dropout': True, 'attention': True, 'rnn_cell': True,
    'activation': True, 'param': True, 'sow': True, 'perturb': True,
    'variable': True, 'submodule': True, 'vmap': True, 'scan': True,
    'remat': True, 'remat_scan': True, 'jit': True, 'cond': True,
    'switch': True, 'while_loop': True, 'map_variables': True,
    # Writes to a collection without asking is_mutable_collection first:
    # makes programs that Linen rejects, to compare error classes.
    'unguarded_write': True,
}

_COLLECTIONS = ('params', 'batch_stats', 'intermediates', 'perturbations',
                'state')


class Chooser:
  """The random decisions a generator makes; subclasses supply them."""

  def integer(self, lo: int, hi: int) -> int:
    raise NotImplementedError

  def choice(self, options):
    options = list(options)
    return options[self.integer(0, len(options) - 1)]

  def boolean(self, p_true: float = 0.5) -> bool:
    return self.integer(0, 99) < int(p_true * 100)

  def weighted(self, pairs):
    """``pairs`` is ``[(option, weight), ...]`` with integer weights."""
    pairs = [(o, w) for o, w in pairs if w > 0]
    pick = self.integer(0, sum(w for _, w in pairs) - 1)
    for option, weight in pairs:
      if pick < weight:
        return option
      pick -= weight
    raise AssertionError('unreachable')


class RandomChooser(Chooser):

  def __init__(self, seed: int):
    self._rng = random.Random(seed)

  def integer(self, lo, hi):
    return self._rng.randint(lo, hi)


class HypothesisChooser(Chooser):

  def __init__(self, data):
    from hypothesis import strategies as st  # test-only dependency
    self._data, self._st = data, st

  def integer(self, lo, hi):
    return self._data.draw(self._st.integers(lo, hi))


@dataclasses.dataclass
class Info:
  """What a generated class (and everything under it) may touch."""
  name: str
  cols: set
  rngs: set


@dataclasses.dataclass
class Op:
  """One step of a module body.

  ``make`` builds a submodule (``None`` for ops without one); in setup style
  it is assigned to ``self.<attr>`` in ``setup``, in compact style to a local
  right before use. ``call`` lines use ``{m}`` for that submodule and
  ``{self}`` for the module. ``setup`` lines (setup style only) declare
  variables in ``setup``.
  """
  call: list
  make: str = None
  setup: list = dataclasses.field(default_factory=list)
  cols: set = dataclasses.field(default_factory=set)
  rngs: set = dataclasses.field(default_factory=set)


class Generator:
  """Writes one random program; ``program()`` returns its source."""

  def __init__(self, chooser: Chooser, features=None, max_depth: int = 4):
    self.c = chooser
    self.features = dict(FEATURES, **(features or {}))
    self.max_depth = max_depth
    self.classes = []
    self._count = 0
    self._loops = 0  # loop transforms around the node being written

  def _on(self, feature):
    return self.features.get(feature, False)

  def _fresh(self, prefix):
    self._count += 1
    return f'{prefix}{self._count}'

  # -- the program ------------------------------------------------------------

  def program(self) -> str:
    depth = self.c.weighted([(d, w) for d, w in ((1, 3), (2, 4), (3, 3), (4, 2))
                             if d <= self.max_depth])
    self.node(depth, len(INPUT_SHAPE), pure=False, name='Model')
    return '\n\n'.join(self.classes) + '\n'

  def node(self, depth, rank, pure, name=None) -> Info:
    """Emits one module class whose subtree is ``depth`` levels deep."""
    name = name or self._fresh('Node')
    style = self.c.choice(['compact', 'setup'])
    n_ops = self.c.integer(1, 3)
    ops = [self.op(depth, rank, pure, style) for _ in range(n_ops)]
    if depth > 1 and not any(op.make for op in ops):
      ops.append(self.child_op(depth, rank, pure, style))
    info = Info(name, set(), set())
    for op in ops:
      info.cols |= op.cols
      info.rngs |= op.rngs
    self.classes.append(self._class_source(name, style, ops))
    return info

  def _class_source(self, name, style, ops):
    lines = [f'class {name}(nn.Module):', '  train: bool = False', '']
    body, setup = [], []
    for i, op in enumerate(ops):
      if op.make is None:
        ref = None
      elif style == 'setup':
        ref = f'self.m{i}'
        setup.append(f'{ref} = {op.make}')
      else:
        ref = f'm{i}'
        body.append(f'{ref} = {op.make}')
      setup.extend(op.setup)
      body.extend(line.format(m=ref, m_attr=f'm{i}') for line in op.call)
    if style == 'setup':
      lines += ['  def setup(self):'] + [f'    {s}' for s in setup or ['pass']]
      lines += ['', '  def __call__(self, x):']
    else:
      lines += ['  @nn.compact', '  def __call__(self, x):']
    lines += [f'    {b}' for b in body] + ['    return x']
    return '\n'.join(lines)

  # -- ops --------------------------------------------------------------------

  def op(self, depth, rank, pure, style) -> Op:
    kinds = [('activation', 2), ('dense', 4), ('dense_general', 1),
             ('layer_norm', 2), ('rms_norm', 1), ('param', 1),
             ('embed_attend', 1)]
    if rank >= 2:
      kinds += [('conv', 2), ('embed', 1), ('group_norm', 1),
                ('attention', 1), ('rnn_cell', 2)]
    if not pure:
      kinds += [('batch_norm', 2), ('dropout', 2), ('sow', 2),
                ('variable', 2)]
      if style == 'compact':
        kinds += [('perturb', 1)]
    if depth > 1:
      kinds += [('child', 8)]
    feature = {'embed_attend': 'embed'}
    kinds = [(k, w) for k, w in kinds
             if k == 'child' or self._on(feature.get(k, k))]
    kind = self.c.weighted(kinds)
    if kind == 'child':
      return self.child_op(depth, rank, pure, style)
    return getattr(self, f'_op_{kind}')(rank, style)

  def _op_activation(self, rank, style):
    fn = self.c.choice(['relu', 'tanh', 'gelu', 'silu'])
    return Op([f'x = nn.{fn}(x)'])

  def _op_dense(self, rank, style):
    bias = self.c.choice(['', ', use_bias=False'])
    return Op(['x = {m}(x)'], f'nn.Dense({F}{bias})', cols={'params'},
              rngs={'params'})

  def _op_dense_general(self, rank, style):
    return Op(['x = {m}(x)'], f'nn.DenseGeneral({F}, axis=-1)',
              cols={'params'}, rngs={'params'})

  def _op_layer_norm(self, rank, style):
    return Op(['x = {m}(x)'], 'nn.LayerNorm()', cols={'params'},
              rngs={'params'})

  def _op_rms_norm(self, rank, style):
    return Op(['x = {m}(x)'], 'nn.RMSNorm()', cols={'params'},
              rngs={'params'})

  def _op_group_norm(self, rank, style):
    return Op(['x = {m}(x)'], 'nn.GroupNorm(num_groups=2)',
              cols={'params'}, rngs={'params'})

  def _op_conv(self, rank, style):
    pad = self.c.choice(["'SAME'", "'CAUSAL'"])
    return Op(['x = {m}(x)'], f'nn.Conv({F}, kernel_size=(2,), padding={pad})',
              cols={'params'}, rngs={'params'})

  def _op_embed(self, rank, style):
    return Op(['x = x + {m}(jnp.arange(x.shape[-2]) % 5)'],
              f'nn.Embed(5, {F})', cols={'params'}, rngs={'params'})

  def _op_embed_attend(self, rank, style):
    return Op(['x = {m}.attend(x)'], f'nn.Embed({F}, {F})', cols={'params'},
              rngs={'params'})

  def _op_attention(self, rank, style):
    drop = self.c.choice(['', ', dropout_rate=0.5, '
                          'deterministic=not self.train'])
    rngs = {'params', 'dropout'} if drop else {'params'}
    return Op(['x = {m}(x)'],
              f'nn.MultiHeadDotProductAttention(num_heads=2, '
              f'qkv_features={F}{drop})', cols={'params'}, rngs=rngs)

  def _op_rnn_cell(self, rank, style):
    cell = self.c.choice(['SimpleCell', 'GRUCell', 'LSTMCell', 'MGUCell',
                          'OptimizedLSTMCell'])
    if self.c.boolean():
      carry = ('carry = {m}.initialize_carry(jax.random.key(0), '
               'x[..., 0, :].shape)')
    elif 'LSTM' in cell:
      carry = 'carry = (jnp.zeros_like(x[..., 0, :]), ' \
              'jnp.zeros_like(x[..., 0, :]))'
    else:
      carry = 'carry = jnp.zeros_like(x[..., 0, :])'
    return Op([carry, 'ys = []', 'for t in range(x.shape[-2]):',
               '  carry, y = {m}(carry, x[..., t, :])', '  ys.append(y)',
               'x = jnp.stack(ys, axis=-2)'],
              f'nn.{cell}({F})', cols={'params'}, rngs={'params'})

  def _op_batch_norm(self, rank, style):
    return Op(['x = {m}(x)'],
              'nn.BatchNorm(use_running_average=not self.train, '
              'momentum=0.9)', cols={'params', 'batch_stats'},
              rngs={'params'})

  def _op_dropout(self, rank, style):
    rate = self.c.choice(['0.5', '0.0', '1.0'])
    return Op(['x = {m}(x)'],
              f'nn.Dropout({rate}, deterministic=not self.train)',
              rngs={'dropout'})

  def _op_param(self, rank, style):
    name = self._fresh('w')
    init = self.c.choice(['nn.initializers.normal(0.1)',
                          'nn.initializers.ones', 'nn.initializers.lecun_normal()'])
    shape = f'({F},)' if 'lecun' not in init else f'({F}, {F})'
    use = 'x = x * {w}' if 'lecun' not in init else 'x = x @ {w}'
    if style == 'setup':
      return Op([use.format(w=f'self.{name}')],
                setup=[f"self.{name} = self.param('{name}', {init}, {shape})"],
                cols={'params'}, rngs={'params'})
    return Op([f"{name} = self.param('{name}', {init}, {shape})",
               use.format(w=name)], cols={'params'}, rngs={'params'})

  def _op_sow(self, rank, style):
    name = self._fresh('h')
    lines = [f"self.sow('intermediates', '{name}', x)"]
    if self.c.boolean(0.3):
      lines.append(f"self.sow('intermediates', '{name}', 2 * x)")
    return Op(lines, cols={'intermediates'})

  def _op_perturb(self, rank, style):
    name = self._fresh('p')
    return Op([f"x = self.perturb('{name}', x)"], cols={'perturbations'})

  def _op_variable(self, rank, style):
    name = self._fresh('v')
    declare = (f"self.variable('state', '{name}', jnp.zeros, "
               f"({F},), jnp.float32)")
    update = ['{v}.value = {v}.value + jnp.mean(x.reshape(-1, x.shape[-1]), '
              'axis=0)']
    if not (self._on('unguarded_write') and self.c.boolean(0.2)):
      update = ["if self.is_mutable_collection('state'):"] + [
          '  ' + update[0]]
    if style == 'setup':
      ref = f'self.{name}'
      lines = []
      setup = [f'{ref} = {declare}']
    else:
      ref, lines, setup = name, [f'{name} = {declare}'], []
    lines += [u.format(v=ref) for u in update] + [f'x = x + {ref}.value']
    return Op(lines, setup=setup, cols={'state'})

  # -- children and lifted transforms -------------------------------------------

  def child_op(self, depth, rank, pure, style) -> Op:
    kinds = [('submodule', 6), ('remat', 2), ('jit', 2),
             ('map_variables', 2), ('remat_scan', 2), ('cond', 2),
             ('switch', 1), ('while_loop', 2)]
    if rank >= 2:
      kinds += [('vmap', 3), ('scan', 3)]
    loops = ('scan', 'remat_scan', 'while_loop')
    kinds = [(k, w) for k, w in kinds if self._on(k)
             and (k not in loops or self._loops < MAX_LOOPS)]
    if not kinds:
      return self._op_activation(rank, style)
    kind = self.c.weighted(kinds)
    self._loops += kind in loops
    try:
      return getattr(self, f'_child_{kind}')(depth, rank, pure, style)
    finally:
      self._loops -= kind in loops

  def _calls(self):
    """How often a submodule is called: the repeats share its variables."""
    return self.c.weighted([(1, 6), (2, 3), (3, 1)])

  def _named(self, args, style):
    if style == 'compact' and self.c.boolean(0.3):
      return f"{args}, name='{self._fresh('sub')}'"
    return args

  def _child_submodule(self, depth, rank, pure, style):
    info = self.node(depth - 1, rank, pure)
    make = f'{info.name}({self._named("train=self.train", style)})'
    return Op(['x = {m}(x)'] * self._calls(), make, cols=info.cols,
              rngs=info.rngs)

  def _child_remat(self, depth, rank, pure, style):
    info = self.node(depth - 1, rank, pure)
    cse = self.c.choice(['True', 'False'])
    make = (f'nn.remat({info.name}, prevent_cse={cse})'
            f'({self._named("train=self.train", style)})')
    return Op(['x = {m}(x)'] * self._calls(), make, cols=info.cols,
              rngs=info.rngs)

  def _child_jit(self, depth, rank, pure, style):
    info = self.node(depth - 1, rank, pure)
    make = f'nn.jit({info.name})({self._named("train=self.train", style)})'
    return Op(['x = {m}(x)'] * self._calls(), make, cols=info.cols,
              rngs=info.rngs)

  def _child_map_variables(self, depth, rank, pure, style):
    info = self.node(depth - 1, rank, pure)
    scale = self.c.choice(['2.0', '0.5'])
    trans_in = f'lambda v: jax.tree_util.tree_map(lambda a: a * {scale}, v)'
    trans_out = f'lambda v: jax.tree_util.tree_map(lambda a: a / {scale}, v)'
    make = (f"nn.map_variables({info.name}, 'params', {trans_in}, "
            f'{trans_out}, init=True, mutable=True)'
            f'({self._named("train=self.train", style)})')
    return Op(['x = {m}(x)'] * self._calls(), make, cols=info.cols,
              rngs=info.rngs)

  def _child_remat_scan(self, depth, rank, pure, style):
    info = self.node(depth - 1, rank, pure)
    lengths = self.c.choice(['(2,)', '(1, 2)', '(2, 2)'])
    make = (f'nn.remat_scan({info.name}, lengths={lengths})'
            f'({self._named("train=self.train", style)})')
    return Op(['x = {m}(x)'], make, cols=info.cols, rngs=info.rngs)

  def _axes(self, cols, allow_carry):
    """Random variable_axes / broadcast / carry split of ``cols``."""
    axes, broadcast, carry = {}, [], []
    for col in sorted(cols):
      opts = [(0, 6), ('broadcast', 3), ('omit', 1)]
      if allow_carry and col == 'state':
        opts.append(('carry', 4))
      if col == 'params' and not allow_carry:
        opts = [(0, 6), (None, 5), ('omit', 1)]
      elif not allow_carry:
        opts = [(0, 8), (None, 2), ('omit', 1)]
      pick = self.c.weighted(opts)
      if pick == 'broadcast':
        broadcast.append(col)
      elif pick == 'carry':
        carry.append(col)
      elif pick != 'omit':
        axes[col] = pick
    return axes, broadcast, carry

  def _split(self, rngs):
    return {r: self.c.boolean(0.6) for r in sorted(rngs)}

  def _child_vmap(self, depth, rank, pure, style):
    info = self.node(depth - 1, rank - 1, pure)
    axes, _, _ = self._axes(info.cols, allow_carry=False)
    split = self._split(info.rngs)
    make = (f'nn.vmap({info.name}, variable_axes={axes!r}, '
            f'split_rngs={split!r}, in_axes=0, out_axes=0)'
            f'({self._named("train=self.train", style)})')
    return Op(['x = {m}(x)'] * self._calls(), make, cols=info.cols,
              rngs=info.rngs)

  def _child_scan(self, depth, rank, pure, style):
    info = self.node(depth - 1, rank - 1, pure)
    axes, broadcast, carry = self._axes(info.cols, allow_carry=True)
    split = self._split(info.rngs)
    reverse = self.c.choice(['False', 'True'])
    unroll = self.c.choice(['1', '1', '2'])
    cell = self._fresh('Cell')
    self.classes.append('\n'.join([
        f'class {cell}(nn.Module):', '  train: bool = False', '',
        '  @nn.compact', '  def __call__(self, c, xt):',
        f'    h = {info.name}(train=self.train)(c + xt)',
        '    return h, 2 * h']))
    bc = broadcast[0] if len(broadcast) == 1 else (broadcast or False)
    cc = carry[0] if len(carry) == 1 else (carry or False)
    make = (f'nn.scan({cell}, variable_axes={axes!r}, '
            f'variable_broadcast={bc!r}, variable_carry={cc!r}, '
            f'split_rngs={split!r}, reverse={reverse}, unroll={unroll})'
            f'({self._named("train=self.train", style)})')
    return Op(['c, ys = {m}(jnp.zeros_like(x[0]), x)', 'x = ys + c'], make,
              cols=info.cols, rngs=info.rngs)

  def _branch_child(self, depth, rank, style):
    pure = not self.c.boolean(0.2)
    return self.node(depth - 1, rank, pure)

  def _child_cond(self, depth, rank, pure, style):
    info = self._branch_child(depth, rank, style)
    fn = self._fresh('branch')
    if style == 'setup':
      lines = [f'def {fn}_t(mdl, x):', '  return mdl.{m_attr}(x)',
               f'def {fn}_f(mdl, x):', '  return -mdl.{m_attr}(x)']
    else:
      sub = self._fresh('cond')
      mk = f"{info.name}(train=mdl.train, name='{sub}')"
      lines = [f'def {fn}_t(mdl, x):', f'  return {mk}(x)',
               f'def {fn}_f(mdl, x):', f'  return -{mk}(x)']
    lines.append(f'x = nn.cond(x.sum() > 0, {fn}_t, {fn}_f, self, x)')
    return self._branch_op(lines, info, style)

  def _branch_op(self, lines, info, style):
    if style == 'setup':
      # The submodule lives in setup; branches reach it through ``mdl``.
      return Op(lines, f'{info.name}(train=self.train)', cols=info.cols,
                rngs=info.rngs)
    return Op(lines, cols=info.cols, rngs=info.rngs)

  def _child_switch(self, depth, rank, pure, style):
    info = self._branch_child(depth, rank, style)
    fn = self._fresh('branch')
    posts = ['{}', '-{}', 'jnp.tanh({})']
    lines = []
    for i, post in enumerate(posts):
      if style == 'setup':
        call = 'mdl.{m_attr}(x)'
      else:
        call = f"{info.name}(train=mdl.train, name='{fn}_sub')(x)"
      lines += [f'def {fn}_{i}(mdl, x):', f'  return {post.format(call)}']
    names = ', '.join(f'{fn}_{i}' for i in range(len(posts)))
    lines.append(f'x = nn.switch(jnp.argmax(x.reshape(-1)[:3]), [{names}], '
                 'self, x)')
    return self._branch_op(lines, info, style)

  def _child_while_loop(self, depth, rank, pure, style):
    info = self._branch_child(depth, rank, style)
    fn = self._fresh('loop')
    if style == 'setup':
      call = 'mdl.{m_attr}(c[1])'
    else:
      call = f"{info.name}(train=mdl.train, name='{fn}_sub')(c[1])"
    writes = sorted(info.cols - {'params'})
    carry = writes[0] if len(writes) == 1 else (writes or False)
    lines = [f'def {fn}_body(mdl, c):', f'  return c[0] + 1, {call}',
             "if self.is_mutable_collection('params'):",
             f'  x = {fn}_body(self, (0, x))[1]', 'else:',
             f'  x = nn.while_loop(lambda mdl, c: c[0] < 2, {fn}_body, self, '
             f'(jnp.array(0), x), carry_variables={carry!r})[1]']
    return self._branch_op(lines, info, style)


def generate(chooser: Chooser, features=None, max_depth: int = 4) -> str:
  """The source of one random program (classes ending with ``Model``)."""
  return Generator(chooser, features, max_depth).program()


def build(src: str, nn):
  """Executes ``src`` with ``nn`` bound to a Linen-style namespace; returns
  its ``Model`` class."""
  namespace = {'nn': nn, 'jax': jax, 'jnp': jnp}
  exec(compile(src, '<fuzz program>', 'exec'), namespace)  # pylint: disable=exec-used
  return namespace['Model']
