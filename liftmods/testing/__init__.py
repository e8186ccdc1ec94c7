"""Helpers for testing liftmods programs (standard library only; not
imported by ``import liftmods``)."""
