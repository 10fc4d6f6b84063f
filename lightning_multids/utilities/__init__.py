"""Utilities beside the strategy: GradCache, a gradient-reduction counter, a run summary, progress as lines.

None is needed to train with :class:`~lightning_multids.MultiDeepSpeedStrategy`; the strategy does not
import them.
"""

from lightning_multids.utilities.gradcache import gather_with_grad, grad_cache, info_nce
from lightning_multids.utilities.progress import LineProgress
from lightning_multids.utilities.reductions import ReductionCounter
from lightning_multids.utilities.summary import RunSummary

__all__ = ["LineProgress", "ReductionCounter", "RunSummary", "gather_with_grad", "grad_cache", "info_nce"]
