"""Deprecated alias: ``ReductionCounter`` lives in :mod:`lightning_multids.utilities.reductions`."""

from lightning_multids._deprecation import moved_module

__getattr__ = moved_module(__name__, "lightning_multids.utilities.reductions")
