"""A byte-level Transformer language model trained on the Python standard
library's source with liftmods, optax, orbax-checkpoint and tqdm.

  make demo            # or: python -m examples.lm --steps=600
"""
