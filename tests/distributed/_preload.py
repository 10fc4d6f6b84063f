"""What the fork server imports once, so that the ranks it forks start with it (``harness.run_ranks``).

Only modules whose import reads nothing a rank sets differently: torch, Lightning, DeepSpeed and this package,
and pytest (the ranks' ``multiprocessing`` start-up imports the caller's ``__main__``, which is pytest's). What
Lightning reads from the environment at import (the rank for ``rank_zero_only``) each rank reads again
(``harness._rank``). No test module is imported here: those read their rank's environment at import.
"""

from __future__ import annotations

import lightning.pytorch  # noqa: F401
import pytest  # noqa: F401
import torch  # noqa: F401

import lightning_multids  # noqa: F401
