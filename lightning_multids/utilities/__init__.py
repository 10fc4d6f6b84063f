"""Utilities beside the strategy: GradCache for contrastive training, and a gradient-reduction counter.

Neither is needed to train with :class:`~lightning_multids.MultiDeepSpeedStrategy`; the strategy does not
import them.
"""

from lightning_multids.utilities.gradcache import gather_with_grad, grad_cache, info_nce
from lightning_multids.utilities.reductions import ReductionCounter

__all__ = ["ReductionCounter", "gather_with_grad", "grad_cache", "info_nce"]
