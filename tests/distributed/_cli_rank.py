"""One rank of the ``lightning-multids`` command, forked by the harness: ``_cli_rank.py WORKDIR ARGS...``.

Runs the command's entry point in WORKDIR as the console script would (``sys.argv`` is the command line), on a
rank the harness started, so Lightning's launcher starts nothing. The process then ends as every runner does
(:func:`tests.distributed.common.finish`).
"""

from __future__ import annotations

import os
import sys

from lightning_multids.cli import main
from tests.distributed.common import finish

if __name__ == "__main__":
    os.chdir(sys.argv[1])
    sys.argv = ["lightning-multids", *sys.argv[2:]]
    main()
    finish()
