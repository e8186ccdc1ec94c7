"""Multi-device cases on 8 simulated CPU devices, differential against
flax.linen. Not collected by the main run (the name does not start with
``test_``): ``test_spmd_mesh.py`` runs this file with pytest in a fresh
process, because the device count is fixed when JAX starts and the rest of
the suite shares its worker processes with one device.

Run by hand: ``python -m pytest tests/spmd/spmd_mesh_cases.py``.
"""
import multidevice

multidevice.simulate(8)

import flax  # pylint: disable=g-import-not-at-top
import flax.linen as fnn
import flax.linen.partitioning as fpart
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import liftmods as nn
from benchmarks import spmd_model
from liftmods import errors
from program_compare import assert_match, optimized_hlo

multidevice.require(8)

KEY = jax.random.key(0)
TOKENS = (jnp.arange(32, dtype=jnp.int32).reshape(8, 4) * 7) % 32
RULE_SETS = [
    spmd_model.RULES,
    (('batch', 'data'), ('embed', 'tensor'), ('mlp', 'fsdp'),
     ('heads', 'fsdp'), ('vocab', ('fsdp', 'tensor'))),
    (('batch', 'data'), ('mlp', ('fsdp', 'tensor')), ('embed', 'fsdp'),
     ('embed', 'tensor'), ('heads', 'tensor'), ('vocab', 'tensor'),
     ('layers', 'data')),
]


def make_mesh():
  return jax.make_mesh((2, 2, 2), ('data', 'fsdp', 'tensor'),
                       axis_types=(AxisType.Auto,) * 3)


def plain(tree):
  """Nested plain dicts (either library's FrozenDict unfrozen)."""
  if hasattr(tree, 'items'):
    return {k: plain(v) for k, v in tree.items()}
  return tree


# -- annotations: partition specs, shardings, params_axes ---------------------


@pytest.mark.parametrize('rules', RULE_SETS, ids=['r0', 'r1', 'r2'])
def test_decoder_specs_and_shardings_match_linen(rules):
  mesh = make_mesh()
  ours = jax.eval_shape(spmd_model.decoder(nn).init, KEY, TOKENS)
  theirs = jax.eval_shape(spmd_model.decoder(fnn).init, KEY, TOKENS)
  specs = nn.get_partition_spec(ours)
  assert plain(specs) == plain(fnn.get_partition_spec(theirs))
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  assert plain(shardings) == plain(fnn.logical_to_mesh_sharding(
      fnn.get_partition_spec(theirs), mesh, rules))
  # init_sharded hands out the same shardings as Linen's recipe (the
  # compiled init itself is tested below).
  got = nn.sharded_init.mesh_shardings(ours, mesh, rules)
  assert plain(got) == plain(shardings)


@pytest.mark.parametrize('rules', RULE_SETS, ids=['r0', 'r1', 'r2'])
def test_t5x_params_axes_and_shardings_match_linen(rules):
  mesh = make_mesh()
  ours = jax.eval_shape(spmd_model.t5x_decoder(nn, nn.partitioning).init, KEY,
                        TOKENS)
  theirs = jax.eval_shape(spmd_model.t5x_decoder(fnn, fpart).init, KEY,
                          TOKENS)
  axes = nn.partitioning.get_axis_names(ours['params_axes'])
  assert plain(axes) == plain(fpart.get_axis_names(theirs['params_axes']))
  assert axes['layers']['wi']['kernel'] == P('layers', 'embed', 'mlp')
  with nn.partitioning.axis_rules(rules), fpart.axis_rules(rules):
    assert (plain(nn.logical_to_mesh_sharding(axes, mesh)) ==
            plain(fnn.logical_to_mesh_sharding(
                fpart.get_axis_names(theirs['params_axes']), mesh)))


# -- sharded init ----------------------------------------------------------------


@pytest.mark.parametrize('logical', [True, False], ids=['logical', 'mesh'])
def test_init_sharded_places_and_equals_unsharded_init(logical):
  mesh = make_mesh()
  model = spmd_model.decoder(nn, logical=logical)
  init = nn.init_sharded(model, mesh, spmd_model.RULES)
  variables, shardings = init(KEY, TOKENS)
  for x, s in zip(jax.tree.leaves(variables), jax.tree.leaves(shardings)):
    assert x.sharding == s
  kernel = variables['params']['layers']['mlp']['wi']['kernel']
  assert kernel.sharding.spec == P(None, 'fsdp', 'tensor')
  assert kernel.addressable_shards[0].data.shape == (4, 8, 16)
  # The unsharded init is another program (whole arrays, not shards): the
  # same random bits, the initializers' float32 arithmetic to a few ulps,
  # bitwise only where the two compile to the same per-device program.
  unsharded = jax.jit(model.init)
  sharded_hlo = optimized_hlo(init, KEY, TOKENS)
  assert_match(variables, nn.unbox(unsharded(KEY, TOKENS)),
               [(sharded_hlo, optimized_hlo(unsharded, KEY, TOKENS))],
               rtol=1e-6, atol=1e-7)
  # Linen's own recipe (its init, jitted onto the same shardings) gives the
  # same placement, and the same values: bit for bit where it compiles to
  # the same program as ours.
  flax_model = spmd_model.decoder(fnn, logical=logical)
  abstract = jax.eval_shape(flax_model.init, KEY, TOKENS)
  specs = fnn.get_partition_spec(abstract)
  linen_sh = (fnn.logical_to_mesh_sharding(specs, mesh, spmd_model.RULES)
              if logical else fnn.get_sharding(abstract, mesh))
  linen_init = jax.jit(flax_model.init, out_shardings=linen_sh)
  linen = linen_init(KEY, TOKENS)
  assert plain(shardings) == plain(jax.tree.map(
      lambda x: x.sharding, fnn.unbox(linen)))
  assert_match(variables, fnn.unbox(linen),
               [(sharded_hlo, optimized_hlo(linen_init, KEY, TOKENS))],
               rtol=1e-6, atol=1e-7)


def test_init_sharded_keeps_boxes_on_request():
  mesh = make_mesh()
  model = spmd_model.decoder(nn)
  boxed, shardings = nn.init_sharded(model, mesh, spmd_model.RULES,
                                     unbox=False)(KEY, TOKENS)
  box = boxed['params']['embed']['embedding']
  assert isinstance(box, nn.LogicallyPartitioned)
  assert box.value.sharding == shardings['params']['embed']['embedding']


# -- a sharded AdamW train step equals the one-device step ----------------------


def train_step(model, tx):

  def step(params, opt_state, tokens):

    def loss_fn(p):
      logits = model.apply({'params': p}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def opt_shardings(tx, params, param_shardings, mesh):
  """The optimizer state's shardings: moments like their parameters, the
  rest (step counts) replicated."""
  return optax.tree_map_params(
      tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
      transform_non_params=lambda _: NamedSharding(mesh, P()))


@pytest.mark.parametrize('logical', [True, False], ids=['logical', 'mesh'])
def test_sharded_adamw_step_matches_one_device(logical):
  mesh = make_mesh()
  model = spmd_model.decoder(nn, logical=logical)
  tx = optax.adamw(1e-2)
  variables, shardings = nn.init_sharded(model, mesh, spmd_model.RULES)(
      KEY, TOKENS)
  params, p_sh = variables['params'], shardings['params']
  o_sh = opt_shardings(tx, params, p_sh, mesh)
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  batch = jax.device_put(TOKENS, NamedSharding(mesh, P(('data', 'fsdp'))))
  with jax.set_mesh(mesh), nn.logical_axis_rules(spmd_model.RULES):
    step = jax.jit(train_step(model, tx), in_shardings=(p_sh, o_sh,
                                                        batch.sharding),
                   out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())))
    new_params, _, loss = step(params, opt_state, batch)
  for x, s in zip(jax.tree.leaves(new_params), jax.tree.leaves(p_sh)):
    assert x.sharding == s

  device = jax.devices()[0]
  params1 = jax.device_put(nn.unbox(model.init(KEY, TOKENS))['params'], device)
  ref_params, _, ref_loss = jax.jit(train_step(model, tx))(
      params1, tx.init(params1), jax.device_put(TOKENS, device))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-5),
               plain(new_params), plain(ref_params))


# -- errors ----------------------------------------------------------------------


def small(lib, names, features=8):

  class Model(lib.Module):

    @lib.compact
    def __call__(self, x):
      return lib.Dense(features, kernel_init=lib.with_logical_partitioning(
          lib.initializers.lecun_normal(), names), name='proj')(x)

  class Outer(lib.Module):

    @lib.compact
    def __call__(self, x):
      return Model(name='block')(x)

  return Outer()


def test_unmapped_logical_name_is_replicated_like_linen():
  mesh = make_mesh()
  rules = (('embed', 'fsdp'),)  # no rule for 'unmapped'
  x = jnp.ones((2, 4))
  _, ours = nn.init_sharded(small(nn, ('embed', 'unmapped')), mesh, rules)(
      KEY, x)
  theirs = fnn.logical_to_mesh_sharding(fnn.get_partition_spec(
      jax.eval_shape(small(fnn, ('embed', 'unmapped')).init, KEY, x)), mesh,
                                        rules)
  assert ours['params']['block']['proj']['kernel'].spec == P('fsdp', None)
  assert plain(ours) == plain(theirs)
  with pytest.raises(errors.LogicalAxisUnmappedError,
                     match=r'"kernel" of collection "params" at /block/proj'):
    nn.init_sharded(small(nn, ('embed', 'unmapped')), mesh, rules,
                    fallback=nn.spmd.RulesFallback.RAISE_ERROR)(KEY, x)


def test_mesh_axis_missing_names_the_variable():
  mesh = make_mesh()
  x = jnp.ones((2, 4))
  rules = (('embed', 'fsdp'), ('mlp', 'expert'))
  with pytest.raises(errors.MeshAxisNotFoundError,
                     match=r"at /block/proj: .*'expert'.*\('data', 'fsdp', "
                     r"'tensor'\)"):
    nn.init_sharded(small(nn, ('embed', 'mlp')), mesh, rules)(KEY, x)
  # Linen's recipe fails too, in JAX, without saying which parameter.
  model = small(fnn, ('embed', 'mlp'))
  with pytest.raises(ValueError):
    shardings = fnn.logical_to_mesh_sharding(fnn.get_partition_spec(
        jax.eval_shape(model.init, KEY, x)), mesh, rules)
    jax.jit(model.init, out_shardings=shardings)(KEY, x)


def test_non_divisible_dimension_names_the_variable():
  mesh = make_mesh()
  x = jnp.ones((2, 4))
  rules = (('mlp', ('fsdp', 'tensor')),)  # 6 features over 4 devices
  with pytest.raises(errors.ShardingDivisibilityError,
                     match=r'at /block/proj: dimension 1 of shape \(4, 6\)'):
    nn.init_sharded(small(nn, (None, 'mlp'), 6), mesh, rules)(KEY, x)
  model = small(fnn, (None, 'mlp'), 6)
  with pytest.raises(ValueError):
    shardings = fnn.logical_to_mesh_sharding(fnn.get_partition_spec(
        jax.eval_shape(model.init, KEY, x)), mesh, rules)
    jax.jit(model.init, out_shardings=shardings)(KEY, x)


# -- tabulate --------------------------------------------------------------------


def test_tabulate_shows_specs_and_per_device_bytes():
  mesh = make_mesh()
  with jax.set_mesh(mesh), nn.logical_axis_rules(spmd_model.RULES):
    table = spmd_model.decoder(nn).tabulate(KEY, TOKENS, depth=1)
  # embedding 32x16 float32 = 2048 B over tensor x fsdp = 4 devices.
  assert "P('vocab', 'embed') -> P('tensor', 'fsdp') 512 B/device" in table
  assert 'per device)' in table


def test_init_sharded_never_holds_a_whole_parameter():
  mesh = make_mesh()
  cfg = spmd_model.Config(vocab=256, embed=64, heads=4, head_dim=16, mlp=256)
  model = spmd_model.decoder(nn, cfg)
  lowered, _ = nn.init_sharded(model, mesh, spmd_model.RULES).lower(KEY,
                                                                    TOKENS)
  memory = lowered.compile().memory_analysis()
  full = jax.eval_shape(model.init, KEY, TOKENS)
  largest = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(full))
  # Every parameter is sharded 4 ways here: the device's whole output is
  # about 1/4 of the model, and the scratch space stays below one full-size
  # copy of the largest parameter.
  assert memory.temp_size_in_bytes < largest, (memory, largest)
