"""Partial evaluation of functions whose inputs are partly abstract.

``lazy_init(fn)`` runs ``fn`` with every ``jax.ShapeDtypeStruct`` input left
unknown: computations that only need known inputs (parameter initializers,
which see shapes and rng keys) are executed, the rest is only staged and
never run. Outputs must all be known; one that depends on an abstract input
raises ``LazyInitError``.

>>> import jax, jax.numpy as jnp
>>> def f(key, x):
...   return {'w': jax.random.normal(key, (x.shape[-1], 2))}
>>> out = lazy_init(f)(jax.random.key(0), jax.ShapeDtypeStruct((8, 3), jnp.float32))
>>> out['w'].shape
(3, 2)
"""
import functools

import jax
from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe

from liftmods import errors


def _partial_value(x) -> pe.PartialVal:
  if isinstance(x, jax.ShapeDtypeStruct):
    return pe.PartialVal.unknown(jax.core.ShapedArray(x.shape, x.dtype))
  return pe.PartialVal.known(x)


def lazy_init(fn):
  """``fn`` evaluated only as far as its known (non-ShapeDtypeStruct)
  inputs allow; see the module docstring."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    out_trees = []

    def flat_fn(*flat):
      a, k = jax.tree_util.tree_unflatten(in_tree, flat)
      out_flat, out_tree = jax.tree_util.tree_flatten(fn(*a, **k))
      out_trees.append(out_tree)
      return out_flat

    debug = jax.api_util.debug_info('lazy_init', fn, args, kwargs)
    _, out_pvals, _ = pe.trace_to_jaxpr_nounits(
        lu.wrap_init(flat_fn, debug_info=debug),
        [_partial_value(x) for x in leaves])
    out = []
    for pval in out_pvals:
      if not pval.is_known():
        raise errors.LazyInitError(pval.get_aval())
      out.append(pval.get_known())
    return jax.tree_util.tree_unflatten(out_trees[-1], out)

  return wrapper
