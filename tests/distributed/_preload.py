"""What the fork server imports once, so that the ranks it forks start with it (``harness.run_ranks``).

Only modules whose import reads nothing a rank sets differently: torch, Lightning, DeepSpeed and this package,
and pytest (the ranks' ``multiprocessing`` start-up imports the caller's ``__main__``, which is pytest's). What
Lightning reads from the environment at import (the rank for ``rank_zero_only``) each rank reads again
(``harness._rank``). No test module is imported here: those read their rank's environment at import.

Besides those, what building an engine imports on first use, about 650 modules and 2 s of a core per rank:
DeepSpeed's check of the optimizer imports its Muon optimizer, which calls ``torch.compile`` at import and so
imports torch's inductor; the engine imports its expert-parallel modules and op builders (and with them
setuptools). Importing them starts no thread.
"""

from __future__ import annotations

import deepspeed.module_inject.auto_ep  # noqa: F401
import deepspeed.module_inject.auto_ep_comm  # noqa: F401
import deepspeed.module_inject.auto_ep_layer  # noqa: F401
import deepspeed.ops.op_builder.all_ops  # noqa: F401
import deepspeed.runtime.superoffload.superoffload_stage3  # noqa: F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
import deepspeed.utils.pin_memory  # noqa: F401
import lightning.pytorch  # noqa: F401
import pytest  # noqa: F401
import torch  # noqa: F401
import torch.utils.cpp_extension  # noqa: F401

import lightning_multids  # noqa: F401
