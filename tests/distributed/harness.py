"""Run a script on 2 CPU ranks over gloo, as Lightning's cluster environment expects, with a timeout.

Each rank is its own process with ``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE`` and a free loopback
port, so Lightning does not re-launch anything; a rank that hangs or fails fails the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    script: Path, *args: str, world_size: int = 2, timeout: float = 300.0, env: dict[str, str] | None = None
) -> list[str]:
    """Run ``script args`` once per rank (with extra ``env``); return each rank's output, or fail with it."""
    port = str(free_port())
    extra_env = env or {}
    procs = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE=str(world_size),
            NODE_RANK="0",
            LOCAL_RANK=str(rank),
            PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
            OMP_NUM_THREADS="1",
        )
        env.update(extra_env)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=REPO,
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise AssertionError(f"{script.name} {' '.join(args)}: a rank did not finish within {timeout} s") from None
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        if proc.returncode != 0:
            raise AssertionError(f"rank {rank} of {script.name} exited with {proc.returncode}:\n{out[-6000:]}")
    return outputs
