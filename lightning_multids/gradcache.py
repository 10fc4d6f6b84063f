"""Deprecated alias of :mod:`lightning_multids.utilities.gradcache` (GradCache is a utility beside the strategy)."""

from lightning_multids._deprecation import moved_module

__getattr__ = moved_module(__name__, "lightning_multids.utilities.gradcache")
