"""DeepSpeed ZeRO (stages 1, 2, 3; optimizer and parameter offload to CPU) behind the Strategy contract.

``strategy="deepspeed_zero3"`` (or ``DeepSpeedStrategy(stage=3, config="ds.json")``) is the only
change to a training script. lightlike keeps the loop: the process group is ``ParallelStrategy``'s (torchrun, SLURM,
or one plain process), DeepSpeed reuses it; the DeepSpeed config is generated from the Fitter's
settings (``deepspeed_config.py``: micro-batch, accumulation, clipping, precision, stage), and a
user config may add settings but not contradict those; the optimizer and the LR scheduler are
lightlike's (the torch optimizer is handed to ``deepspeed.initialize``, which wraps it in the ZeRO
optimizer; lightlike's ``LambdaLR`` keeps setting ``lr`` in the param groups that the ZeRO
optimizer steps with — the same dict objects, checked at set-up).

A step: ``no_sync`` sets DeepSpeed's accumulation boundary explicitly (the last window of an epoch
may be partial); ``backward`` is ``engine.backward(loss, scale_wrt_gas=False)`` because the Fitter
already weights each micro-batch by its share of the step's items over all ranks (DeepSpeed
averages gradients over ranks as DDP does, so ``ParallelStrategy.item_normaliser`` applies unchanged);
``engine.step()`` clips by the global norm (config ``gradient_clipping`` = ``max_grad_norm``) and
steps (``step``, which reports the norm DeepSpeed computed and whether it skipped the update:
an fp16 overflow, or with any precision a global norm that is NaN/inf, which DeepSpeed reports
as an infinite norm; the Fitter's non-finite check reads that skip).
``max_grad_value`` is not supported by DeepSpeed (error).

Checkpoints (``state_format="deepspeed"``, ``layouts.DeepSpeedLayout``): every rank calls ``engine.save_checkpoint`` into
``deepspeed/`` of the shared temp directory (tag ``state``): the module states and each rank's
ZeRO partitions (fp32 master weights, optimizer state). lightlike's own state (RNG, data position,
scheduler, FitState) is written next to it by ``checkpoint/training.py`` — that is the "client
state" — and the manifest/rename commit covers all of it. Weights-only checkpoints
(``save_only_model``) hold ``model.safetensors`` gathered in fp32. Export: ``checkpoint/zero.py``
(DeepSpeed's zero-to-fp32). Resume on another world size: see ``DeepSpeedLayout.load``.

DeepSpeed is imported only inside methods: ``import lightlike`` does not import it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightlike.errors import ConfigError
from lightlike.precision import Precision
from lightlike.strategies import deepspeed_config as dsc
from lightlike.strategies import deepspeed_fixes as ds_fixes
from lightlike.strategies.base import StepResult
from lightlike.strategies.environment import detect_environment
from lightlike.strategies.layouts import DeepSpeedLayout
from lightlike.strategies.parallel import ParallelStrategy


class DeepSpeedStrategy(ParallelStrategy):
    """ZeRO data parallelism through a DeepSpeed engine.

    ``stage`` (1: optimizer state sharded; 2: + gradients; 3: + parameters), ``offload_optimizer``
    (optimizer state and fp32 master weights in CPU memory, stepped there), ``offload_params``
    (stage 3: parameters in CPU memory). Each is taken from the argument, else from ``config``,
    else stage 2 without offload. ``config``: a dict or the path of a DeepSpeed JSON file, merged
    with the generated config (``lightlike.strategies.deepspeed_config``)."""

    gradients_on_parameters = False  # ZeRO reduces them into its own partitioned buffers
    #: engine.step() computes the global norm and skips a step whose norm is not finite (every
    #: ZeRO stage, DeepSpeed 0.19.8; the settings that turn this off are refused, see deepspeed_config)

    def __init__(
        self,
        accelerator: str = "auto",
        precision: Precision | None = None,
        *,
        stage: int | None = None,
        offload_optimizer: bool | None = None,
        offload_params: bool | None = None,
        config: Mapping[str, Any] | str | Path | None = None,
        timeout_s: float = 600.0,
        backend: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(accelerator, precision, timeout_s=timeout_s, backend=backend)
        self.config_source = f"file {str(config)!r}" if isinstance(config, (str, Path)) else (
            "the dict passed as config" if config else "none")
        self.user_config = dsc.load_user_config(config)
        dsc.check_refused(self.user_config, self.config_source)
        self.stage, self.offload_optimizer_device, self.offload_params_device = dsc.strategy_settings(
            self.user_config, stage, offload_optimizer, offload_params, self.config_source)
        self.offload_optimizer = self.offload_optimizer_device is not None
        self.offload_params = self.offload_params_device is not None
        self.name = name or f"deepspeed_zero{self.stage}" + ("_offload" if self.offload_optimizer else "")
        self.fit_config: Any = None
        self.ds_config: dict[str, Any] | None = None
        self.engine: Any = None
        self._norm: torch.Tensor | None = None
        self.checkpoint_layout: DeepSpeedLayout = DeepSpeedLayout(self)  # the engine's own files

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> DeepSpeedStrategy:
        """The registered names: ``deepspeed_zero1``, ``deepspeed_zero2``, ``deepspeed_zero2_offload``,
        ``deepspeed_zero3``, ``deepspeed_zero3_offload`` (also as JSON files in ``strategies/``)."""
        if name not in dsc.PRESETS:
            raise ConfigError(f"unknown DeepSpeed preset {name!r}; valid names: {', '.join(dsc.PRESETS)}")
        return cls(**{**dsc.PRESETS[name], **kwargs}, name=name)

    @property
    def settings(self) -> dict[str, Any]:
        """What the preset names fix: stage and offloads."""
        return {"stage": self.stage, "offload_optimizer": self.offload_optimizer, "offload_params": self.offload_params}

    # -- set-up ----------------------------------------------------------------------------------------
    def configure(self, config: Any) -> None:
        if config.max_grad_value is not None:
            raise ConfigError(f"max_grad_value={config.max_grad_value} is not supported with strategy={self.name!r}: "
                              "DeepSpeed clips by the global norm only (gradient_clipping); use max_grad_norm")
        if getattr(config, "compile", False):
            raise ConfigError(f"compile=True is not supported with strategy={self.name!r}: the Fitter compiles forward "
                              "and loss as one function around the DeepSpeed engine, whose own hooks (ZeRO's gathering "
                              "and partitioning, its gradient buffers) torch.compile does not trace; DeepSpeed's "
                              "engine.compile() compiles the module's forward alone, not the loss. Drop compile, or use "
                              "strategy='fsdp' (compile_regions=True compiles each block after sharding)")
        if getattr(config, "auto_find_batch_size", False):
            raise ConfigError(f"auto_find_batch_size=True is not supported with strategy={self.name!r}: a retry would "
                              "build a second engine on a module ZeRO has already partitioned; set batch_size")
        self.fit_config = config

    def setup_environment(self) -> None:
        env = detect_environment()
        backend = self.backend or ("nccl" if self._accelerator in ("auto", "cuda") and torch.cuda.is_available()
                                   else "gloo")
        if env.world_size == 1 and not dist.is_initialized():
            # one plain process (no launcher): DeepSpeed still needs a process group; a private
            # in-memory one, so no address or port is needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
            self._owns_group = True
            atexit.register(self.teardown)
        super().setup_environment()
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))  # DeepSpeed's engine insists on it
        from deepspeed.accelerator import get_accelerator

        if self.fit_config is None or self.fit_config.log_level != "debug":
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        accel = get_accelerator()
        if accel.device_name() != self.root_device.type:
            raise ConfigError(f"strategy={self.name!r} on {self.root_device.type}: DeepSpeed chose its "
                              f"{accel.device_name()!r} accelerator; set DS_ACCELERATOR={self.root_device.type} "
                              "or accelerator= to match")
        ds_fixes.init_deepspeed_comm()
        fp16_ok = bool(accel.is_fp16_supported())
        self._precision_sections = dsc.precision_sections(self.precision.name, fp16_ok, str(self.root_device),
                                                          self.name)
        if self.fit_config is not None:
            self.ds_config = self.build_config(self.fit_config, self.world_size)

    def build_config(self, fit_config: Any, world_size: int, fp16_ok: bool = False) -> dict[str, Any]:
        """The DeepSpeed config for ``fit_config`` on ``world_size`` ranks: generated values merged
        with the user config (errors name both values of a contradiction)."""
        sections = getattr(self, "_precision_sections", None) or dsc.precision_sections(
            self.precision.name, fp16_ok, str(self.root_device), self.name)
        generated = dsc.generated_config(
            batch_size=fit_config.batch_size, grad_accum_steps=fit_config.grad_accum_steps, world_size=world_size,
            max_grad_norm=fit_config.max_grad_norm, stage=self.stage, offload_optimizer=self.offload_optimizer_device,
            offload_params=self.offload_params_device, precision=sections)
        return dsc.merge(generated, self.user_config, self.config_source)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """ZeRO-3: ``deepspeed.zero.Init``, which partitions each submodule's parameters over the
        ranks as soon as it is built (initialised whole once, then broadcast from rank 0 and split),
        so the full model never sits on one device. Other stages: as usual."""
        if self.stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        # dtype from the config's bf16/fp16 sections: an explicit dtype is ignored where the
        # accelerator lacks fp16 (zero.Init's _set_dtype, DeepSpeed 0.19.8: bf16 on this CPU)
        return deepspeed.zero.Init(config_dict_or_path=self.ds_config, dtype=None,
                                   remote_device="cpu" if self.offload_params else None)

    @property
    def forward_is_collective(self) -> bool:
        return self.stage == 3 and self.world_size > 1  # partitioned parameters gathered in forward

    def setup_module(self, module: nn.Module, manual: bool = False) -> nn.Module:
        if manual:
            raise ConfigError(f"strategy={self.name!r} does not support manual optimization (a module with "
                              "training_step): DeepSpeed's engine owns one optimizer and its own backward and step. Use "
                              "strategy='ddp' (or 'single'), or write the module for automatic optimization (forward + loss)")
        # no wrapper yet: the engine wraps module and optimizer together in setup_optimizer
        if any(hasattr(p, "ds_id") for p in module.parameters()):
            return module  # built under zero.Init: partitioned already, in the right dtype
        return self.precision.convert_module(module).to(self.root_device)

    def setup_module_for_evaluation(self, module: nn.Module) -> nn.Module:
        if any(hasattr(p, "ds_id") for p in module.parameters()) and self.engine is None:
            raise ConfigError(
                "this module was built in fitter.init_module() under ZeRO-3, so each rank holds only its partitions, "
                "and DeepSpeed gathers them in the engine that fit() builds: evaluate it after fit(), or build the "
                "module outside init_module() (whole on each rank) to evaluate it on its own")
        return self.setup_module(module)

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        import copy

        import deepspeed

        if self.ds_config is None:
            raise ConfigError(f"strategy={self.name!r} needs the run's settings before set-up: the Fitter calls "
                              "strategy.configure(config) before setup_environment()")
        wide = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype == torch.float64})
        if wide:  # its master partitions are float32: every update would round through them
            raise ConfigError(f"strategy={self.name!r} trains {wide[0]} parameters in float32 (DeepSpeed keeps float32 "
                              "master weights), so the run would not be the float64 run it looks like: use "
                              "strategy='fsdp' or 'ddp' for float64, or convert the module to float32")
        groups = list(optimizer.param_groups)
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                          config=copy.deepcopy(self.ds_config),
                                                          dist_init_required=False)
        # lightlike's scheduler sets lr in these dicts; the ZeRO optimizer must step with them
        if len(ds_optimizer.param_groups) != len(groups) or any(
                a is not b for a, b in zip(ds_optimizer.param_groups, groups, strict=True)):
            raise ConfigError(f"{type(ds_optimizer).__name__} does not step with the param groups of the "
                              "optimizer lightlike built: the LR schedule would not reach it")
        self.engine = engine
        ds_fixes.share_zero3_master_partitions(ds_optimizer)
        return engine, ds_optimizer

    def unwrap(self, module: nn.Module) -> nn.Module:
        inner = getattr(module, "_orig_mod", module)  # torch.compile
        if self.engine is not None and inner is self.engine:
            return self.engine.module  # type: ignore[return-value]
        return inner  # type: ignore[no-any-return]

    def teardown(self) -> None:
        self.engine = None
        super().teardown()

    # -- a training step ---------------------------------------------------------------------------------
    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("the DeepSpeed engine is not set up (setup_optimizer has not run)")
        return self.engine

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """DeepSpeed's accumulation boundary, set explicitly before each micro-batch (the last
        window of an epoch may hold fewer micro-batches than ``gradient_accumulation_steps``).
        ZeRO-2/3 reduce-scatter on every micro-batch anyway; ZeRO-1 waits for the boundary."""
        self._engine().set_gradient_accumulation_boundary(not enabled)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, module: nn.Module, retain_graph: bool = False) -> None:
        # the Fitter's weights already make the window's gradient the item mean: no 1/GAS here
        self._engine().backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, where: tuple[int, int] = (0, 0)) -> None:
        return None  # the engine unscales and reduces inside its own step

    def step(self, optimizer: torch.optim.Optimizer, module: nn.Module, max_norm: float | None,
             max_value: float | None, vet: Callable[[torch.optim.Optimizer, torch.Tensor | None], bool]) -> StepResult:
        """``engine.step()``: DeepSpeed clips with the configured ``gradient_clipping`` (checked to
        be the Fitter's ``max_grad_norm``), computes the global norm (known only after the step,
        so ``vet`` gets None) and skips a step whose norm is not finite: an fp16 overflow, or
        with another precision a non-finite gradient."""
        if max_value is not None:
            raise ConfigError(f"max_grad_value is not supported with strategy={self.name!r}: DeepSpeed clips by the "
                              "global norm only; use max_grad_norm")
        configured = float(self.ds_config["gradient_clipping"]) if self.ds_config else 0.0
        if float(max_norm or 0.0) != configured:
            raise ConfigError(f"max_grad_norm={max_norm} but the DeepSpeed engine was set up with "
                              f"gradient_clipping={configured}; it cannot change after set-up")
        if not vet(optimizer, None):
            return StepResult(False, None, False)
        engine = self._engine()
        engine.step()
        norm = torch.full((), float("nan"), dtype=torch.float32, device=self.root_device)
        reported = engine.get_global_grad_norm()
        if isinstance(reported, torch.Tensor):
            norm.copy_(reported.detach().reshape(()))
        elif reported is not None:
            norm.fill_(float(reported))
        applied = bool(engine.was_step_applied())
        return StepResult(applied, norm, not applied and self._loss_scaled)

    @property
    def _loss_scaled(self) -> bool:
        """DeepSpeed's fp16 mode (``16-true``) has its own loss scaler: a skipped step is its overflow."""
        return bool(self.ds_config and self.ds_config.get("fp16", {}).get("enabled"))

    # -- memory --------------------------------------------------------------------------------------------
    def partition_footprint(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int] | None:
        """For ``lightlike.utils.memory.memory_footprint``, which asks for it by name: bytes of
        storage this rank holds (device and, when offloading, host memory alike), each
        storage counted once, in the first category that holds it:

        - ``params``: the module's parameters as this rank holds them: full under ZeRO-1/2; under
          ZeRO-3 the local partitions (``ds_tensor``) plus any parameter held whole (DeepSpeed keeps
          parameters smaller than ``stage3_param_persistence_threshold`` on every rank).
        - ``optimizer``: the fp32 master partitions (none extra when they are the parameter
          partitions themselves, as under fp32 ZeRO-3) and the wrapped optimizer's state (moments).
        - ``grads``: gradients held now: ``.grad`` of parameters and master partitions, and ZeRO's
          gradient partition buffers (ZeRO-3 keeps its flat one allocated between steps).
        Padding of the flat partitions is included (whole storages are counted). None before the
        engine exists (nothing partitioned yet: the plain count holds)."""
        if self.engine is None:
            return None
        zero = self.engine.optimizer
        inner = self.engine.module
        seen: set[int] = set()

        def count(tensors: Any) -> int:
            total = 0
            for t in _tensors(tensors):
                storage = t.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return total

        params = list(inner.parameters())
        local = [p.ds_tensor for p in params if hasattr(p, "ds_tensor")] + [p.data for p in params]
        out = {"params": count(local)}
        masters = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_partitioned_groups_flat", [])
        inner_opt = getattr(zero, "optimizer", zero)
        out["optimizer"] = count([masters, [s for s in inner_opt.state.values()]])
        grad_buffers = [getattr(zero, name, None) for name in
                        ("grad_partitions_flat_buffer", "grads_in_partition", "averaged_gradients", "ipg_buffer",
                         "accumulated_grads_in_cpu")]
        out["grads"] = count([[p.grad for p in params], [m.grad for m in _tensors(masters)], grad_buffers])
        return out

    def __repr__(self) -> str:
        return (f"DeepSpeedStrategy({self.name!r}, stage={self.stage}, rank={self.global_rank}/{self.world_size}, "
                f"device={self.root_device}, precision={self.precision.name!r})")


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) list/tuple/dict; None and other values skipped."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
