"""Benchmarks: absl binaries comparing liftmods, flax.linen and hand-written JAX."""
