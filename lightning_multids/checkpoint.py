"""Checkpoints of a multi-engine run: one directory, one part per engine, written atomically; export.

Layout of a checkpoint ``PATH`` (a directory, whatever its name, e.g. ``epoch=3-step=80.ckpt``)::

    PATH/lightning.pt        Lightning's state (loops, callbacks, schedulers, hyperparameters, extras
                             from on_save_checkpoint), the weights of plain (non-engine) submodules,
                             and a description of the engines under the key "multids"
    PATH/engines/NAME/       engine NAME as DeepSpeed saves it (weights, optimizer and loss-scaler
                             state, ZeRO partitions per rank), tag "state"
    PATH/engines/NAME/weights.pt
                             a frozen or EMA engine's whole ``state_dict`` instead (it has no optimizer
                             state; DeepSpeed cannot save a ZeRO-3 engine without an optimizer)
    PATH/engines/NAME/hf/    for an engine holding a Hugging Face model (PEFT's included): its config, adapter
                             config and class, for ``export(..., format="hf")`` (:mod:`lightning_multids._huggingface`)
    PATH/engines/NAME/universal/
                             added by the first resume at another world size: the ZeRO-1/2/3 engine's
                             state as DeepSpeed's universal checkpoint (``ds_to_universal``), which loads at
                             any data-parallel size; later resumes at other sizes reuse it

Every rank writes its partitions into ``PATH.partial``; when all have finished, rank 0 moves the
finished directory to ``PATH``. A process killed while saving leaves only ``PATH.partial``, which is
never loaded. Replacing an existing ``PATH`` (``last.ckpt``) moves the old one to ``last.old.ckpt`` first
(:func:`old_path`) and deletes it once the new one is in place. If a save dies between the two renames, the
old one is still found: by ``ckpt_path="last"`` (Lightning looks for ``last*.ckpt``), and by loading ``PATH``.

Frozen engines are not saved unless asked (their weights never change during fit); EMA engines always are.

With ``MultiDeepSpeedStrategy(checkpoint_format="file")`` a save writes that directory as ``PATH.parts``, then rank 0
packs it into the one file ``PATH`` (:func:`pack`): Lightning's keys as ``DDPStrategy`` writes them (whole weights
under ``state_dict``, torch's ``optimizer.state_dict()`` per optimizer under ``optimizer_states``) and the directory's
files inside it. Every load of such a file unpacks them into a temporary directory first (:func:`unpacked`,
:func:`opened`) and reads that as any checkpoint directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import deepspeed
import fsspec
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero.utils import is_zero_param
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn
from torch.optim import Optimizer

from lightning_multids import _huggingface as huggingface
from lightning_multids import _loading as loading
from lightning_multids._blocks import whole
from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat.deepspeed import stage0_weights
from lightning_multids._joined import part_names, split_state
from lightning_multids._noise import zero_deprecations_hidden
from lightning_multids._precision import engine_dtype
from lightning_multids._single_file import packed_files, unpack_files

__all__ = ["as_file", "consolidated_state_dicts", "export"]

FORMAT_KEY = "multids"
LIGHTNING_FILE = "lightning.pt"
ENGINE_DIR = "engines"
TAG = "state"
UNIVERSAL_TAG = "universal"
WEIGHTS_FILE = "weights.pt"
PLAIN = "plain"
"""The key of the plain (non-engine) submodules' entries in :func:`consolidated_state_dicts`."""
LIGHTNING_EXPORT = "model.ckpt"
"""The file ``export(..., format="lightning")`` writes."""
EXPORT_FORMATS = ("pt", "hf", "lightning")
CHECKPOINT_FORMATS = ("directory", "file")
"""What ``MultiDeepSpeedStrategy(checkpoint_format=...)`` takes: a directory (default) or one file (:func:`pack`)."""
FILES_KEY = "files"
"""Where a single-file checkpoint's description (under :data:`FORMAT_KEY`) carries its directory's files."""
PACKING = ".parts"
"""The suffix of the directory a single-file save writes first (``PATH.parts``), removed once ``PATH`` is written."""
EXPORT_OPT_OUT = "export it with `lightning-multids export --unsafe-load` (`export(..., weights_only=False)`)"
AS_FILE_OPT_OUT = "pass `weights_only=False` to `as_file`"


def save(
    checkpoint: dict[str, Any],
    path: str | Path,
    *,
    engines: Mapping[str, DeepSpeedEngine],
    weights: Mapping[str, nn.Module],
    frozen: set[str],
    averages: Mapping[str, int],
    plain_state: dict[str, Any],
    world_size: int,
    is_global_zero: bool,
    barrier: Callable[[str], None],
) -> None:
    """Save Lightning's ``checkpoint`` and every engine in ``engines`` to the directory ``path``; a collective call.

    Args:
        checkpoint: what Lightning dumped; its ``state_dict`` is replaced by ``plain_state``, and its
            ``optimizer_states`` are empty (each engine's part holds its optimizer state).
        path: the checkpoint directory, the same on every rank.
        engines: the engines to save with DeepSpeed (weights and optimizer state), by name.
        weights: the submodules of the engines to save as weights only (frozen and EMA engines), by name.
        frozen: the names of all frozen engines (saved or not), for the description.
        averages: the update count of each EMA engine (:meth:`~lightning_multids._ema.Averager.state`).
        plain_state: the state dict entries of submodules that are not engines.
        world_size: the number of processes (each a data-parallel rank of every engine).
        is_global_zero: whether this is rank 0, which writes Lightning's part and moves directories.
        barrier: a barrier across all ranks.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if is_global_zero:
        remove(partial)  # a save killed before, of either format
        partial.mkdir(parents=True)
    barrier("multids.save.start")
    with zero_deprecations_hidden():  # ZeRO-3's gathers, in a save after fit (during it, hidden already)
        for name, engine in engines.items():
            engine.save_checkpoint(str(partial / ENGINE_DIR / name), tag=TAG, client_state={})
        for name, module in weights.items():
            trained = name not in frozen
            save_weights(module, partial / ENGINE_DIR / name, is_global_zero=is_global_zero, trained=trained)
    if is_global_zero:
        modules = {**{name: engine.module for name, engine in engines.items()}, **weights}
        for name, module in modules.items():
            huggingface.describe(module, partial / ENGINE_DIR / name / huggingface.DESCRIPTION_DIR)
        kept = {k: v for k, v in checkpoint.items() if k != "state_dict"}  # optimizer_states are empty here
        kept["state_dict"] = plain_state
        kept[FORMAT_KEY] = {
            "engines": {
                **{
                    name: {"stage": e.zero_optimization_stage(), "precision": _precision_name(e), **_parts(e.module)}
                    for name, e in engines.items()
                },
                **{name: {"stage": None, **_parts(module)} for name, module in weights.items()},
            },
            "frozen": sorted(frozen),
            "averages": dict(averages),
            "world_size": world_size,
        }
        torch.save(kept, partial / LIGHTNING_FILE)
    barrier("multids.save.written")
    if is_global_zero:
        _move_into_place(partial, path)
    barrier("multids.save.done")


def _parts(module: nn.Module) -> dict[str, list[str]]:
    """``{"parts": [...]}`` for the module of an engine over several submodules (its description); else nothing."""
    parts = part_names(module)
    return {} if parts is None else {"parts": parts}


def old_path(path: Path) -> Path:
    """Where a save keeps the checkpoint at ``path`` it replaces: ``last.ckpt`` -> ``last.old.ckpt``.

    Ending in ``.ckpt`` and starting as the name did, it is what Lightning's ``ckpt_path="last"`` finds
    (``last*.ckpt``, the newest) when a save died before ``path`` was back.
    """
    return path.with_name(f"{path.stem}.old{path.suffix}") if path.suffix else path.with_name(path.name + ".old")


def _move_into_place(partial: Path, path: Path) -> None:
    old = old_path(path)
    if path.exists() or path.is_symlink():
        remove(old)
        os.replace(path, old)
    os.replace(partial, path)
    remove(old)


def remove(path: Path) -> None:
    """Remove what is at ``path``: a checkpoint directory, a single file, or a link (``save_last="link"``)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


Layout = list[tuple[str, list[list[str]]]]
"""Per optimizer of ``self.optimizers()``, in order: its engine's name, and its parameters' names per group."""


def optimizer_layout(optimizers: Sequence[tuple[str, Optimizer]], modules: Mapping[str, nn.Module]) -> Layout:
    """The :data:`Layout` of ``optimizers``, each with its engine's name; the names are those in ``modules[name]``."""
    layout = []
    for name, optimizer in optimizers:
        names = {param: key for key, param in modules[name].named_parameters()}
        layout.append((name, [[names[param] for param in group["params"]] for group in optimizer.param_groups]))
    return layout


def pack(directory: Path, path: Path, *, layout: Layout, is_global_zero: bool, barrier: Callable[[str], None]) -> None:
    """Write the checkpoint directory ``directory`` (:func:`save`) as the single file ``path``; a collective call.

    The file holds Lightning's keys with ``state_dict`` holding every saved weight whole (fp32, keyed as in the
    LightningModule, merged from the ZeRO partitions as :func:`consolidated_state_dicts` merges them) and
    ``optimizer_states`` as torch's ``optimizer.state_dict()`` of each optimizer from ``configure_optimizers``
    (:func:`_optimizer_state`; ``layout`` names their parameters), and under :data:`FORMAT_KEY` the engines'
    description and the directory's files (:mod:`lightning_multids._single_file`), which a resume unpacks and loads
    as it loads the directory. Rank 0 writes ``PATH.packing`` and renames it to ``PATH`` (a process killed before
    leaves the previous ``PATH``), then removes ``directory``.
    """
    if is_global_zero:
        lightning = read_lightning_part(directory, weights_only=False)  # this save's own files
        states = _consolidated(directory, weights_only=False)
        single = _one_file(lightning, states, torch.float32, training_state=True)
        if "optimizer_states" in single:  # not in a weights-only save
            engines = lightning[FORMAT_KEY]["engines"]
            single["optimizer_states"] = [
                _optimizer_state(directory / ENGINE_DIR / name, engines[name]["stage"], groups)
                for name, groups in layout
            ]
        single[FORMAT_KEY] = {**lightning[FORMAT_KEY], FILES_KEY: packed_files(directory)}
        packing = path.with_name(path.name + ".packing")  # not `.partial`: a directory save's, maybe left by a kill
        remove(packing)
        torch.save(single, packing)
        if path.is_dir() and not path.is_symlink():  # a directory checkpoint of that name (the default format's)
            shutil.rmtree(path)
        os.replace(packing, path)  # over a file, or a link (`save_last="link"`), in one step
        shutil.rmtree(directory)
    barrier("multids.save.packed")


def _optimizer_state(engine_dir: Path, stage: int, groups: list[list[str]]) -> dict[str, Any]:
    """An engine's saved optimizer state, whole, as torch's ``state_dict()`` of its optimizer from configure_optimizers.

    At ZeRO-0 the one DeepSpeed saved; at ZeRO-1/2/3 merged from the ranks' partitions by DeepSpeed's universal
    checkpoint conversion, into a temporary directory. That conversion (DeepSpeed 0.19.8) merges Adam's moments only
    and fails on any other optimizer's state (SGD's: ``KeyError: 'exp_avg'``): there the entry is empty, with a
    warning; the engine's state is still in its part of the file, which a resume loads.
    """
    if stage == 0:
        return ds_compat.stage0_optimizer_state(engine_dir, TAG)
    with tempfile.TemporaryDirectory(prefix="multids-universal-") as temporary:
        try:
            ds_compat.to_universal(engine_dir / TAG, Path(temporary) / UNIVERSAL_TAG)
        except KeyError as missing:
            warnings.warn(
                f"The single-file checkpoint's `optimizer_states` entry of the engine {engine_dir.name!r} "
                f"(ZeRO-{stage}) is empty: DeepSpeed's universal checkpoint conversion, which merges its partitions, "
                f"handles Adam's state only (it found no {missing}). `trainer.fit(ckpt_path=...)` still resumes it "
                "exactly from its part inside the file; to read it whole, use Adam/AdamW or ZeRO-0 for that engine.",
                stacklevel=2,
            )
            return {}
        return ds_compat.universal_optimizer_state(Path(temporary) / UNIVERSAL_TAG, groups)


def unpacked(
    path: str | Path, weights_only: bool | None, opt_out: str = loading.TRAINER_OPT_OUT
) -> tempfile.TemporaryDirectory[str] | None:
    """The single-file checkpoint at ``path`` (:func:`pack`) unpacked into a new temporary directory, or None.

    None where ``path`` is not a file (a checkpoint directory, or nothing: see :func:`resolve`). The caller removes
    the directory (``.cleanup()``). The file loads as ``weights_only`` says; a file that is not a single-file
    checkpoint of this strategy is a ValueError.
    """
    path = Path(path)
    if not path.is_file():
        return None
    files = _packed(path, weights_only, opt_out)
    temporary = tempfile.TemporaryDirectory(prefix="multids-checkpoint-")
    try:
        unpack_files(files, Path(temporary.name))
    except BaseException:
        temporary.cleanup()
        raise
    return temporary


def _packed(path: Path, weights_only: bool | None, opt_out: str) -> Mapping[str, torch.Tensor]:
    """The files a single-file checkpoint carries; a ValueError if ``path`` is none."""
    single = None
    if zipfile.is_zipfile(path):  # torch.save's format; anything else is no checkpoint
        with loading.reading(path, weights_only, opt_out):
            single = loading.load(path, weights_only)
    files = single.get(FORMAT_KEY, {}).get(FILES_KEY) if isinstance(single, dict) else None
    if not isinstance(files, Mapping):
        raise ValueError(
            f"{str(path)!r} is not a MultiDeepSpeedStrategy checkpoint: a file is one only if "
            "`MultiDeepSpeedStrategy(checkpoint_format='file')` wrote it; by default a checkpoint is a directory "
            "written by `trainer.save_checkpoint` or `ModelCheckpoint` under this strategy. A single-file Lightning "
            "checkpoint of another strategy can be loaded with `model.load_state_dict` instead."
        )
    return files


@contextlib.contextmanager
def opened(path: str | Path, weights_only: bool | None, opt_out: str) -> Iterator[Path]:
    """The checkpoint directory at ``path`` (:func:`resolve`), or the single file there unpacked for the block."""
    temporary = unpacked(path, weights_only, opt_out)
    if temporary is None:
        yield resolve(path)
        return
    with temporary:
        yield Path(temporary.name)


def local_path(path: str | os.PathLike[str], what: str) -> str:
    """``path`` as a path on this machine's filesystem: a ``file://`` URL's path; other URLs refused.

    Each engine writes and reads its part through DeepSpeed, which opens local files only, so a checkpoint lives on
    a local or mounted filesystem. A URL of another fsspec filesystem (``s3://``, ``gs://``, ``memory://``) would
    otherwise become a local folder named after its scheme.

    Args:
        path: the path or URL given.
        what: where it was given, for the error, e.g. "`trainer.save_checkpoint`'s path".
    """
    text = os.fspath(path)
    if text.startswith(("file:", "local:")):  # `file:///x`, and `file:/x` as a Path or Lightning writes it
        return str(fsspec.core.url_to_fs(text)[1])
    if "://" not in text:  # a path, whatever it holds (`::` too)
        return text
    protocol = fsspec.utils.get_protocol(text)
    raise ValueError(
        f"{what} {text!r} is on fsspec's {protocol!r} filesystem, but MultiDeepSpeedStrategy writes and reads "
        "checkpoints as directories on a local or mounted filesystem (each engine's part goes through DeepSpeed, "
        "which opens local files only). Save to a local directory, e.g. `ModelCheckpoint(dirpath='checkpoints/')`, "
        f"and copy it afterwards: `fsspec.filesystem({protocol!r}).put('checkpoints/', {text!r}, recursive=True)`."
    )


def check_checkpoint_dirs(callbacks: list[Any]) -> None:
    """Refuse, at setup, a ``ModelCheckpoint`` whose ``dirpath`` is another filesystem's URL (:func:`local_path`)."""
    for callback in callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is not None:
            local_path(dirpath, f"`{type(callback).__name__}(dirpath=...)`")


def resolve(path: str | Path) -> Path:
    """The complete checkpoint directory at ``path`` (or at :func:`old_path` after an interrupted replace).

    Raises:
        ValueError: nothing is there, or it is not a checkpoint of this strategy.
    """
    path = Path(path)
    if not path.exists():
        old = old_path(path)
        if (old / LIGHTNING_FILE).is_file():
            return old
        raise ValueError(
            f"The checkpoint {str(path)!r} does not exist. Pass a directory that a MultiDeepSpeedStrategy run saved: "
            "its `checkpoints/last.ckpt` (`ModelCheckpoint(save_last=True)`) or `ModelCheckpoint.best_model_path`."
        )
    if not (path / LIGHTNING_FILE).is_file():
        raise ValueError(
            f"{str(path)!r} is not a MultiDeepSpeedStrategy checkpoint: it has no {LIGHTNING_FILE}. Such a "
            "checkpoint is a directory written by `trainer.save_checkpoint` or `ModelCheckpoint` under this "
            "strategy; a single-file Lightning checkpoint can be loaded with `model.load_state_dict` instead."
        )
    return path


def read_lightning_part(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """Lightning's part of the checkpoint at ``path`` (see :func:`resolve`), loaded as ``weights_only`` says."""
    loaded = loading.load(path / LIGHTNING_FILE, weights_only)
    if FORMAT_KEY not in loaded:
        raise ValueError(f"{str(path / LIGHTNING_FILE)!r} was not written by MultiDeepSpeedStrategy.")
    return loaded


def check_engines(saved: Mapping[str, Any], engines: Mapping[str, DeepSpeedEngine], path: Path) -> None:
    """Raise a ValueError unless the checkpoint holds exactly the trainable engines being resumed."""
    expected, found = sorted(engines), sorted(saved["engines"])
    if expected != found:
        raise ValueError(
            f"The checkpoint {str(path)!r} holds the engines {found}, but this module trains {expected}. Resume "
            "with the LightningModule and `engine_configs` it was saved with, or load only the weights with `export`."
        )
    for name, engine in engines.items():
        was, now = saved["engines"][name].get("parts", [name]), part_names(engine.module) or [name]
        if was != now:
            raise ValueError(
                f"The checkpoint {str(path)!r} saved the engine {name!r} over the submodules {was} (the parameters of "
                f"one optimizer), and its optimizer trains {now} now. Resume with the `configure_optimizers` it was "
                "saved with, or load only the weights with `export`."
            )


TRAINER_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}
"""The Trainer's precision flag for each precision an engine records in a checkpoint."""


def _precision_name(engine: DeepSpeedEngine) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: the precision ``engine`` trains in (:data:`TRAINER_PRECISION`)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(engine_dtype(engine), "fp32")


def check_precisions(saved: Mapping[str, Any], engines: Mapping[str, DeepSpeedEngine], path: Path) -> None:
    """Raise a ValueError, before any engine loads, if an engine trains in another precision than it was saved in.

    DeepSpeed keeps a bf16 or fp16 engine's optimizer state beside fp32 copies of its weights, in files and keys of
    their own, and an fp32 engine's without them: loading one into the other fails inside DeepSpeed (0.19.8: a
    missing file at ZeRO-1/2, ``KeyError: 'param_groups'`` at ZeRO-0). Checkpoints written before the precision
    was recorded are not checked.
    """
    for name, engine in engines.items():
        was, now = saved["engines"][name].get("precision"), _precision_name(engine)
        if was is None or was == now:
            continue
        raise ValueError(
            f"The checkpoint {str(path)!r} saved the engine {name!r} in {was}, and it trains in {now} now: DeepSpeed "
            f"cannot load an optimizer state saved in one precision into another. Resume it in {was} "
            f"(`Trainer(precision={TRAINER_PRECISION[was]!r})`, or the `bf16`/`fp16` section of its `engine_configs` "
            "entry), or start a new fit from its weights alone: `lightning-multids export` them and load them into "
            "the submodule."
        )


def check_stages(saved: Mapping[str, Any], engines: Mapping[str, DeepSpeedEngine], path: Path) -> None:
    """Raise a ValueError, before any engine loads, if an engine's ZeRO stage differs from its saved one.

    ZeRO-1 and ZeRO-2 resume into each other: DeepSpeed saves and loads both with one optimizer class and one
    layout. Other changes fail inside DeepSpeed's load (0.19.8), so they are refused here, naming the fix.
    """
    for name, engine in engines.items():
        was, now = saved["engines"][name]["stage"], engine.zero_optimization_stage()
        if was is None or was == now or {was, now} == {1, 2}:
            continue
        raise ValueError(
            f"The checkpoint {str(path)!r} saved the engine {name!r} at ZeRO-{was}, and it is ZeRO-{now} now: "
            "DeepSpeed cannot load its optimizer state into another stage (ZeRO-1 and ZeRO-2 only load into "
            f"each other). Resume it at ZeRO-{was} (`stage=` or its `engine_configs` entry), or start a new fit "
            "from its weights alone: `lightning-multids export` them and load them into the submodule."
        )


def save_weights(module: nn.Module, directory: Path, *, is_global_zero: bool, trained: bool = False) -> None:
    """Write ``module``'s whole ``state_dict`` to ``directory/weights.pt`` on rank 0; a collective call.

    ZeRO-3 parameters are gathered one at a time, so no rank holds more than one of them whole. Where the module
    is a ``trained`` engine's and its ZeRO-1/2/3 optimizer keeps an fp32 master copy beside 16-bit weights (bf16,
    fp16), a parameter is saved from that copy, as DeepSpeed's own checkpoint and :func:`export` give it (at
    ZeRO-0, DeepSpeed gives no such copy per parameter: the 16-bit weights are saved).
    """
    state = {}
    for key, value in module.state_dict(keep_vars=True).items():
        master = deepspeed.utils.safe_get_full_fp32_param(value) if trained and _has_master(value) else None
        with contextlib.nullcontext() if master is not None else whole([value]):
            if is_global_zero:
                state[key] = (value if master is None else master).detach().cpu().clone()
    if is_global_zero:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(state, directory / WEIGHTS_FILE)


def _has_master(value: torch.Tensor) -> bool:
    """Whether ``value`` is a trained parameter with an fp32 master copy in its engine's optimizer."""
    return isinstance(value, nn.Parameter) and value.requires_grad and value.dtype != torch.float32


def load_engines(
    path: Path,
    engines: Mapping[str, DeepSpeedEngine],
    saved: Mapping[str, Any],
    *,
    world_size: int,
    strict: bool,
    weights_only: bool | None,
    is_global_zero: bool,
    barrier: Callable[[str], None],
) -> None:
    """Load each engine's weights, optimizer and loss-scaler state from ``path``; a collective call.

    An engine saved as weights only (:func:`save_weights`) gets its weights. At a world size other than the
    checkpoint's (``saved``, its description), each ZeRO-1/2/3 engine loads DeepSpeed's universal checkpoint of
    its state (:func:`universal`); ZeRO-0 state is whole on every rank and loads as saved. This package's own
    reads honour ``weights_only``; DeepSpeed's do inside :func:`lightning_multids._loading.reading`.
    """
    restricted = loading.restricted(weights_only)
    for name, engine in engines.items():
        engine_dir = path / ENGINE_DIR / name
        if (engine_dir / WEIGHTS_FILE).is_file():
            load_weights(engine.module, loading.load(engine_dir / WEIGHTS_FILE, weights_only), strict=strict)
            continue
        saved_at = _saved_at(saved, engine_dir, weights_only=restricted)
        universal_load = bool(saved["engines"][name]["stage"]) and saved_at != world_size
        if universal_load:
            universal(engine_dir, is_global_zero=is_global_zero, barrier=barrier)
        with ds_compat.loading_universal(engine) if universal_load else contextlib.nullcontext():
            engine.load_checkpoint(
                str(engine_dir),
                tag=UNIVERSAL_TAG if universal_load else TAG,
                load_module_strict=strict,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,  # Lightning restores the schedulers
            )
        if universal_load:
            _load_buffers(engine.module, engine_dir, weights_only=restricted)


def load_plain_parts(
    path: Path, module: nn.Module, names: list[str], *, weights_only: bool | None, strict: bool
) -> None:
    """Load the weights-only parts ``names`` (frozen and EMA engines when saved) into submodules that are plain now.

    As DDP restores a whole module: a saved average or frozen teacher whose submodule is no engine in this run
    (no ``ema=``, no ``engine_configs`` entry) gets its saved weights, not its initial ones. A part whose submodule
    is gone is a ValueError with strict loading, as an unexpected key is.
    """
    for name in names:
        target = getattr(module, name, None)
        if not isinstance(target, nn.Module):
            if strict:
                raise ValueError(
                    f"The checkpoint {str(path)!r} holds the weights of the submodule {name!r}, which this "
                    "LightningModule does not have. Load it into the module it was saved from, or pass "
                    "`strict_loading=False` on the module."
                )
            continue
        load_weights(target, loading.load(path / ENGINE_DIR / name / WEIGHTS_FILE, weights_only), strict=strict)


def _saved_at(saved: Mapping[str, Any], engine_dir: Path, *, weights_only: bool) -> int:
    """The world size a checkpoint was saved at; for one saved before it was recorded, DeepSpeed's own record."""
    if "world_size" in saved:
        return int(saved["world_size"])
    return ds_compat.saved_world_size(engine_dir / TAG, weights_only=weights_only)


def _load_buffers(module: nn.Module, engine_dir: Path, *, weights_only: bool) -> None:
    """Copy the module's saved buffers (BatchNorm's statistics, counters) back in after a universal load.

    DeepSpeed's universal checkpoint restores parameters only (from ``universal/zero/``): it skips the module
    ``state_dict``, so without this every buffer would keep its value from ``__init__``.
    """
    saved = ds_compat.saved_module_state(engine_dir / TAG, weights_only=weights_only)
    for name, buffer in module.named_buffers():
        if name in saved:
            buffer.copy_(saved[name])


def universal(engine_dir: Path, *, is_global_zero: bool, barrier: Callable[[str], None]) -> Path:
    """``engine_dir/universal``: the engine's saved state as a universal checkpoint, made once; a collective call.

    Rank 0 converts into ``universal.partial`` and renames it when done, so a conversion killed midway is
    made again by the next resume, never loaded.
    """
    target = engine_dir / UNIVERSAL_TAG
    if is_global_zero and not target.is_dir():
        partial = engine_dir / f"{UNIVERSAL_TAG}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        ds_compat.to_universal(engine_dir / TAG, partial)
        partial.rename(target)
        (engine_dir / "latest_universal").write_text(UNIVERSAL_TAG)  # DeepSpeed's pointer named the .partial
    barrier("multids.universal")
    return target


def consolidated_state_dicts(
    path: str | Path, weights_only: bool | None = None, opt_out: str = loading.TRAINER_OPT_OUT
) -> dict[str, dict[str, torch.Tensor]]:
    """Every saved engine's weights as one fp32 ``state_dict`` each, plus ``"plain"`` for the other submodules.

    Works from any ZeRO stage and any world size, with no process group: ZeRO partitions are merged.
    Keys are relative to each submodule (``"0.weight"``), ready for ``submodule.load_state_dict``; an engine over
    several submodules (one optimizer over ``encoder`` and ``decoder``) gives one dict per submodule, by its name.
    Every file loads as ``weights_only`` says (``None``: torch's default, tensors and plain types only); a refused
    one is an ``UnpicklingError`` naming it and ``opt_out``, how to load it anyway.
    """
    with opened(path, weights_only, opt_out) as directory, loading.reading(directory, weights_only, opt_out):
        return _consolidated(directory, weights_only)


def _consolidated(path: Path, weights_only: bool | None) -> dict[str, dict[str, torch.Tensor]]:
    lightning = read_lightning_part(path, weights_only)
    result: dict[str, dict[str, torch.Tensor]] = {}
    for name, info in lightning[FORMAT_KEY]["engines"].items():
        engine_dir = path / ENGINE_DIR / name
        if info["stage"] is None:
            state = loading.load(engine_dir / WEIGHTS_FILE, weights_only)
        elif info["stage"] == 0:
            state = stage0_weights(engine_dir, TAG, weights_only=loading.restricted(weights_only))
        else:
            # DeepSpeed prints 4 lines per engine as it merges, and a "Loading checkpoint shards" bar on stderr
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                state = get_fp32_state_dict_from_zero_checkpoint(str(engine_dir), tag=TAG)
        state = {key: value.float() if value.is_floating_point() else value for key, value in state.items()}
        # an engine over several submodules: one dict per submodule, as if each were its own engine
        result.update(split_state(state, info["parts"]) if "parts" in info else {name: state})
    result[PLAIN] = dict(lightning["state_dict"])
    return result


def as_file(path: str | Path, weights_only: bool | None = None) -> io.BytesIO:
    """The checkpoint at ``path`` as one file in memory, for ``Model.load_from_checkpoint(as_file(path))``.

    ``Model.load_from_checkpoint`` opens one file: given a checkpoint directory, Lightning stops with its
    ``IsADirectoryError`` before any code of this package runs. It also takes a file object, and this is one:
    what ``export(path, out, format="lightning")`` writes to ``OUT/model.ckpt`` (every saved weight whole, keyed as
    in the LightningModule; the hyperparameters and the loops' progress; no optimizer state), built in memory, with
    no process group. ``path`` may also be a single-file checkpoint (``checkpoint_format="file"``), which
    ``load_from_checkpoint`` reads by itself. Loads as ``weights_only`` says (:func:`consolidated_state_dicts`).
    """
    with (
        opened(path, weights_only, AS_FILE_OPT_OUT) as directory,
        loading.reading(directory, weights_only, AS_FILE_OPT_OUT),
    ):
        lightning = read_lightning_part(directory, weights_only)
        states = _consolidated(directory, weights_only)
    buffer = io.BytesIO()
    torch.save(_one_file(lightning, states, torch.float32), buffer)
    buffer.seek(0)
    return buffer


def gathered_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every ZeRO-3 partition gathered; a collective call (also after fit).

    Each value is on the device its parameter's placeholder is on, as ``module.state_dict()`` would give it: the
    engine's device during fit, the CPU after it, where Lightning's teardown moves the module (as under DDP).
    """
    if not any(is_zero_param(param) for param in module.parameters()):
        return module.state_dict()
    placed = {key: value.device for key, value in module.state_dict().items()}
    with zero_deprecations_hidden(), whole(module.parameters()):  # after fit, torch would warn of ZeRO's gathers
        return {key: value.detach().to(placed[key], copy=True) for key, value in module.state_dict().items()}


def load_weights(module: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool) -> None:
    """``module.load_state_dict(state)``, also when ZeRO-3 holds ``module`` partitioned (a collective call then).

    The partitions are gathered, loaded on every rank, and rank 0's result is partitioned again.
    """
    partitioned = [param for param in module.parameters() if is_zero_param(param)]
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0, enabled=bool(partitioned)):
        module.load_state_dict(state, strict=strict)


def export(
    path: str | Path,
    out: str | Path,
    dtype: torch.dtype = torch.float32,
    format: str = "pt",  # noqa: A002 (the command line's --format)
    merge_lora: bool = False,
    weights_only: bool | None = None,
) -> list[Path]:
    """Write each engine of the checkpoint at ``path`` into ``out``: ``NAME.pt``, or a ``save_pretrained`` ``NAME/``.

    ``NAME.pt`` is a ``state_dict``; with ``format="hf"`` each engine holding a Hugging Face model gets a folder.
    With ``format="lightning"`` the whole checkpoint becomes one file, ``OUT/model.ckpt``, that
    ``Model.load_from_checkpoint("OUT/model.ckpt")`` loads as it loads a ``DDPStrategy`` checkpoint: every saved weight
    keyed as in the LightningModule, the hyperparameters and the loops' progress, as Lightning's weights-only
    checkpoint holds them (no optimizer, scheduler or callback state). Frozen engines the checkpoint did not save
    (``save_frozen=False``) are missing from it, with a warning.

    Load a ``NAME.pt`` into the plain module with ``module.load_state_dict(torch.load("OUT/generator.pt"))``; a
    ``NAME/`` folder with ``AutoModel...from_pretrained("OUT/actor")``, or for a PEFT model with
    ``PeftModel.from_pretrained(base, "OUT/actor")`` (its adapter), or ``from_pretrained`` again with
    ``merge_lora=True`` (the adapter merged into the base model). No DeepSpeed and no process group needed.
    ``OUT/plain.pt`` holds the remaining submodules' entries, keyed as in the LightningModule. Floating-point
    tensors are written in ``dtype`` (fp32 by default; ``torch.bfloat16`` or ``torch.float16`` for 16-bit weights).

    The checkpoint is read as ``torch.load`` reads with ``weights_only`` (``None``: torch's default, tensors and
    plain types only; the command line's ``--unsafe-load`` is ``False``), and unless it is ``False`` a Hugging Face
    model's class is imported only from transformers or a module already imported.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(
            f"export format {format!r}: choose 'pt' (state dicts), 'hf' (save_pretrained folders) or 'lightning' "
            "(one file for `Model.load_from_checkpoint`)."
        )
    with opened(path, weights_only, EXPORT_OPT_OUT) as directory:
        return _export(directory, Path(out), dtype, format, merge_lora, weights_only)


def _export(
    path: Path,
    out: Path,
    dtype: torch.dtype,
    format: str,  # noqa: A002
    merge_lora: bool,
    weights_only: bool | None,
) -> list[Path]:
    """:func:`export` of the checkpoint directory ``path`` (a single file's unpacked)."""
    with loading.reading(path, weights_only, EXPORT_OPT_OUT):
        lightning = read_lightning_part(path, weights_only)
        engines = lightning[FORMAT_KEY]["engines"]
        described = {name for name in engines if (path / ENGINE_DIR / name / huggingface.DESCRIPTION_DIR).is_dir()}
        if format == "hf" and not described:
            raise ValueError(
                f"No engine of {str(path)!r} holds a Hugging Face model (or the checkpoint was saved before "
                "lightning-multids described them): export it with the default format, as state dicts."
            )
        states = _consolidated(path, weights_only)
    out.mkdir(parents=True, exist_ok=True)
    if format == "lightning":
        target = out / LIGHTNING_EXPORT
        torch.save(_one_file(lightning, states, dtype), target)
        unsaved = sorted(set(lightning[FORMAT_KEY]["frozen"]) - set(engines))
        if unsaved:
            warnings.warn(
                f"{target} has no weights for the frozen engines {unsaved}: the checkpoint did not save them "
                "(`MultiDeepSpeedStrategy(save_frozen=False)`, the default). Load it with "
                "`Model.load_from_checkpoint(path, strict=False)`, which keeps their weights as the module builds "
                "them, or train with `save_frozen=True`.",
                stacklevel=2,
            )
        return [target]
    written = []
    trusted = not loading.restricted(weights_only)
    for name, state in states.items():
        if format == "hf" and name in described:
            target = out / name
            description = path / ENGINE_DIR / name / huggingface.DESCRIPTION_DIR
            huggingface.save_pretrained(description, state, target, dtype=dtype, merge_lora=merge_lora, trusted=trusted)
        else:
            target = out / f"{name}.pt"
            torch.save({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, target)
        written.append(target)
    return written


def _one_file(
    lightning: Mapping[str, Any],
    states: Mapping[str, dict[str, torch.Tensor]],
    dtype: torch.dtype,
    *,
    training_state: bool = False,
) -> dict:
    """Lightning's part with every engine's weights in its ``state_dict`` (keyed as in the module), one checkpoint.

    Without ``training_state``, as Lightning's weights-only checkpoint: no optimizer, scheduler or callback state,
    so that resuming a fit from it is refused by Lightning rather than starting the optimizers afresh from the
    saved step. With it, those keys stay (a single-file checkpoint, :func:`pack`).
    """
    merged = dict(states[PLAIN])
    for name, state in states.items():
        if name != PLAIN:
            merged.update({f"{name}.{key}": value for key, value in state.items()})
    dropped = {FORMAT_KEY} if training_state else {FORMAT_KEY, "optimizer_states", "lr_schedulers", "callbacks"}
    kept = {key: value for key, value in lightning.items() if key not in dropped}
    kept["state_dict"] = {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()}
    return kept


def plain_state_dict(module: nn.Module, engine_names: set[str]) -> dict[str, Any]:
    """The entries of ``module.state_dict()`` that belong to no engine (``engine_names``: every submodule held)."""
    return {k: v for k, v in module.state_dict().items() if k.split(".", 1)[0] not in engine_names}
