"""Keeps liftmods' own frames out of the tracebacks a user reads.

Importing ``liftmods`` registers the package's directory with JAX's
traceback filtering, the mechanism JAX uses to hide its own internals. An
exception raised below an :func:`api_boundary` (``init``, ``apply``, the
lifted transforms, ``nn.Stack``, ``nn.init_sharded``) then reaches the user
with every frame inside liftmods (and inside JAX) removed, so the last frame
shown is the user's own line. ``JAX_TRACEBACK_FILTERING=off`` shows every
frame again.

>>> import jax, jax.numpy as jnp, liftmods as nn, traceback
>>> class Net(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2)(x, 'extra argument')
>>> try:
...   Net().init(jax.random.key(0), jnp.ones((1, 3)))
... except TypeError as err:
...   files = [f.filename for f in traceback.extract_tb(err.__traceback__)]
>>> any(f.startswith(PACKAGE_DIR) for f in files)
False
"""
import os

from liftmods import jax_private

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# A decorator: the outermost wrapped call on the stack filters the
# traceback of any exception passing through it.
api_boundary = jax_private.api_boundary

jax_private.register_exclusion(PACKAGE_DIR)
