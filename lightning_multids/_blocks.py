"""The blocks an engine can be inside: ``no_sync``, ``gathered`` and ``offloaded``; one validator for all three.

* :func:`no_sync`: gradients kept local during the block, reduced once when it ends.
* :func:`gathered`: a ZeRO-3 engine's submodule whole for the block. Under ZeRO-3 each forward gathers a
  submodule's parameters and releases them after it, layer by layer; an autoregressive ``generate`` would gather
  the whole model once per token. The block gathers it once, takes ZeRO-3's per-layer hooks off so the block runs
  it as a plain module, and partitions it again at the end (as TRL's ``unwrap_model_for_generation`` does). The
  cost: the whole submodule, in its engine's dtype, on every rank during the block.
* :func:`offloaded`: engines put to sleep, their states moved to host memory with DeepSpeed's
  ``engine.offload_states()`` and back with ``engine.reload_states()`` (what OpenRLHF does between RLHF phases).
  DeepSpeed 0.19.8 moves the states of ZeRO-1/2 optimizers, and of ZeRO-3 ones only when the optimizer is its
  ``FusedAdam`` (a CUDA op); it has nothing to move for a frozen engine and refuses engines that offload their
  parameters (``offload_param``). Those are refused, naming the engine.

Each engine's record (:class:`~lightning_multids._record.EngineRecord`) lists the blocks it is inside now.
:func:`inside` is the one place that enters and leaves a block: it refuses a block of a kind the engine is in
already (``gathered`` and ``offloaded`` count as one kind: each takes the weights out of training); the engine's
optimizer reads the same list (:meth:`~lightning_multids._record.EngineRecord.refuse_step`) before it steps.
Misuse raises :class:`BlockError`; an engine name that does not exist is a ``ValueError``, as for every other
argument.
"""

from __future__ import annotations

import re
import traceback
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.utils import is_zero_param
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._gradients import from_own_code
from lightning_multids._joined import called_modules
from lightning_multids._record import NO_SYNC, BlockError, EngineRecord

_EXCLUDES = {
    "strategy.no_sync": {"strategy.no_sync"},
    "strategy.gathered": {"strategy.gathered", "strategy.offloaded"},
    "strategy.offloaded": {"strategy.gathered", "strategy.offloaded"},
}
"""For each kind of block, the kinds an engine must not be inside already when it enters one."""


def _kind(block: str) -> str:
    return block.split("(", 1)[0]


@contextmanager
def inside(what: str, block: str, records: Sequence[EngineRecord]) -> Iterator[None]:
    """Put ``records`` inside ``block`` for the body (``what`` is the call, as the user wrote it, for errors).

    Raises:
        BlockError: an engine is inside a block of a kind that ``block`` excludes (see the module).
    """
    busy = [
        (record.name, held) for record in records for held in record.blocks if _kind(held) in _EXCLUDES[_kind(block)]
    ]
    if busy:
        names = sorted({name for name, _ in busy})
        named = len(records) == 1 and repr(records[0].name) in what  # the call names its one engine
        subject = "the engine is" if named else f"the engines {names} are"
        raise BlockError(f"`{what}`: {subject} inside `{busy[0][1]}` already; don't nest them.")
    for record in records:
        record.blocks.append(block)
    try:
        yield
    finally:
        for record in records:
            record.blocks.remove(block)


# ---- no_sync ---------------------------------------------------------------------------------------------


@contextmanager
def no_sync(records: Sequence[EngineRecord]) -> Iterator[None]:
    """Keep the gradients of the engines local during the body; reduce each engine once when it ends.

    Under this strategy (``engine.step()`` is the accumulation boundary) stages 0 and 1 reduce only in
    ``step()``, so several backwards already cost one reduction; stages 2 and 3 reduce (reduce-scatter)
    during every backward. Inside the block, ZeRO-2/3 engines instead accumulate whole gradients in
    ``param.grad`` (:func:`~lightning_multids._compat.deepspeed.start_no_sync`), and on exit every rank reduces them
    once, in the same order, into the partitions, where they add to whatever earlier backwards of this step
    reduced. ``engine.step()`` refuses to run inside the block.

    On an exception the gradients of the block are dropped instead: reducing on only the ranks that
    got here would leave the others waiting.
    """
    with inside("no_sync", NO_SYNC, records):
        for record in records:
            ds_compat.start_no_sync(record.engine)
        try:
            yield
        except BaseException:
            for record in records:
                ds_compat.stop_no_sync(record.engine)
                ds_compat.clear_gradients(record.engine)
            raise
        for record in sorted(records, key=lambda record: record.name):  # the same collective order on every rank
            ds_compat.stop_no_sync(record.engine)
            ds_compat.reduce_local_gradients(record.engine)


# ---- gathered --------------------------------------------------------------------------------------------


class Arrival:
    """Every rank checks in before a block's collectives, within a bounded time, in a gloo group of its own.

    A block entered on some ranks only (e.g. under ``if self.global_rank == 0``) would otherwise wait in its first
    all-gather until the process group's timeout (30 minutes by default), or meet another collective of the ranks
    that went on and exchange the wrong tensors. The check-in is an all-gather of the block's name (a checksum) in
    a gloo group whose timeout is ``timeout``: it never meets the blocks' own collectives, whatever the backend, and
    it fails on every rank that waits. (``torch.distributed.monitored_barrier`` bounds the wait on rank 0 only.)
    The group is made at the first check-in, so a fit that enters no such block makes none (where gloo cannot pick
    a network interface, only ``gathered`` needs one); making it is a collective bounded by ``timeout`` too, and
    every rank reaches it at the same block.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.group: torch.distributed.ProcessGroup | None = None

    def __call__(self, block: str) -> None:
        """Wait until every rank is at ``block``; raise a RuntimeError after ``timeout``, or if a rank is elsewhere."""
        mine = torch.tensor([zlib.crc32(block.encode())], dtype=torch.int64)
        try:
            if self.group is None:
                self.group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
            everyone = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size(self.group))]
            torch.distributed.all_gather(everyone, mine, group=self.group)
        except RuntimeError as error:  # torch.distributed.DistError (a timeout) is one
            raise RuntimeError(
                f"`{block}` did not meet every rank within {self.timeout} ({error}). It gathers a ZeRO-3 "
                "engine's partitions from every rank, or broadcasts an edit to every rank, so every rank must enter "
                "it, at the same point: don't put it "
                "under a condition that differs between ranks (such as `if self.global_rank == 0`). If some ranks "
                "only arrive later, raise `MultiDeepSpeedStrategy(gathered_timeout=...)`."
            ) from error
        elsewhere = [rank for rank, code in enumerate(everyone) if not torch.equal(code, mine)]
        if elsewhere:
            raise RuntimeError(
                f"`{block}`: rank(s) {elsewhere} entered another block at the same time. Every rank must enter the "
                "same `gathered` blocks in the same order."
            )

    def close(self) -> None:
        """Destroy the group, where one was made (no collective)."""
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None


def refuse_outside_run(call: str, engines: Collection[str], run: str = "`Trainer.fit`") -> None:
    """Raise a ``RuntimeError`` (a call at the wrong time) where there are no ``engines``: before or after ``run``.

    A wrong name while the engines exist is a ``ValueError`` instead, raised by each call with the names to choose.
    """
    if not engines:
        raise RuntimeError(f"`{call}` needs the engines, which exist only during {run}.")


@contextmanager
def gathered(
    name: str,
    records: Mapping[str, EngineRecord],
    arrive: Callable[[str], None] | None = None,
    modifier_rank: int | None = None,
) -> Iterator[nn.Module]:
    """Make engine ``name``'s submodule whole on this rank for the block, under ``torch.no_grad()``; yield it.

    A collective call: every rank enters the block (the gathering and the partitioning are all-gathers). At
    ZeRO-0/1/2 the submodule is whole already and only ``no_grad`` applies. A trained engine's optimizer refuses
    to step inside the block. ``arrive(block)``, where given, returns once every rank is at the block (an
    :class:`Arrival`), and is called before the gathering. With ``modifier_rank``, that rank's weights at the end
    of the block become every rank's, and the fp32 master copy's (:func:`_keep_edits`).

    Raises:
        RuntimeError: there are no engines (outside fit, validate, test and predict).
        ValueError: there is no engine ``name``, or ``modifier_rank`` is no rank.
        BlockError: it is inside a ``gathered`` or ``offloaded`` block already.
    """
    refuse_outside_run(f"gathered({name!r})", records, "`Trainer.fit`, `validate`, `test` and `predict`")
    if name not in records:
        raise ValueError(
            f"`gathered({name!r})`: there is no engine {name!r} now (engines: {sorted(records)}). Engines exist "
            "from setup to teardown of fit, validate, test and predict; name a submodule that has one."
        )
    check_modifier_rank(name, modifier_rank)
    record = records[name]
    block = f"strategy.gathered({name!r})"
    unguarded = nullcontext() if record.guard is None else record.guard.suspended("data")
    with inside(f"gathered({name!r})", block, [record]), unguarded:  # the weights are whole: yours to read and edit
        engine = record.engine
        params = [param for param in engine.module.parameters() if is_zero_param(param)]
        if (params or modifier_rank is not None) and arrive is not None:  # the block's collectives follow
            arrive(block)
        with torch.no_grad(), ds_compat.gathered_parameters(params, modifier_rank):
            restore = ds_compat.suspend_zero3_hooks(engine) if params else None
            try:
                yield engine.module
                if modifier_rank is not None:
                    keep_edits(engine.module, modifier_rank, trained=record.trainable)
            finally:
                record.edited = True  # `data` was not watched in the block: the next step takes what it changed
                if restore is not None:
                    restore()


def check_modifier_rank(name: str, modifier_rank: int | None) -> None:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if modifier_rank is not None and (isinstance(modifier_rank, bool) or modifier_rank not in range(world)):
        raise ValueError(
            f"`gathered({name!r}, modifier_rank={modifier_rank!r})`: the modifier rank is the global rank whose "
            f"edits every rank keeps, one of 0 to {world - 1}; pass one of those (0 is rank zero), or None to read."
        )


def keep_edits(module: nn.Module, modifier_rank: int, trained: bool) -> None:
    """Make ``modifier_rank``'s whole weights of ``module`` every rank's, and the master copy's where ``trained``.

    A frozen or EMA engine, or a plain submodule outside fit, has no master copy. Called inside the block, so the
    weights are whole at every stage. At ZeRO-3 DeepSpeed's ``GatheredParameters`` broadcasts them again as it
    ends and writes each rank's partition from them.
    """
    params = list(module.parameters())
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        for param in params:
            torch.distributed.broadcast(param.data, src=modifier_rank)
    if trained:
        for param in params:
            ds_compat.set_master_weights(param)


@contextmanager
def whole(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """``deepspeed.zero.GatheredParameters`` over those of ``params`` ZeRO-3 holds partitioned now; a collective call.

    Inside :func:`gathered` a submodule's parameters are whole already, and DeepSpeed refuses to gather them again
    ("Nested GatheredParameters contexts cannot overlap"); they are read as they are. So are the small ones ZeRO-3
    keeps whole between forwards. Every rank is in the same blocks, so every rank gathers the same list.
    Each placeholder is left on the device it was on: DeepSpeed releases a gathered parameter to an empty one on
    the device it gathered on, which after fit (the module on the CPU, as Lightning's teardown leaves it) is not
    the module's.
    """
    partitioned = [param for param in params if is_zero_param(param) and not ds_compat.is_gathered(param)]
    devices = [param.data.device for param in partitioned]
    try:
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None, enabled=bool(partitioned)):
            yield
    finally:
        for param, device in zip(partitioned, devices, strict=True):
            if param.data.device != device and param.data.numel() == 0:  # a placeholder, not a half-done gather
                param.data = param.data.to(device)


# ---- offloaded -------------------------------------------------------------------------------------------


@contextmanager
def offloaded(names: tuple[str, ...], records: Mapping[str, EngineRecord]) -> Iterator[None]:
    """Move the states of the trainable engines ``names`` off the device for the block; reload them after it.

    Raises:
        ValueError: a name is not a trainable engine, or DeepSpeed cannot move its states (see the module).
        BlockError: an engine is inside a ``gathered`` or ``offloaded`` block already.
    """
    chosen = _choose(names, records)
    with ExitStack() as stack:
        for record in chosen:  # every engine is checked before any moves
            stack.enter_context(inside(f"offloaded({record.name!r})", f"strategy.offloaded({record.name!r})", [record]))
        for record in chosen:
            stack.enter_context(_asleep(record))
        yield


def _choose(names: tuple[str, ...], records: Mapping[str, EngineRecord]) -> list[EngineRecord]:
    trainable = sorted(name for name, record in records.items() if record.trainable)
    refuse_outside_run(f"offloaded({', '.join(map(repr, names))})", trainable)
    if not names:
        raise ValueError(f"`offloaded()` needs the names of the engines to offload, e.g. {trainable}.")
    chosen = []
    for name in names:
        if name not in trainable:
            frozen = name in records
            reason = " (a frozen engine has no optimizer states: offload its parameters with ZeRO-3's `offload_param`)"
            raise ValueError(
                f"`offloaded({name!r})`: there is no trainable engine {name!r}{reason if frozen else ''}. "
                f"Trainable engines exist during fit: {trainable}."
            )
        _check_supported(name, records[name].engine)
        chosen.append(records[name])
    return chosen


def _check_supported(name: str, engine: DeepSpeedEngine) -> None:
    stage = engine.zero_optimization_stage()
    offload_param, offload_optimizer = engine.zero_offload_param(), engine.zero_offload_optimizer()
    problem = ""
    if stage == 0:
        problem = "it is at ZeRO-0, whose optimizer DeepSpeed cannot move; give it stage 1, 2 or 3"
    elif offload_optimizer is not None and offload_optimizer.device != OffloadDeviceEnum.none:
        # DeepSpeed's reload_states() would bring the fp32 master copy to the GPU, where DeepSpeedCPUAdam refuses it
        problem = (
            "its optimizer states live in host memory already (`offload_optimizer`), so the block would free "
            "nothing, and DeepSpeed's reload would move them to the GPU, where its CPU optimizer cannot step them; "
            "leave this engine out of the block"
        )
    elif offload_param is not None and offload_param.device != OffloadDeviceEnum.none:
        problem = "its parameters are offloaded already (`offload_param`), which DeepSpeed refuses to combine"
    elif stage == 3 and not isinstance(ds_compat.torch_optimizer(engine), FusedAdam):
        problem = (
            "it is at ZeRO-3, where DeepSpeed moves optimizer states only of its own FusedAdam (a CUDA op: "
            "`deepspeed.ops.adam.FusedAdam` in `configure_optimizers`, or an `optimizer` section in its config); "
            "or give it stage 1 or 2"
        )
    if problem:
        raise ValueError(f"`offloaded({name!r})`: DeepSpeed cannot move the engine's states: {problem}.")


@contextmanager
def _asleep(record: EngineRecord) -> Iterator[None]:
    engine = record.engine
    pin = engine.device.type == "cuda"  # pinned host memory makes the copies back faster; a CPU has none
    engine.offload_states(pin_memory=pin)
    handles = [_refuse_forward(record.name, part) for part in called_modules(engine.module)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        engine.reload_states()
        record.edited = True  # the weights came back in new storages: the next step takes them (and notes where)


def _refuse_forward(name: str, module: nn.Module) -> RemovableHandle:
    def refuse(*args: Any) -> None:
        raise RuntimeError(
            f"`self.{name}` was called inside `strategy.offloaded({name!r})`, where its weights and optimizer states "
            "are off the device. Call it after the block, or leave it out of `offloaded(...)`."
        )

    return module.register_forward_pre_hook(refuse)


def refuse_partitioned_weights(name: str) -> Callable[[torch.Tensor, str, str], None]:
    """The check a read or write of ``param.data`` of ZeRO-3 engine ``name`` runs outside ``gathered`` blocks.

    Where no forward or backward of a submodule that holds the parameter runs, ZeRO-3 keeps each weight as this
    rank's partition: ``param.data`` is empty (small weights, under ``stage3_param_persistence_threshold``, stay
    whole, but a change to them never reaches the partition and is overwritten at the next step). Under DDP it is
    the whole weight, and an edit through it (WGAN's clamp, a momentum teacher's update) trains on. An access from
    user code there is refused, and so is ``param.data = ...`` anywhere outside a block; one from torch, DeepSpeed
    or the strategy passes. (An in-place edit through ``param.data`` inside a forward reads it, and is lost.)
    """

    def check(param: torch.Tensor, reader: str, verb: str) -> None:
        if from_own_code(reader) or (verb == "read" and ds_compat.in_use(param)):
            return
        raise RuntimeError(
            f"`param.data` of a parameter of engine {name!r} (ZeRO-3) was {verb} outside its forward (in "
            f"{reader or 'unknown code'}): ZeRO-3 keeps each weight partitioned there, so a read sees an empty "
            "tensor (or a small weight whose edits the next step overwrites) and an edit changes nothing, where "
            f"DDP's weight is whole. Edit the weights inside `with self.trainer.strategy.gathered({name!r}, "
            f"modifier_rank=0) as module:` (rank 0's edits become every rank's; every rank enters it), read them "
            f"inside `gathered({name!r})`; to keep an average of another engine's weights, use "
            "`MultiDeepSpeedStrategy(ema=...)`."
        )

    return check


def refuse_partitioned_use(name: str) -> Callable[[str, str], None]:
    """What user code meets when it reads a parameter of ZeRO-3 engine ``name`` outside every forward of the engine.

    There the parameter is this rank's partition, an empty tensor, where DDP's is the whole weight: a product with
    it fails in the user's code with torch's shape error, and an in-place ``nn.init`` (or ``reset_parameters()``)
    changes nothing. Inside a forward of any submodule of the engine DeepSpeed gathers it, and inside ``gathered``
    it is whole. Reads by torch (other than a ``reset_parameters``), DeepSpeed and the strategy pass.
    """

    def refuse(param: str, reader: str) -> None:
        if from_own_code(reader) and "reset_parameters" not in reader:
            return
        raise RuntimeError(
            f"`{param}` of engine {name!r} (ZeRO-3) was read outside every forward of {name!r} (in "
            f"{reader or 'unknown code'}): there ZeRO-3 holds it as this rank's partition, an empty tensor, where "
            "DDP's is the whole weight, so a computation with it fails and an in-place initialisation changes "
            f"nothing. Use it inside the forward of a submodule of {name!r} (DeepSpeed gathers it there), read it "
            f"inside `with self.trainer.strategy.gathered({name!r}):`, or edit or re-initialise it inside "
            f"`with self.trainer.strategy.gathered({name!r}, modifier_rank=0):` (every rank enters the block)."
        )

    return refuse


def note_partitioned_use(exception: BaseException, engines: Mapping[str, DeepSpeedEngine]) -> None:
    """Add a note naming the fix to ``exception`` where user code computed with an empty ZeRO-3 partition.

    Code that gets an engine's parameters without reading them as attributes (``unet.parameters()`` handed to
    an EMA updater, as diffusers' ``EMAModel.step`` takes them) passes the attribute-read refusal
    (:func:`refuse_partitioned_use`); outside a forward of the engine each is this rank's partition, an empty tensor,
    and the first product with it fails with torch's shape error in that code. Where such a parameter is a local of
    a frame of the traceback outside torch, DeepSpeed and the strategy, the error gets a note naming the parameter,
    its engine and ``gathered``. Only torch's errors about a tensor with no elements are noted (the message names a
    size or a dimension of 0, or a 1-D tensor where a matrix was due), so that an error of another kind raised where
    such a parameter happens to be a local is not blamed on it. Read after the fact, on the exception's way out of
    the fit: the step pays nothing.
    """
    if isinstance(exception, RecursionError) or not isinstance(exception, (RuntimeError, IndexError)):
        return
    if not _EMPTY_TENSOR_ERROR.search(str(exception)):
        return
    named = {
        param: (name, key)
        for name, engine in engines.items()
        if engine.zero_optimization_partition_weights()
        for key, param in engine.module.named_parameters()
        if ds_compat.is_empty_partition(param)
    }
    found = None
    for frame, line in traceback.walk_tb(exception.__traceback__):
        if from_own_code(frame.f_globals.get("__name__", "")):
            continue
        held = next(((local, value) for local, value in _held(frame.f_locals) if value in named), None)
        if held is not None:  # the innermost frame's first
            found = (*held, f"{frame.f_code.co_qualname} ({frame.f_code.co_filename}:{line})")
    if found is None:
        return
    local, param, where = found
    name, key = named[param]
    exception.add_note(
        f"MultiDeepSpeedStrategy: `{local}` in {where} is `{key}` of engine {name!r} (ZeRO-3). Outside every "
        f"forward of {name!r} ZeRO-3 holds it as this rank's partition, an empty tensor, where DDP's is the whole "
        f"weight. Use the weights inside `with self.trainer.strategy.gathered({name!r}):` (every rank enters the "
        f"block); an average of {name!r} is kept by `MultiDeepSpeedStrategy(ema=...)` (docs/ema.md)."
    )


_EMPTY_TENSOR_ERROR = re.compile(
    r"\(0\)|of size 0\b|with size 0\b|\[-1, 0\]|got 1-D|must be \d-D|at least \w+ dimensions|shape \[0\]|"
    r"numel\(\) == 0|is empty"
)
"""Torch's messages about a tensor with no elements: what a computation with an empty ZeRO-3 partition meets."""


def _held(local_variables: Mapping[str, Any]) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters a frame holds: as locals, then in a list or tuple local (``torch._foreach_*``'s arguments)."""
    for local, value in local_variables.items():
        if isinstance(value, nn.Parameter):
            yield local, value
    for local, value in local_variables.items():
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value[:10_000]):
                if isinstance(item, nn.Parameter):
                    yield f"{local}[{index}]", item
