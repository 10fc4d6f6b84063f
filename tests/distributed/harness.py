"""Run code on 2 CPU ranks over gloo, as Lightning's cluster environment expects, with a timeout.

Each rank is its own process with ``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE`` and a free loopback
port, so Lightning does not re-launch anything; a rank that hangs or fails fails the test.

The ranks are forked from a fork server that has imported torch, Lightning and DeepSpeed once
(``tests/distributed/_preload.py``), so a launch does not pay those imports (about 7 s of one core per rank here).
The server runs no test code: every launch's ranks start from the same state, and nothing one test's ranks do
reaches another's. ``fresh=True`` (and a GPU rank, which must not inherit a process that looked for CUDA) starts
each rank as a new interpreter instead, for what is read at process start (``MALLOC_*``) or at import.

:func:`on_ranks` runs a function of the test module itself on every rank and returns each rank's result, so a
test keeps its rank code beside its assertions; :func:`run_ranks` runs a script (the fuzzer's; on_ranks runs
its own with it).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


RankEnv = Callable[[int], dict[str, str | None]]
"""A rank's own variables, from its rank (``None`` unsets)."""


def run_ranks(
    script: Path,
    *args: str,
    world_size: int = 2,
    timeout: float = 300.0,
    env: dict[str, str | None] | None = None,
    nodes: int = 1,
    fresh: bool = False,
    rank_env: RankEnv | None = None,
) -> list[str]:
    """Run ``script args`` once per rank (with extra ``env``, where ``None`` unsets); return each rank's output.

    ``rank_env(rank)``, where given, adds each rank's own variables after ``env`` (``None`` unsets), as a cluster's
    launcher sets them (``SLURM_PROCID``, ...).

    Fails with the ranks' output if one fails or ``timeout`` passes.

    With ``nodes=2`` each process is its own node (``NODE_RANK`` 0 and 1, ``LOCAL_RANK`` 0), as two
    machines would be launched, over loopback. ``fresh=True`` starts each rank as a new interpreter rather than
    forking it from the fork server (see the module's text).

    The port is free when chosen, but another process (a concurrent test run, the doc test's commands beside the
    lanes, a pytest-xdist worker) can bind it before rank 0 does: a launch that failed on that alone
    (``EADDRINUSE``, raised where the process group starts) runs once more on another port.
    """
    try:
        return _launch(script, args, rank_environments(world_size, env or {}, nodes, rank_env), timeout, fresh)
    except AssertionError as error:
        if PORT_TAKEN not in str(error):
            raise
        environments = rank_environments(world_size, env or {}, nodes, rank_env)
        return _launch(script, args, environments, timeout, fresh)  # chained


PORT_TAKEN = "EADDRINUSE"
"""What torch's TCP store fails with when the launch's port was taken (its ``DistNetworkError``)."""


def _launch(
    script: Path, args: tuple[str, ...], environments: list[dict[str, str]], timeout: float, fresh: bool
) -> list[str]:
    if fresh or FRESH_VARIABLE in os.environ or environments[0].get("TEST_ACCELERATOR", "cpu") != "cpu":
        return _run_fresh(script, args, environments, timeout)
    return _run_forked(script, args, environments, timeout)


FRESH_VARIABLE = "TEST_FRESH_RANKS"
"""Set (to anything) in the caller's environment, every launch starts new interpreters: to tell the two apart."""


def rank_environments(
    world_size: int, extra_env: dict[str, str | None], nodes: int, rank_env: RankEnv | None = None
) -> list[dict[str, str]]:
    """Each rank's whole environment: the caller's, the launch's variables, ``extra_env``, then ``rank_env(rank)``.

    ``None`` unsets a variable."""
    port = str(free_port())
    environments = []
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
        for extra in (extra_env, rank_env(rank) if rank_env is not None else {}):
            env.update({key: value for key, value in extra.items() if value is not None})
            for key in [key for key, value in extra.items() if value is None]:
                env.pop(key, None)
        environments.append(env)
    return environments


def _run_fresh(script: Path, args: tuple[str, ...], environments: list[dict[str, str]], timeout: float) -> list[str]:
    """Each rank a new interpreter running ``script``."""
    procs, logs = [], []
    for env in environments:
        log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the rank writing to it  # noqa: SIM115 (closed after the ranks exit)
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=log, stderr=log, cwd=REPO))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
        raise _timed_out(script, args, timeout, outputs) from None
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return _checked(script, [proc.returncode for proc in procs], outputs)


def _run_forked(script: Path, args: tuple[str, ...], environments: list[dict[str, str]], timeout: float) -> list[str]:
    """Each rank forked from the fork server, running ``script`` as its ``__main__``."""
    context = _fork_server()
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        logs = [Path(folder, f"rank{rank}.log") for rank in range(len(environments))]
        procs = []
        for env, log in zip(environments, logs, strict=True):
            log.touch()
            procs.append(context.Process(target=_rank, args=(str(script), args, env, str(log))))
            procs[-1].start()
        failed = None
        try:
            failed = _first_failure(procs, time.monotonic() + timeout)
        finally:  # also when pytest's own timeout interrupts the wait: no rank outlives its launch
            hung = failed is None and any(proc.exitcode is None for proc in procs)
            for proc in procs:
                proc.kill()
                proc.join()
        if hung:
            raise _timed_out(script, args, timeout, [log.read_text() for log in logs])
        return _checked(script, [proc.exitcode for proc in procs], [log.read_text() for log in logs], failed)


def _first_failure(procs: list[multiprocessing.process.BaseProcess], deadline: float) -> int | None:
    """Wait until every rank has exited or ``deadline``; return the first rank seen exiting non-zero, at once.

    The others are stopped then: they would wait for it in a collective until the timeout. A rank's own error is
    what the launch reports, not the broken connection another rank met next.
    """
    while True:
        failed = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
        alive = [proc.sentinel for proc in procs if proc.exitcode is None]
        remaining = deadline - time.monotonic()
        if failed or not alive or remaining <= 0:
            return failed[0] if failed else None
        multiprocessing.connection.wait(alive, timeout=remaining)


def _timed_out(script: Path, args: tuple[str, ...], timeout: float, outputs: list[str]) -> AssertionError:
    """The error of a launch whose ranks were killed at ``timeout``, with the end of each rank's output."""
    tails = "".join(f"\n--- rank {rank}, its last lines:\n{out[-3000:]}" for rank, out in enumerate(outputs))
    return AssertionError(f"{script.name} {' '.join(args)}: a rank did not finish within {timeout} s{tails}")


def _checked(script: Path, codes: list[int | None], outputs: list[str], first: int | None = None) -> list[str]:
    """``outputs``, once every rank exited with 0; else a failed rank's output (``first``'s, where given) in an
    AssertionError."""
    ranks = list(range(len(codes)))
    for rank in ([first] if first is not None else []) + ranks:
        if codes[rank] != 0:
            raise AssertionError(f"rank {rank} of {script.name} exited with {codes[rank]}:\n{outputs[rank][-6000:]}")
    return outputs


_CONTEXT: list[multiprocessing.context.ForkServerContext] = []


def _fork_server() -> multiprocessing.context.ForkServerContext:
    """The fork server's context, the server started on first use (``multiprocessing`` restarts one that died).

    It starts with the ranks' common settings in its environment (one OpenMP thread, the repository on the path),
    which its preloaded torch reads at import, as a new rank's interpreter would.
    """
    if not _CONTEXT:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["tests.distributed._preload"])
        _CONTEXT.append(context)
    saved = dict(os.environ)
    os.environ.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        DS_ACCELERATOR="cpu",  # what DeepSpeed picks at import in the server: its ranks are CPU ranks, GPU or not
    )
    try:
        _ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return _CONTEXT[0]


def _ensure_running() -> None:
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _rank(script: str, args: tuple[str, ...], env: dict[str, str], log: str) -> None:
    """One forked rank: its output to ``log``, its environment, then ``script`` as ``__main__``."""
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND)
    for stream in (1, 2):
        os.dup2(descriptor, stream)
    os.close(descriptor)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    sys.argv = [script, *args]
    sys.path[:0] = [str(Path(script).parent), str(REPO)]
    _as_if_started_anew(env)
    runpy.run_path(script, run_name="__main__")


def _as_if_started_anew(env: dict[str, str]) -> None:
    """What a new interpreter would have that the forked rank inherited otherwise: threads, random states, the rank.

    Python's ``random``, NumPy's and torch's global generators were seeded once in the server, so every fork would
    draw the same numbers: they draw fresh seeds, as a new interpreter does. Lightning read the rank for
    ``rank_zero_only`` at its import, in the server: it reads this rank's.
    """
    import random

    import numpy
    from lightning.fabric.utilities import rank_zero

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    random.seed()
    numpy.random.seed()
    torch.seed()
    keys = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")  # Lightning's, in its order
    rank_zero.rank_zero_only.rank = next((int(env[key]) for key in keys if key in env), 0)


def on_ranks(
    function: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 300.0,
    env: dict[str, str | None] | None = None,
    nodes: int = 1,
    fresh: bool = False,
    rank_env: RankEnv | None = None,
) -> list[Any]:
    """Call ``function(*args)`` on every rank, each in a process of its own; return the results in rank order.

    ``function`` is a module-level function of an importable module (a test module's own), and ``args`` and
    its result go through ``torch.save``. A rank that fails or hangs fails the caller, with its output.
    """
    with tempfile.TemporaryDirectory() as folder:
        command = _command(Path(folder), function, args, caller="on_ranks")
        run_ranks(
            Path(command[0]),
            *command[1:],
            world_size=world_size,
            timeout=timeout,
            env=env,
            nodes=nodes,
            fresh=fresh,
            rank_env=rank_env,
        )
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
