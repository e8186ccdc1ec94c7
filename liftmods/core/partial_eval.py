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

from liftmods import errors, jax_private


def lazy_init(fn):
  """``fn`` evaluated only as far as its known (non-ShapeDtypeStruct)
  inputs allow; see the module docstring."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))

    def flat_fn(*flat):
      a, k = jax.tree_util.tree_unflatten(in_tree, flat)
      return fn(*a, **k)

    known, out_tree = jax_private.known_outputs(flat_fn, leaves, 'lazy_init')
    for value in known:
      if isinstance(value, jax_private.Unknown):
        raise errors.LazyInitError(value.aval)
    return jax.tree_util.tree_unflatten(out_tree, known)

  return wrapper
