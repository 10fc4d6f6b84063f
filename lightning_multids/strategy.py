"""``MultiDeepSpeedStrategy``: Lightning hooks only; the work lives in the modules they call."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import deepspeed
import lightning.pytorch as pl
import torch
from deepspeed import DeepSpeedEngine
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_multids import _accelerator as ds_accelerator
from lightning_multids import _loading as loading
from lightning_multids import checkpoint as checkpoints
from lightning_multids._blocks import (
    Arrival,
    check_modifier_rank,
    gathered,
    keep_edits,
    no_sync,
    note_partitioned_use,
    offloaded,
)
from lightning_multids._compat import deepspeed as ds_compat
from lightning_multids._compat import torch as torch_compat
from lightning_multids._compat.lightning import (
    apply_layer_sync,
    forget_requested,
    process_group_backend,
    should_accumulate,
    store_precision_plugin,
    stored_precision_plugin,
    trainer_of,
)
from lightning_multids._config import load_config, merge, validate_stage, zero3_init_config, zero_stage
from lightning_multids._discovery import check_engine_names
from lightning_multids._ema import EmaArgument, average_entries, check_average_names, parse_averages
from lightning_multids._engines import EngineSet
from lightning_multids._environment import keep_extensions_in_environment, set_launch_variables
from lightning_multids._gradients import refuse_engine_clipping
from lightning_multids._lifecycle import (
    agree_on_failure,
    build_engines,
    build_evaluation_engines,
    is_partitioned,
    release_engines,
    sync_replicated_states,
    zero3_init,
    zero3_on_device,
)
from lightning_multids._model_summary import count_partitioned
from lightning_multids._noise import drop_lightning_tips_for, hide_upstream_warnings, show_lightning_tips_of
from lightning_multids._planning import check_clip_algorithm, optimizer_class, warn_clipping_overrides
from lightning_multids._precision import EnginePrecision

log = logging.getLogger(__name__)
UNWATCHED_CALLERS = ("deepspeed.", "lightning_multids.", "torch.")
"""Modules whose collectives never edit the weights behind the strategy's back (DeepSpeed's, the package's, torch's)."""
__all__ = ["MultiDeepSpeedStrategy"]


class MultiDeepSpeedStrategy(DDPStrategy):
    """Give each submodule of a LightningModule its own DeepSpeed engine, ZeRO stage, optimizer and scheduler.

    Each optimizer from ``configure_optimizers`` is matched to the submodule whose parameters it holds,
    and that submodule gets a DeepSpeed engine built with it. With several optimizers the module runs
    manual optimization (switched on here if the module did not); ``self.manual_backward(loss)`` runs
    the backward prologue and epilogue of every engine ``loss`` reaches, once each.

    Args:
        stage: the default ZeRO stage (0-3) of every engine.
        config: the default DeepSpeed config of every engine: a dict or a path to a JSON file.
        engine_configs: per-submodule overrides merged over ``config``, keyed by the submodule's attribute name
            on the LightningModule, each a dict or a path to a JSON file,
            e.g. ``{"discriminator": {"zero_optimization": {"stage": 3}}}``.
        accelerator: the accelerator (set by the Trainer).
        parallel_devices: the devices of this node (set by the Trainer).
        cluster_environment: how processes find each other (set by the Trainer, or e.g. ``SLURMEnvironment()``).
        checkpoint_io: not supported: each engine writes its own part of a checkpoint (an error if given).
        precision_plugin: ignored beyond its precision flag: each engine runs its precision from its config.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default gloo on CPU and nccl on CUDA.
        timeout: the timeout of collective operations.
        start_method: how Lightning starts the other processes (``"popen"`` re-runs the script per rank).
        save_frozen: also save frozen engines in every checkpoint (their weights do not change during fit, so
            by default they are not duplicated into each one). A single file (``checkpoint_format="file"``) always
            holds them, as DDP's holds every weight: ``load_from_checkpoint`` of it is strict by default.
        ema: EMA engines, ``{average: (source, decay)}``, e.g. ``{"generator_ema": ("generator", 0.999)}``: the
            submodule ``self.generator_ema`` (a copy of ``self.generator``) becomes a frozen fp32 engine at its own
            stage (its ``engine_configs`` entry), starts as a copy of its source and follows each of its steps as
            ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn(decay)`` would. Saved with every
            checkpoint and resumed (see :mod:`lightning_multids._ema`).
        gathered_timeout: how long :meth:`gathered` of a ZeRO-3 engine (or with ``modifier_rank`` at any stage)
            waits for every rank to enter it before it raises, instead of waiting in its collectives for ``timeout``;
            separate from ``timeout``, so raise it too where ranks reach a block further apart. ``None`` turns the
            check off (a gloo group, made at the first such block of a fit on several ranks, and one small all-gather
            per block).
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm's running statistics) to every rank before a
            ``training_step`` or ``validation_step`` during fit where ``DDPStrategy(broadcast_buffers=True)``, its
            default, does: before the sanity check; each step in automatic optimization but those after an
            accumulating batch or a validation, and a validation after steps; in manual optimization the fit's
            first step only (Lightning leaves DDP's next forward unsynced after each manual ``training_step``). One
            coalesced broadcast where the module has buffers. As under DDP, which looks for buffers when
            it wraps the module, a module with none at the strategy's setup (after ``configure_model``; buffers
            named in ``_ddp_params_and_buffers_to_ignore`` do not count) has none broadcast in that fit; where it has
            some, buffers added or replaced later are broadcast too. ``False`` lets each rank keep its own.
        find_unused_parameters: for losses whose reach differs between ranks, as ``DDPStrategy``'s option of that
            name: an engine reached on some ranks only, or parameters of a ZeRO-2/3 engine that a loss leaves
            without a gradient. The ranks then compare after each backward what each one reached (one all-reduce
            and a read of its result, per backward) and even the gradients out; ZeRO-3 engines are checked before
            it (a walk of the graph and one more all-reduce). By default a backward runs no collective of the
            strategy's own: every rank must reach the same engines, and ZeRO-2/3 engines in full (ZeRO-0/1 fill
            unreached parameters with zero gradients by themselves).
        elementwise_optimizers: optimizer classes (or their import paths, ``"my_package.MyAdam"``) to train at
            ZeRO-1/2/3 beside the element-wise ones the strategy knows (``torch.optim``'s SGD, Adam, AdamW, ...,
            DeepSpeed's ``FusedAdam``/``DeepSpeedCPUAdam``...). There DeepSpeed steps an optimizer over flat
            partitions of the engine's parameters, which gives ``torch.optim``'s result only for an optimizer that
            updates each element from that element alone; any other (Adafactor, LAMB, Muon) is refused at setup.
        checkpoint_format: what ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write, as ``FSDPStrategy``'s
            ``state_dict_type`` chooses: ``"directory"`` (the default), one part per engine, each rank writing its
            ZeRO partitions; or ``"file"``, one file that ``torch.load`` and ``Model.load_from_checkpoint`` read,
            written by rank 0, with the whole weights under ``state_dict`` and the engines' parts inside it for an
            exact resume (see docs/checkpoints.md). Either format loads, whatever this setting.
    """

    strategy_name = "multi_deepspeed"

    def __init__(
        self,
        stage: int = 2,
        config: dict[str, Any] | str | None = None,
        engine_configs: dict[str, dict[str, Any] | str] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        save_frozen: bool = False,
        ema: EmaArgument | None = None,
        gathered_timeout: timedelta | None = timedelta(minutes=5),
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        elementwise_optimizers: Sequence[type[Optimizer] | str] = (),
        checkpoint_format: Literal["directory", "file"] = "directory",
    ) -> None:
        _refuse_checkpoint_io(checkpoint_io)
        _check_checkpoint_format(checkpoint_format)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.stage = validate_stage(stage, what="MultiDeepSpeedStrategy(stage=...)")
        self.config = load_config(config, what="every engine (`config=`)")
        per_engine = {} if engine_configs is None else engine_configs
        if not isinstance(per_engine, Mapping):
            raise ValueError(
                f"MultiDeepSpeedStrategy(engine_configs=...) got a {type(per_engine).__name__} ({per_engine!r}); "
                'it maps each submodule\'s name to its DeepSpeed config, e.g. {"generator": "configs/generator.json"}. '
                "For one config for every engine, pass `config=` instead."
            )
        self.engine_configs = {
            name: load_config(source, what=f"the engine {name!r}") for name, source in per_engine.items()
        }
        _refuse_zero3_launched_in_process(start_method, self.stage, self.config, self.engine_configs)
        self.save_frozen = save_frozen
        self.checkpoint_format = checkpoint_format
        self.gathered_timeout = gathered_timeout
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.elementwise_optimizers = [optimizer_class(kind) for kind in elementwise_optimizers]
        self._buffers_due = True
        """Whether the next ``training_step`` starts from rank 0's buffers (not within an accumulation window)."""
        self._buffers_to_sync = False
        """Whether this fit runs on several ranks and its module had buffers to sync at setup (as DDP)."""
        self._arrival: Arrival | None = None
        self.averages = parse_averages(ema)
        self._entries = average_entries(self.averages, self.engine_configs)
        self._engine_set = EngineSet()
        self._fitted: EngineSet | None = None
        """The last fit's engines from its teardown to :meth:`release`: stopped, kept for ``save_checkpoint``."""
        self._failed = False
        self._loading: _Loading | None = None
        """A checkpoint whose Lightning part was read before setup: setup loads the rest once the engines exist."""
        self._restore_summary: Callable[[], None] = _nothing
        self._show_upstream_warnings: Callable[[], None] = _nothing
        # Lightning's install tips come at `Trainer(...)` and at fit's start, after this and before any hook of the
        # strategy: dropped from here to the teardown, or until the strategy is collected if no fit tears it down.
        drop_lightning_tips_for(self)
        self._unguard_gradients: Callable[[], None] = _nothing
        self._unset_extensions_dir: Callable[[], None] = _nothing
        self._unset_launch_variables: Callable[[], None] = _nothing

    @property
    def engines(self) -> dict[str, DeepSpeedEngine]:
        """The DeepSpeed engines, keyed by submodule name, in optimizer order.

        From setup to teardown, the running engines. After a ``fit`` that ended without an exception, and until
        the next setup or :meth:`release`, that fit's engines: stopped (their hooks are off the modules), kept for
        ``trainer.save_checkpoint``. Stopped, they no longer answer DeepSpeed's per-parameter reads
        (``safe_get_full_optimizer_state`` gives zeros at ZeRO-1/2 and fails at ZeRO-3): read those in
        ``on_train_end`` at the latest.
        """
        if not self._engine_set.engines and self._fitted is not None:
            return dict(self._fitted.engines)
        return dict(self._engine_set.engines)

    def release(self) -> None:
        """Free the engines a ``fit`` keeps after it ends (optimizer states, DeepSpeed's buffers); no collective.

        ``trainer.save_checkpoint`` then needs a new ``fit``. The next ``fit``, ``validate``, ``test`` or
        ``predict`` releases them first anyway, and so does an exception in a later ``fit``. ``self.optimizers()``
        answers with nothing after it: the optimizers hold the engines' optimizer states.
        """
        if self._fitted is not None:
            self._fitted = None
            self.optimizers, self.lr_scheduler_configs = [], []
            gc.collect()  # DeepSpeed's engines hold reference cycles: free their memory now, not at some later GC

    @property  # type: ignore[override]
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's default checkpoint IO, used only to remove old checkpoint directories."""
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        # Lightning's connector sets a CheckpointIO from `Trainer(plugins=...)` here.
        _refuse_checkpoint_io(io)

    # ---- precision: Lightning hands us its plugin; keep only the flag --------------------------------

    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        """The strategy's precision plugin (an :class:`EnginePrecision`)."""
        plugin = stored_precision_plugin(self)
        return plugin if plugin is not None else EnginePrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # None stays None, so that Lightning's connector still hands us the plugin for the Trainer's flag.
        if plugin is not None and not isinstance(plugin, EnginePrecision):
            flag, device = getattr(plugin, "precision", "32-true"), getattr(plugin, "device", "cpu")
            plugin = EnginePrecision(str(flag), str(device))
        store_precision_plugin(self, plugin)

    # ---- set-up ---------------------------------------------------------------------------------------

    @override
    def setup_distributed(self) -> None:
        """Check DeepSpeed, point it at Lightning's accelerator, start torch.distributed as DDP does, share the group.

        DDP chooses the process group backend from the device (gloo on CPU, nccl on CUDA); DeepSpeed's comm
        layer and engines then run on the same accelerator as Lightning, and DeepSpeed reads Lightning's ranks from
        ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (set from the cluster environment, for launchers that set none of
        them, such as ``srun``). Until :meth:`teardown`, DeepSpeed's
        JIT-built ops go to a folder of this environment unless ``TORCH_EXTENSIONS_DIR`` is set
        (:func:`~lightning_multids._environment.keep_extensions_in_environment`).
        """
        ds_compat.check_deepspeed()
        self._unset_extensions_dir()  # a start after one whose teardown did not run
        self._unset_extensions_dir = keep_extensions_in_environment()
        ds_accelerator.follow(self.root_device.type)
        ds_compat.forget_destroyed_groups()  # a fit after `torch.distributed.destroy_process_group()`
        super().setup_distributed()
        self._unset_launch_variables()  # a start after one whose teardown did not run
        self._unset_launch_variables = set_launch_variables(  # srun, jsrun, Kubeflow and MPI set no LOCAL_RANK
            rank=self.global_rank, world_size=self.world_size, local_rank=self.local_rank
        )
        backend = process_group_backend(self)
        with ds_compat.comm_without_inference_op():  # a CPU op only inference uses: not built
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Set up as ``DDPStrategy.setup`` does, with DeepSpeed engines where DDP wraps the module.

        The accelerator; when fitting, the ``sync_batchnorm`` conversion, one engine per optimizer and frozen
        engines (``lifecycle.build_engines``), then the rest of the module to the device; otherwise the module to
        the device, rank 0's weights and buffers to every rank, as DDP syncs module states outside fit, and one
        inference engine per ZeRO-3 submodule. Last, the precision plugin. :meth:`teardown` undoes it in reverse.
        One step differs from DDP's order: when fitting, each engine's submodule reaches the device through
        DeepSpeed, after DeepSpeed casts it to the engine's dtype. Moved first, a bf16 engine's submodule would
        be whole on the device in fp32 (twice its bf16 size) before the cast; Lightning's ``DeepSpeedStrategy``
        also leaves the move to DeepSpeed.
        """
        assert self.accelerator is not None and self.model is not None
        self.release()  # the last fit's engines, before building new ones
        self._unguard_gradients()  # a setup after one whose teardown did not run
        self._unguard_gradients = _nothing
        self._failed = False
        self._buffers_due = True
        self._show_upstream_warnings()  # a setup after one whose teardown did not run
        self._show_upstream_warnings = hide_upstream_warnings()
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.model = apply_layer_sync(self, self.model)
        module = self.lightning_module
        assert module is not None
        check_engine_names(module, self.engine_configs)
        check_average_names(self.averages, module)
        if fitting:
            checkpoints.check_checkpoint_dirs(trainer.checkpoint_callbacks)
            self._setup_fit(trainer, module)
            self.model_to_device()  # the plain submodules: the engines' ones are on the device already
            # As DDP, which holds its module's buffers when it wraps it and syncs none in a fit if it had none then:
            # no walk of the modules per step for a module without buffers.
            self._buffers_to_sync = self.world_size > 1 and bool(torch_compat.synced_buffers(module))
        else:
            self.model_to_device()
            sync_replicated_states(module)
            self._engine_set = build_evaluation_engines(
                module,
                default=self.config,
                overrides=self._entries,
                precision=str(self.precision_plugin.precision),
                device=self.root_device,
            )
        self.setup_precision_plugin()
        self._start_arrival()
        self._finish_loading()

    def _start_arrival(self) -> None:
        """The check-in of :meth:`gathered` (a ZeRO-3 engine's gathering, an edit's broadcasts), on several ranks."""
        self._stop_arrival()  # a setup whose teardown did not run: every rank makes a new one alike
        if self.world_size > 1 and self.gathered_timeout is not None and self._engine_set.engines:
            self._arrival = Arrival(self.gathered_timeout)

    def _stop_arrival(self) -> None:
        if self._arrival is not None:
            self._arrival.close()
            self._arrival = None

    def _setup_fit(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        check_clip_algorithm(trainer)
        self._engine_set = build_engines(
            trainer,
            module,
            stage=self.stage,
            default=self.config,
            overrides=self._entries,
            precision=str(self.precision_plugin.precision),
            device=self.root_device,
            agree=functools.partial(
                agree_on_failure, world_size=self.world_size, rank=self.global_rank, device=self.root_device
            ),
            averages=self.averages,
            find_unused=self.find_unused_parameters,
            elementwise=self.elementwise_optimizers,
        )
        if not module.automatic_optimization:  # Lightning clips through configure_gradient_clipping otherwise
            self._engine_set.clip_by_default(trainer.gradient_clip_val, self.config, self.engine_configs)
        warn_clipping_overrides(module, self._engine_set.trainable_engines)
        stages = {name: e.zero_optimization_stage() for name, e in self._engine_set.trainable_engines.items()}
        self._unguard_gradients = torch_compat.guard_gradient_clipping(
            refuse_engine_clipping(self._engine_set.owners, stages)
        )
        self._unguard_gradients = _chain(self._unguard_gradients, self._engine_set.guard_parameters())
        if any(record.keeps_master for record in self._engine_set.trainable):  # edits to carry to a master copy
            watch = torch_compat.watch_collective_writes(self._engine_set.note_collective_write, UNWATCHED_CALLERS)
            self._unguard_gradients = _chain(self._unguard_gradients, watch)
        self.optimizers = list[Optimizer](self._engine_set.optimizers)
        self.lr_scheduler_configs = self._engine_set.scheduler_configs
        self._restore_summary = count_partitioned(trainer, self._engine_set.engines)  # before on_fit_start

    @override
    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Build ``configure_model``'s submodules already partitioned when some engine is ZeRO-3.

        ``zero.Init`` partitions every module created inside it; at setup, the submodules whose engine
        turns out not to be ZeRO-3 (and plain submodules) are made whole again before any optimizer holds
        them. So a ZeRO-3 teacher never exists whole in one process, while a ZeRO-2 student beside it
        ends up whole, as its engine expects. ``zero.Init`` gets the ZeRO-3 engines' config (dtype,
        ``offload_param``), which they must share (see :func:`~lightning_multids._config.zero3_init_config`).
        """
        config = zero3_init_config(
            self.stage, self.config, self._entries, precision=str(self.precision_plugin.precision)
        )
        if config is None or not zero3_on_device(self.root_device):  # setup refuses the latter, on every rank
            yield
            return
        with zero3_init(config):
            yield

    @override
    def model_to_device(self) -> None:
        """Move the LightningModule (its plain submodules included) to this process's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- training ------------------------------------------------------------------------------------

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Backpropagate ``closure_loss`` inside the prologue/epilogue of every engine it reaches.

        The steps and hooks of Lightning's ``Strategy.backward``, with only the backward itself routed: the
        engines' epilogues (ZeRO-2/3 reduce there) have run when ``on_after_backward`` is called, so a hook or
        callback that reads ``full_gradients`` there sees this backward's gradients, as under ``DDPStrategy``.
        """
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self._engine_set.backward(closure_loss) as loss:
            self.precision_plugin.backward(loss, module, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def no_sync(self, *names: str) -> Iterator[None]:
        """Defer the gradient reduction of the named trainable engines (all when none are named) to the block's end.

        Every backward inside the block accumulates gradients locally; when the block ends each engine
        reduces once, at every ZeRO stage, as with DDP's ``no_sync`` followed by a synchronizing backward.
        Call it on every rank, with the same names, and step the optimizers after it::

            with self.trainer.strategy.no_sync("query_encoder", "doc_encoder"):
                for chunk in chunks:
                    self.manual_backward(loss_of(chunk))
            opt.step()

        At ZeRO-2/3 the engine holds a whole, unpartitioned gradient per rank during the block (what
        ZeRO-1 holds anyway); at stages 0/1 reduction already happens once per step, in ``step()``.
        """
        with no_sync(self._engine_set.for_no_sync(self._engine_set.engine_names(names))):
            yield

    @contextmanager
    def gathered(self, name: str, modifier_rank: int | None = None) -> Iterator[torch.nn.Module]:
        """Make the ZeRO-3 engine ``name``'s submodule whole for the block (generation, evaluation, edits); yield it.

        ZeRO-3 gathers a submodule layer by layer at each forward, so an autoregressive loop gathers the whole
        model once per token. Inside the block it is gathered once and runs as a plain module, under
        ``torch.no_grad()``; it is partitioned again when the block ends. Call it on every rank (a collective)::

            with self.trainer.strategy.gathered("actor") as actor:
                sequences = actor.generate(prompts, length)

        The whole submodule, in its engine's dtype, is on every rank during the block. At ZeRO-0/1/2 it is whole
        anyway and only ``no_grad`` applies; so it is under ``validate``/``test``/``predict``, where only ZeRO-3
        submodules get an engine and the others are plain.

        By default the block is for reading: a change to the weights inside it is dropped when the block ends (and
        what ``trainer.save_checkpoint`` writes inside it is what the block holds then). With ``modifier_rank=r``
        (as DeepSpeed's ``GatheredParameters``) it is for editing weights between steps, at any stage: when the
        block ends without an exception, rank ``r``'s weights become every rank's and the optimizer's fp32 master
        copy takes them, so the next step trains from them (in bf16, the elements the edit left unchanged keep
        their fp32 values). At ZeRO-3 this is the way to edit weights (a clamp, a normalisation,
        ``load_state_dict``) between steps: outside ``forward`` and this block each parameter is an empty
        partition, and an in-place edit of it changes nothing::

            with self.trainer.strategy.gathered("critic", modifier_rank=0) as critic:
                for param in critic.parameters():
                    param.clamp_(-0.01, 0.01)
        """
        engines = self._engine_set
        plain = None if name in engines.engines else self._whole_outside_fit(name)
        if plain is not None:  # validate/test/predict build engines for ZeRO-3 submodules only
            check_modifier_rank(name, modifier_rank)
            with torch.no_grad():
                yield plain
                if modifier_rank is not None:
                    keep_edits(plain, modifier_rank, trained=False)
            return
        engine_name, part = engines.engine_of(name)  # a part of an engine over several: that engine, gathered
        with gathered(engine_name, engines.records, self._arrival, modifier_rank=modifier_rank) as module:
            yield module if part is None else module.get_submodule(part)

    def _whole_outside_fit(self, name: str) -> torch.nn.Module | None:
        """The LightningModule's whole submodule ``name`` during validate, test or predict; None otherwise."""
        module = self.lightning_module
        if module is None or trainer_of(module) is None or module.trainer.state.fn == TrainerFn.FITTING:
            return None
        child = getattr(module, name, None)
        return child if isinstance(child, torch.nn.Module) and not is_partitioned(child) else None

    @contextmanager
    def offloaded(self, *names: str) -> Iterator[None]:
        """Move the named trainable engines' states off the device for the block, and back when it ends.

        Optimizer states, fp32 master weights, the engine's own weights and gradient buffers go to host memory
        (DeepSpeed's ``engine.offload_states()``; ``reload_states()`` after), e.g. the critic's while the actor
        generates::

            with self.trainer.strategy.offloaded("critic"), self.trainer.strategy.gathered("actor") as actor:
                sequences = actor.generate(prompts, length)

        Inside the block the engine can neither run nor step (an error says so). DeepSpeed 0.19.8 moves the states
        of ZeRO-1/2 engines, and of ZeRO-3 ones only with its ``FusedAdam``; other engines are refused, naming
        the engine and why.
        """
        with offloaded(self._engine_set.engine_names(names), self._engine_set.records):
            yield

    def full_gradients(self, name: str) -> dict[str, Tensor]:
        """The gradients of engine ``name``, whole and averaged over the ranks, as plain PyTorch would hold them.

        Call it between ``self.manual_backward(loss)`` and ``opt.step()``, on every rank (a collective): at
        ZeRO-2/3 ``param.grad`` is None there, since DeepSpeed keeps only this rank's reduced partition::

            self.manual_backward(loss)
            grads = self.trainer.strategy.full_gradients("generator")  # {"0.weight": tensor, ...}
            self.log("grad_norm", torch.stack([g.norm() for g in grads.values()]).norm())

        Keys are parameter names within the submodule; values are fp32 tensors (fp16 loss scaling undone).
        """
        return self._engine_set.full_gradients(name)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``training_step`` from rank 0's buffers (``broadcast_buffers``); refuse a module that can never train."""
        self._sync_buffers_where_ddp_does(training=True)
        output = super().training_step(*args, **kwargs)
        self._engine_set.check_loss_was_used(output)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``validation_step`` during fit from rank 0's buffers where DDP would (``broadcast_buffers``)."""
        self._sync_buffers_where_ddp_does(training=False)
        return super().validation_step(*args, **kwargs)

    def _sync_buffers_where_ddp_does(self, training: bool) -> None:
        """Broadcast rank 0's buffers before a step's forward where ``DDPStrategy`` would, and mark the next one.

        During fit Lightning runs ``training_step`` and ``validation_step`` through DDP's forward, which broadcasts
        the buffers where the forward before it (or none yet, in this fit) ran with gradients and DDP's gradient sync
        on: so before the sanity check; in automatic optimization, before each step but those after an
        accumulating batch (under ``no_sync``) or a validation; in manual optimization, before the fit's first step
        only, since Lightning turns DDP's gradient sync off after each manual ``training_step``
        (``_DDPForwardRedirection``). ``validate`` outside fit does not run through DDP's forward.
        """
        module = self.lightning_module
        if module is None or not (self.broadcast_buffers and self._buffers_to_sync):
            return
        if not training and module.trainer.state.fn != TrainerFn.FITTING:
            return
        if self._buffers_due:
            torch_compat.broadcast_buffers(module)
        self._buffers_due = (
            training
            and torch.is_grad_enabled()
            and module.automatic_optimization
            and not should_accumulate(module.trainer)
        )

    @override
    def on_validation_start(self) -> None:
        """Clear every engine's gradients where Lightning clears the module's before validating during fit.

        Lightning's ``on_validation_model_zero_grad`` hook calls ``module.zero_grad()``, which reaches
        ``param.grad`` but not what ZeRO-2/3 already reduced into partitions. When that hook is Lightning's
        own and the loop is not between accumulation steps, every engine is cleared as ``opt.zero_grad()``
        would; an overridden hook decides for itself (call ``opt.zero_grad()`` there to clear an engine).
        """
        super().on_validation_start()
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if module is None or trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return
        default_hook = type(module).on_validation_model_zero_grad is pl.LightningModule.on_validation_model_zero_grad
        if default_hook and not should_accumulate(trainer):
            self._engine_set.clear_gradients()

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Step one engine through the precision plugin (runs the closure and the optimizer hooks)."""
        module = model if isinstance(model, pl.LightningModule) else self.lightning_module
        assert module is not None
        return self.precision_plugin.optimizer_step(optimizer, model=module, closure=closure, **kwargs)

    # ---- checkpoints ---------------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore before setup, as DDP does: Lightning passes ``weights_only`` only then (2.6.6, as on its master).

        :meth:`load_checkpoint` reads Lightning's part; :meth:`setup` loads the engines' parts and the plain
        submodules' weights once the engines exist (:meth:`_finish_loading`).
        """
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict as it is on this rank (ZeRO-3 parameters stay partitioned)."""
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The module's full state dict, gathering ZeRO-3 partitions; every rank must call it (during or after fit)."""
        assert self.lightning_module is not None
        return checkpoints.gathered_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Tensor]:
        """Nothing here: each engine's checkpoint part holds its optimizer state."""
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write the checkpoint ``filepath`` atomically: Lightning's part and one part per engine.

        A directory, or with ``checkpoint_format="file"`` that directory packed into one file by rank 0.
        """
        if storage_options is not None:
            raise TypeError("MultiDeepSpeedStrategy writes checkpoints itself: `storage_options` is not used.")
        assert self.lightning_module is not None
        engine_set = self._engine_set if self._engine_set.trainable_engines else self._fitted
        if engine_set is None:
            raise RuntimeError(
                "MultiDeepSpeedStrategy saves checkpoints from the engines of a fit: each engine writes its own part. "
                "There are none now: no fit has run, its engines were released (`strategy.release()`, or a "
                "`validate`/`test`/`predict` since), or it ended in an exception. Save during or right after "
                "`trainer.fit(...)`, or with a `ModelCheckpoint` callback."
            )
        filepath = checkpoints.local_path(self.broadcast(str(filepath)), "`trainer.save_checkpoint`'s path")
        engines, frozen = engine_set.engines, engine_set.frozen_names()
        single = self.checkpoint_format == "file"
        # One file holds every weight, as DDP's: Lightning's `load_from_checkpoint` of it is strict by default.
        saved = engine_set.saved_names(self.save_frozen or single)
        if engine_set is self._engine_set:  # edits since the last step, in the weights as DDP saves them; after
            engine_set.take_weight_edits()  # fit, teardown took them before it released the engines
        averager = engine_set.averager
        # Lightning dumps no optimizer states for `save_weights_only=True` / `weights_only=True`: every engine's
        # weights alone, as DDP writes the module's state dict alone.
        as_weights = set(saved) if "optimizer_states" not in checkpoint else frozen
        directory = Path(filepath + checkpoints.PACKING) if single else Path(filepath)
        checkpoints.save(
            checkpoint,
            directory,
            engines={n: engines[n] for n in saved if n not in as_weights},
            weights={n: engines[n].module for n in saved if n in as_weights},
            frozen=frozen,
            averages=averager.state() if averager is not None else {},
            plain_state=checkpoints.plain_state_dict(self.lightning_module, engine_set.held_names()),
            world_size=self.world_size,
            is_global_zero=self.is_global_zero,
            barrier=self.barrier,
        )
        if single:
            optimizers = [(optimizer.name, optimizer) for optimizer in engine_set.optimizers]
            layout = checkpoints.optimizer_layout(optimizers, {n: e.module for n, e in engines.items()})
            checkpoints.pack(
                directory, Path(filepath), layout=layout, is_global_zero=self.is_global_zero, barrier=self.barrier
            )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read Lightning's part of the checkpoint; the engines' parts load at setup (all state when fitting).

        Every file loads as ``torch.load`` with ``weights_only`` would (``None``: torch's default, tensors and plain
        types only), DeepSpeed's too (see :mod:`lightning_multids._loading`), as under Lightning's own strategies.
        """
        given = checkpoints.local_path(self.broadcast(str(checkpoint_path)), "The checkpoint path")
        unpacked = checkpoints.unpacked(given, weights_only)  # one file: each rank unpacks it into a directory
        path = checkpoints.resolve(given) if unpacked is None else Path(unpacked.name)
        try:
            with loading.reading(path, weights_only):
                lightning = checkpoints.read_lightning_part(path, weights_only)
        except BaseException:
            _remove(unpacked)
            raise
        shown = path if unpacked is None else Path(given)  # errors name the user's file, not where it was unpacked
        self._loading = _Loading(path, lightning[checkpoints.FORMAT_KEY], weights_only, unpacked, shown)
        if self._engine_set.engines:  # called after setup (by hand): load now
            self._finish_loading()
        return lightning

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the plain submodules' weights at setup with the engines' (they may be partitioned until then)."""
        assert self.lightning_module is not None
        if self._loading is None:
            self._load_plain(checkpoint["state_dict"], strict)
        else:
            self._loading.plain, self._loading.strict = checkpoint["state_dict"], strict

    def _finish_loading(self) -> None:
        """Load the checkpoint :meth:`load_checkpoint` read into the engines and the plain submodules."""
        pending, self._loading = self._loading, None
        if pending is None:
            return
        try:
            with loading.reading(pending.path, pending.weights_only, look=False):  # load_checkpoint looked
                self._load_engines(pending)
        finally:
            _remove(pending.unpacked)
        if pending.plain is not None:
            self._load_plain(pending.plain, pending.strict)

    def _load_engines(self, pending: _Loading) -> None:
        """Load the engines' parts; an unpacked single file is each rank's own copy, converted by that rank."""
        path, saved, weights_only = pending.path, pending.saved, pending.weights_only
        shown = pending.shown or path
        module = self.lightning_module
        assert module is not None
        trainable = self._engine_set.trainable_engines
        if not trainable:  # validate, test, predict: the weights, into the submodules
            for name, state in checkpoints.consolidated_state_dicts(path, weights_only).items():
                if name != "plain":
                    checkpoints.load_weights(getattr(module, name), state, strict=module.strict_loading)
            return
        check_names = {n: saved["engines"][n] for n in saved["engines"] if n not in saved["frozen"]}
        checkpoints.check_engines({"engines": check_names}, trainable, shown)
        engines = {n: e for n, e in self._engine_set.engines.items() if n in saved["engines"]}
        checkpoints.check_stages(saved, engines, shown)
        checkpoints.check_precisions(saved, engines, shown)
        checkpoints.load_engines(
            path,
            engines,
            saved,
            world_size=self.world_size,
            strict=module.strict_loading,
            weights_only=weights_only,
            is_global_zero=self.is_global_zero or pending.unpacked is not None,  # who converts it to another size
            barrier=self.barrier,
        )
        plain_parts = [n for n, i in saved["engines"].items() if i["stage"] is None and n not in engines]
        checkpoints.load_plain_parts(path, module, plain_parts, weights_only=weights_only, strict=module.strict_loading)
        if self._engine_set.averager is not None:  # an average the checkpoint lacks restarts from its source
            self._engine_set.averager.load_state(saved.get("averages", {}))

    def _load_plain(self, state: Mapping[str, Any], strict: bool) -> None:
        """Load the plain submodules' entries; one ZeRO-3 holds partitioned (outside fit) is gathered for it."""
        module = self.lightning_module
        assert module is not None
        partitioned = {name for name, child in module.named_children() if is_partitioned(child)}
        for name in partitioned:
            own = {k.split(".", 1)[1]: v for k, v in state.items() if k.split(".", 1)[0] == name}
            if own:
                checkpoints.load_weights(getattr(module, name), own, strict=strict)
        rest = {k: v for k, v in state.items() if k.split(".", 1)[0] not in partitioned}
        result = module.load_state_dict(rest, strict=False)
        if strict and result.unexpected_keys:
            raise ValueError(
                f"The checkpoint has weights for {result.unexpected_keys[:5]}, which this LightningModule does not "
                "have. Load it into the module it was saved from, or pass `strict_loading=False` on the module."
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing here: :meth:`load_checkpoint` restored each engine's optimizer state."""

    @override
    def teardown(self) -> None:
        """Remove every hook and patch the strategy added and stop the engines, then tear down as DDP does.

        Nothing here is a collective, so it is safe after an exception on one rank. The submodules stay
        the user's modules; ZeRO-3 ones stay partitioned (see :meth:`consolidated_state_dict`). After a fit that
        ended without an exception the stopped engines are kept, so that ``trainer.save_checkpoint`` works after
        ``fit`` as under DDP, until :meth:`release` or the next setup.
        """
        self._unguard_gradients()  # first: torch's functions and the parameters' classes come back even if a
        self._unguard_gradients = _nothing  # release below fails
        if not self._failed:  # a save after fit reads the master copies: edits since the last step go there first
            self._engine_set.take_weight_edits()
        release_engines(self._engine_set)
        self._stop_arrival()
        if self._loading is not None:  # a checkpoint read for a setup that did not finish
            _remove(self._loading.unpacked)
        self._loading = None
        module = self.lightning_module
        fitted = module is not None and trainer_of(module) is not None and module.trainer.state.fn == TrainerFn.FITTING
        if fitted and not self._failed and self._engine_set.trainable_engines:
            self._fitted = self._engine_set
        self._engine_set = EngineSet()
        self._restore_summary()
        self._restore_summary = _nothing
        self._show_upstream_warnings()
        self._show_upstream_warnings = _nothing
        show_lightning_tips_of(self)
        self._unset_extensions_dir()
        self._unset_extensions_dir = _nothing
        self._unset_launch_variables()
        self._unset_launch_variables = _nothing
        if self.lightning_module is not None and trainer_of(self.lightning_module) is not None:
            forget_requested(self.lightning_module.trainer)  # the dataloaders the engines were sized from
        super().teardown()  # as DDP: reverts sync_batchnorm, moves the module to the CPU

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Log which rank failed and why (Python logging, on every rank), before Lightning tears down.

        The process then exits; the other ranks' pending collectives fail as soon as its connections
        close, so they stop too (tested: all exit non-zero within seconds, no hang).
        """
        broken = torch_compat.peer_failed(exception)
        with contextlib.suppress(Exception):  # a note must not stop the teardown below (a local that raises on use)
            note_partitioned_use(exception, self._engine_set.engines)
        self._failed = True  # teardown does not keep this fit's engines for saving
        self.release()  # nor an earlier fit's: this one may have failed before its setup released them
        reason = "a collective failed, most likely because another rank stopped (see its output)" if broken else ""
        log.error(  # every rank's own message, not rank zero's: which rank failed is the point
            f"[rank {self.global_rank}] MultiDeepSpeedStrategy: {type(exception).__name__}: {exception}"
            + (f" -- {reason}" if reason else "")
            + "".join(f"\n{note}" for note in getattr(exception, "__notes__", ()))
        )
        with contextlib.suppress(AttributeError):  # the command then shows no second copy of the message
            exception.lightning_multids_logged = True  # type: ignore[attr-defined]
            exception.lightning_multids_peer_failed = bool(broken)  # type: ignore[attr-defined]
        super().on_exception(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the strategy as ``strategy="multi_deepspeed"``."""
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="One DeepSpeed engine per submodule, with a manual multi-optimizer loop",
        )


@dataclass
class _Loading:
    """A checkpoint being loaded: read before setup (:meth:`MultiDeepSpeedStrategy.load_checkpoint`), loaded at it."""

    path: Path
    saved: dict[str, Any]
    weights_only: bool | None
    unpacked: tempfile.TemporaryDirectory[str] | None = None
    """Where a single-file checkpoint was unpacked (``path``), removed once loaded."""
    shown: Path | None = None
    """The path errors name: the single file the user gave, where ``path`` is its unpacked copy."""
    plain: Mapping[str, Any] | None = None
    strict: bool = True


def _nothing() -> None:
    pass


def _chain(*undos: Callable[[], None]) -> Callable[[], None]:
    def undo() -> None:
        for each in undos:
            each()

    return undo


def _remove(unpacked: tempfile.TemporaryDirectory[str] | None) -> None:
    if unpacked is not None:
        unpacked.cleanup()


def _check_checkpoint_format(checkpoint_format: str) -> None:
    if checkpoint_format not in checkpoints.CHECKPOINT_FORMATS:
        raise ValueError(
            f"MultiDeepSpeedStrategy(checkpoint_format={checkpoint_format!r}): choose 'directory' (the default: a "
            "directory with one part per engine) or 'file' (one file that `torch.load` and "
            "`Model.load_from_checkpoint` read)."
        )


def _refuse_checkpoint_io(checkpoint_io: CheckpointIO | None) -> None:
    if checkpoint_io is not None:
        raise ValueError(
            f"MultiDeepSpeedStrategy got `checkpoint_io={type(checkpoint_io).__name__}(...)`, which it cannot use: "
            "each DeepSpeed engine writes its own part of a checkpoint directory. Remove the `checkpoint_io` argument "
            "or the CheckpointIO from `Trainer(plugins=...)`."
        )


def _refuse_zero3_launched_in_process(
    start_method: str, stage: int, config: Mapping[str, Any], engine_configs: Mapping[str, Mapping[str, Any]]
) -> None:
    """Refuse ``start_method`` spawn, fork or forkserver where an engine may run ZeRO-3.

    Lightning's in-process launchers send the trained weights back to the main process from rank 0's module, which
    at ZeRO-3 holds only its partition of each weight: the fit would end with its weights lost. The default stage
    counts (a submodule without an ``engine_configs`` entry gets it), as does each entry's.
    """
    if start_method == "popen":
        return
    default = merge({"zero_optimization": {"stage": stage}}, config)
    zero3 = [name for name, override in engine_configs.items() if zero_stage(merge(default, override)) == 3]
    if zero_stage(default) == 3:
        zero3.insert(0, "every engine without an `engine_configs` entry")
    if zero3:
        raise ValueError(
            f"MultiDeepSpeedStrategy(start_method={start_method!r}) with ZeRO-3 ({', '.join(zero3)}): Lightning's "
            f"{start_method} launcher returns the trained weights to the main process from rank 0's module, which at "
            "ZeRO-3 holds only its partition of each weight, so the weights would be lost when the fit ends. Keep "
            "`start_method='popen'` (the default: Lightning runs the script once per rank) or launch with torchrun, "
            "or give every engine ZeRO-0/1/2."
        )
