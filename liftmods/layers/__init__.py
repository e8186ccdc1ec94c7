"""Layers: the Linen layer classes (linear, convolution, embedding, ...)."""
