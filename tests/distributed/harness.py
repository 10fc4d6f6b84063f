"""Run code on 2 CPU ranks over gloo, as Lightning's cluster environment expects, with a timeout.

Each rank is its own process with ``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE`` and a free loopback
port, so Lightning does not re-launch anything; a rank that hangs or fails fails the test.

:func:`on_ranks` runs a function of the test module itself on every rank and returns each rank's result, so a
test keeps its rank code beside its assertions; :func:`run_ranks` runs a script (the fuzzer's; on_ranks runs
its own with it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    script: Path,
    *args: str,
    world_size: int = 2,
    timeout: float = 300.0,
    env: dict[str, str | None] | None = None,
    nodes: int = 1,
) -> list[str]:
    """Run ``script args`` once per rank (with extra ``env``, where ``None`` unsets); return each rank's output.

    Fails with the ranks' output if one fails or ``timeout`` passes.

    With ``nodes=2`` each process is its own node (``NODE_RANK`` 0 and 1, ``LOCAL_RANK`` 0), as two
    machines would be launched, over loopback.
    """
    port = str(free_port())
    extra_env = env or {}
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE=str(world_size),
            NODE_RANK=str(rank if nodes > 1 else 0),
            LOCAL_RANK=str(0 if nodes > 1 else rank),
            TEST_RANK=str(rank),
            TEST_NUM_NODES=str(nodes),
            PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
            OMP_NUM_THREADS="1",
        )
        env.update({key: value for key, value in extra_env.items() if value is not None})
        for key in [key for key, value in extra_env.items() if value is None]:
            env.pop(key, None)
        log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the rank writing to it  # noqa: SIM115 (closed after the ranks exit)
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=log, stderr=log, cwd=REPO))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise AssertionError(f"{script.name} {' '.join(args)}: a rank did not finish within {timeout} s") from None
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        if proc.returncode != 0:
            raise AssertionError(f"rank {rank} of {script.name} exited with {proc.returncode}:\n{out[-6000:]}")
    return outputs


def on_ranks(
    function: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 300.0,
    env: dict[str, str | None] | None = None,
    nodes: int = 1,
) -> list[Any]:
    """Call ``function(*args)`` on every rank, each in a process of its own; return the results in rank order.

    ``function`` is a module-level function of an importable module (a test module's own), and ``args`` and
    its result go through ``torch.save``. A rank that fails or hangs fails the caller, with its output.
    """
    with tempfile.TemporaryDirectory() as folder:
        command = _command(Path(folder), function, args, caller="on_ranks")
        run_ranks(Path(command[0]), *command[1:], world_size=world_size, timeout=timeout, env=env, nodes=nodes)
        return [torch.load(f"{command[-1]}.{rank}", weights_only=False) for rank in range(world_size)]


def rank_command(folder: Path, function: Callable[..., Any], *args: Any) -> list[str]:
    """The script and arguments that make one rank call ``function(*args)``; its result goes to ``OUT.<rank>``.

    ``OUT``, the last argument, and the saved ``args`` are in ``folder``. For a test that starts the ranks
    itself (one that watches how they end); :func:`on_ranks` runs it on every rank and waits.
    """
    return _command(folder, function, args, caller="rank_command")


def _command(folder: Path, function: Callable[..., Any], args: tuple[Any, ...], caller: str) -> list[str]:
    """:func:`rank_command`'s work; ``caller``, the harness function called, names itself in the refusal."""
    if "<locals>" in function.__qualname__ or function.__module__ == "__main__":
        raise ValueError(f"{caller} runs module-level functions of importable modules, not {function.__qualname__}")
    arguments, out = folder / "args.pt", folder / "result"
    torch.save(args, arguments)
    target = f"{function.__module__}:{function.__qualname__}"
    return [str(Path(__file__).with_name("_on_rank.py")), target, str(arguments), str(out)]
