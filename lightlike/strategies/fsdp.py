"""Fully sharded data parallel on FSDP2: ``torch.distributed.fsdp.fully_shard`` over a DeviceMesh.

Each rank holds 1/N of every parameter, gradient and optimizer state (DTensors sharded on dim 0).
Shard units (by default the module's repeated blocks, then the root) all-gather their parameters
for forward and backward and reduce-scatter gradients, averaged over ranks as DDP averages them,
so the Fitter's exact-accumulation weighting (``ParallelStrategy.item_normaliser``) applies unchanged.

- HSDP (``hsdp``): a 2-D mesh (replicate × shard), shard within a node and replicate across nodes.
- Precision: ``bf16-mixed``/``16-mixed`` become a ``MixedPrecisionPolicy`` (parameters all-gathered
  in the low dtype, gradients reduced in fp32, sharded master weights and optimizer state in fp32);
  the plugin's autocast stays on, so ops autocast keeps in fp32 (softmax, losses) stay there.
  ``16-mixed`` uses ``ShardedGradScaler``, whose inf check is agreed over ranks.
- Accumulation: on micro-steps before the last, gradients are neither reduce-scattered nor
  resharded (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``): no
  communication until the window's last backward, at the cost of holding unsharded gradients.
- Clipping by norm uses the true global norm over all shards.
- Checkpoints (``layouts.DCPLayout``): each rank writes its shards through ``torch.distributed.checkpoint`` into the
  shared temp directory (``lightlike.checkpoint.dcp``); loading reshards onto any world size.
  ``async_save=True``: shards are copied to CPU memory at the step boundary and written by a
  background thread while training goes on; the checkpoint is committed (manifest, rename) at
  the next save or the end of the fit, and stays invisible until then.
- Large models: build the module under ``torch.device("meta")``; ``setup_module`` shards it,
  allocates only the local shards and initialises them: ``TaskModule.init_weights()`` if defined,
  else every submodule's ``reset_parameters()``, which gives exactly the weights of an eager
  build with the run's seed (see ``_materialise``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightlike.errors import ConfigError
from lightlike.precision import Precision
from lightlike.strategies.layouts import DCPLayout
from lightlike.strategies.parallel import ParallelStrategy

log = logging.getLogger("lightlike")

#: class-name suffixes of submodules that become shard units when nothing else is said
DEFAULT_UNIT_SUFFIXES = ("Block", "DecoderLayer", "EncoderLayer", "TransformerLayer")

PRESETS: dict[str, dict[str, Any]] = {
    "fsdp": {"offload": False, "hybrid": False},
    "fsdp_offload": {"offload": True, "hybrid": False},
    "hsdp": {"offload": False, "hybrid": True},
}

UnitSpec = str | list[str] | tuple[str, ...] | Callable[[nn.Module], bool] | None


#: the keys of a strategy file's [fsdp] table (strategies/*sdp*.toml list them all)
FILE_KEYS = ("offload", "hybrid", "reshard_after_forward", "shard_units", "shard_size", "activation_checkpointing",
             "async_save", "timeout_s", "backend")


_MADE: dict[Any, Any] = {}  # what _per_process_group made, for the default group under "world"


def _per_process_group(key: tuple, make: Callable[[], Any]) -> Any:
    """A mesh or subgroup made once per default process group, and reused by every later Fitter:
    each one's set-up made new ones, whose gloo sockets lived as long as the process group (a
    notebook, ``Fitter.search``'s trials). Every rank sets up its Fitters in the same order, so
    the collective ``make`` runs on all ranks or on none."""
    import torch.distributed as dist

    if _MADE.get("world") is not dist.group.WORLD:  # a new default group: nothing made is its
        _MADE.clear()
        _MADE["world"] = dist.group.WORLD
    if key not in _MADE:
        _MADE[key] = make()
    return _MADE[key]


class FSDPStrategy(ParallelStrategy):
    """FSDP2 over a DeviceMesh (see the module's docstring). ``shard_units``: which submodules
    become shard units (class names, a predicate, or None: the module's ``fsdp_units()`` or its
    repeated blocks); ``reshard_after_forward``, ``offload``, ``hybrid`` (+ ``shard_size``),
    ``activation_checkpointing``, ``async_save``; ``timeout_s`` and ``backend`` the process
    group's."""

    name = "fsdp"
    init_seed = 0

    def __init__(
        self,
        accelerator: str = "auto",
        precision: Precision | None = None,
        *,
        shard_units: UnitSpec = None,
        reshard_after_forward: bool = True,
        offload: bool = False,
        hybrid: bool = False,
        shard_size: int | None = None,
        activation_checkpointing: bool | None = None,
        async_save: bool = False,
        timeout_s: float = 600.0,
        backend: str | None = None,
    ) -> None:
        super().__init__(accelerator, precision, timeout_s=timeout_s, backend=backend)
        self.shard_units = shard_units
        self.reshard_after_forward = reshard_after_forward
        self.offload = offload
        self.hybrid = hybrid
        self.shard_size = shard_size
        self.activation_checkpointing = activation_checkpointing
        self.async_save = async_save
        self.checkpoint_layout: DCPLayout = DCPLayout(self)  # each rank its shards, in dcp/
        self.mesh: Any = None
        self._syncing: bool | None = None
        self.compiled = False
        self.name = "hsdp" if hybrid else "fsdp"

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> FSDPStrategy:
        if name not in PRESETS:
            raise ConfigError(f"unknown FSDP preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **kwargs})

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> FSDPStrategy:
        """Options from a TOML file such as ``strategies/fsdp.toml``: the preset its ``strategy``
        line names (``fsdp``, ``fsdp_offload`` or ``hsdp``; default ``fsdp``), refined by its
        ``[fsdp]`` table."""
        from lightlike.utils import toml

        doc = toml.loads(Path(path).read_text())
        named = doc.get("strategy", "fsdp")
        if named not in PRESETS:
            raise ConfigError(f"{path}: strategy = {named!r}, but a .toml strategy file describes FSDP "
                              f"(strategy = {' / '.join(map(repr, PRESETS))}); pass other strategies by name")
        table = doc.get("fsdp", {})
        unknown = sorted(set(table) - set(FILE_KEYS))
        if unknown:
            raise ConfigError(f"{path}: unknown [fsdp] keys {unknown}; valid: {sorted(FILE_KEYS)}")
        return cls(**{**PRESETS[named], **table, **kwargs})

    def configure(self, config: Any) -> None:
        self.init_seed = int(config.seed)  # a meta-device module is initialised from it
        self.async_save = self.async_save or bool(config.async_save)
        if self.activation_checkpointing is None:
            self.activation_checkpointing = bool(config.gradient_checkpointing)
        self.compiled = bool(getattr(config, "compile", False))  # units checkpointed in the form compile traces

    # -- processes, devices, mesh ----------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        if self.offload and self.root_device.type == "cpu":
            raise ConfigError(f"strategy={'fsdp_offload'!r} offloads to the CPU from an accelerator, but this run "
                              "is on the CPU already; use strategy='fsdp'")
        import torch.distributed as dist

        device = self.root_device.type
        shape, names = (self._hybrid_shape(), ("replicate", "shard")) if self.hybrid else ((self.world_size,), ("shard",))
        self.mesh = _per_process_group(("mesh", device, shape, names),
                                       lambda: init_device_mesh(device, shape, mesh_dim_names=names))
        if self.async_save:  # the background writer's collectives get their own (CPU) group
            self.checkpoint_layout.group = _per_process_group(("checkpoint group",),
                                                              lambda: dist.new_group(backend="gloo"))
        if self.precision.uses_scaler:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # the inf check must be agreed over ranks, or ranks would skip different steps
            self.precision.use_scaler(ShardedGradScaler)  # type: ignore[attr-defined]

    # -- module and optimizer ------------------------------------------------------------------
    @property
    def forward_is_collective(self) -> bool:
        return self.world_size > 1  # every shard unit all-gathers its parameters in forward

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[nn.Module]:
        try:
            with super().evaluating(model) as m:
                yield m
        finally:  # the root is sharded with reshard_after_forward=False and no backward reshards it
            _reshard(model)  # after a forward without gradients: its full parameters stayed the
            # module's, and the optimizer of a fit after validate() was built over them (no training)

    def _hybrid_shape(self) -> tuple[int, int]:
        """hsdp's mesh: (nodes, processes per node), unless ``shard_size`` says otherwise."""
        env, world = self.env, self.world_size
        if not self.shard_size and env is not None and (env.local_world_size is None or not env.even_nodes):
            raise ConfigError("hsdp: the processes per node cannot be told (the nodes run different numbers "
                              "of tasks, or Slurm did not say how many): set FSDPStrategy(hybrid=True, "
                              "shard_size=...) to the processes per node")
        shard = self.shard_size or (env.local_world_size if env is not None and env.local_world_size else world)
        if shard < 1 or world % shard:
            raise ConfigError(f"hsdp: shard_size={shard} must divide the world size {world}; set "
                              "FSDPStrategy(hybrid=True, shard_size=...) to the processes per node")
        return world // shard, shard

    def setup_module(self, module: nn.Module, manual: bool = False) -> nn.Module:
        """Shard the module (see the module's docstring). Manual optimization (``manual``): sharded
        as usual. A submodule that ``training_step`` calls on its own (a GAN's discriminator) must
        be a shard unit (``shard_units``, or the module's ``fsdp_units()``), so that FSDP's hooks
        gather its parameters when it runs; gradients are reduce-scattered (averaged) in each
        backward, as usual."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        if isinstance(module, FSDPModule):  # sharded already (e.g. validate() after fit())
            _reshard(module)
            return module
        on_meta = any(p.is_meta for p in module.parameters())
        module = self.precision.convert_module(module)
        if not on_meta:
            module = module.to(self.root_device)
            if self.world_size > 1:  # as DDP does: every rank starts from rank 0's weights (else
                # each kept its own shard of whatever its own build gave, a mix of ranks' inits)
                from torch.distributed import group
                from torch.distributed.utils import _sync_module_states

                _sync_module_states(module, group.WORLD, 250 * 1024 * 1024, 0, set())  # type: ignore[arg-type]
        units = self._units(module)
        if self.activation_checkpointing and units:  # (without units the module's maybe_checkpoint does it)
            from lightlike.blocks import checkpoint_blocks

            units = checkpoint_blocks(module, units, compiled=self.compiled)  # before sharding, as torchtitan
            if hasattr(module, "gradient_checkpointing_disable"):  # checkpointed here, so not twice
                module.gradient_checkpointing_disable()
            self.checkpoints_activations = True
        compute = getattr(self.precision, "compute_dtype", None)
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy() if self.offload else OffloadPolicy()
        kwargs = dict(mesh=self.mesh, mp_policy=mp, offload_policy=offload)
        for unit in units:
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **kwargs)
        fully_shard(module, reshard_after_forward=False, **kwargs)  # the root is needed first in backward
        if on_meta:
            self._materialise(module)
        return module

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """On the meta device: no memory until ``setup_module`` allocates each rank's shards."""
        return torch.device("meta")

    def _units(self, module: nn.Module) -> list[nn.Module]:
        """Submodules that become shard units, outermost first and none inside another."""
        spec = self.shard_units
        hook = getattr(module, "fsdp_units", None)
        if spec is None and callable(hook):
            return list(hook())
        if spec is None:
            def pick(m: nn.Module) -> bool:
                return type(m).__name__.endswith(DEFAULT_UNIT_SUFFIXES)
        elif callable(spec):
            pick = spec  # type: ignore[assignment]
        else:
            names = {spec} if isinstance(spec, str) else set(spec)
            known = {type(m).__name__ for m in module.modules()}
            if not names & known:
                raise ConfigError(f"shard_units={sorted(names)} matches no submodule class; classes in this "
                                  f"module: {sorted(known)}")

            def pick(m: nn.Module) -> bool:
                return type(m).__name__ in names
        chosen: list[nn.Module] = []
        inside: set[int] = set()
        for m in module.modules():
            if m is module or id(m) in inside:
                continue
            if pick(m):
                chosen.append(m)
                inside.update(id(s) for s in m.modules())
        return chosen

    def _materialise(self, module: nn.Module) -> None:
        """Allocate the local shards of a meta-device module and initialise them.

        With ``reset_parameters()`` (every torch layer has it) the values are exactly those of
        ``torch.manual_seed(seed); Model()`` built eagerly (in the dtype the module has on the
        meta device), whatever the world size: each
        submodule's own parameters are drawn whole, in construction order, from a generator
        seeded with the run's seed, and each rank keeps its shard; peak memory is the largest
        submodule's own parameters, not the model. DTensor random ops cannot do this on the CPU
        (every rank would draw the same values for its own shard). The global RNG state is left
        as it was, so the rest of the run matches an eagerly built one. A module's own
        ``init_weights()`` is called on the sharded DTensors instead (on CUDA, DTensor's RNG
        tracker keeps shards distinct; on the CPU it does not)."""
        module.to_empty(device=self.root_device)
        init = getattr(module, "init_weights", None)
        with torch.no_grad():  # marked until set: NaN, the largest integer, False
            marked = {name: (t, _mark(t)) for kind in (module.named_parameters(), module.named_buffers())
                      for name, t in kind}
            if callable(init):
                init()
            else:
                # the generators seeded are restored after: the CPU's and, when the shards live on
                # a GPU (where reset_parameters draws), that GPU's
                cuda = [] if self.root_device.type != "cuda" else \
                    [torch.cuda.current_device() if self.root_device.index is None else self.root_device.index]
                with torch.random.fork_rng(devices=cuda):
                    torch.manual_seed(self.init_seed)
                    for m in module.modules():
                        if callable(getattr(m, "reset_parameters", None)):
                            _reset_whole(m)
        self._check_materialised(module, marked, "its init_weights()" if callable(init) else
                                 "any submodule's reset_parameters()")
        log.debug("materialised a meta-device module shard by shard on %s", self.root_device)

    def _check_materialised(self, module: nn.Module, marked: dict[str, tuple[torch.Tensor, int]], by: str) -> None:
        """Every rank raises naming the parameters and buffers that initialisation left unset
        (or set in part), or replaced instead of writing into."""
        params = dict(module.named_parameters())
        now = {**params, **dict(module.named_buffers())}
        found = []
        for name, (t, version) in marked.items():
            if now.get(name) is t:
                why = _verdict(t, version)
            else:  # a buffer registered anew is set; a parameter must be written into, in place
                why = "replaced" if name in params else None
            if why is not None:
                found.append(name if why == "unset" else f"{name} ({why})")
        bad = sorted({item for part in self.collectives.all_gather_object(found) for item in part})
        if bad:  # every rank raises (a shard may hold no unset value)
            raise ConfigError(
                f"the module was built on the meta device, where tensors hold no value, and {by} did not set "
                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} ({len(bad)} in all): set them in the "
                "TaskModule's init_weights(), in place (buffers computed in __init__, such as rotary frequencies, "
                "too), or build the module on a real device")

    def unwrap(self, module: nn.Module) -> nn.Module:
        return getattr(module, "_orig_mod", module)  # FSDP2 shards in place: no wrapper

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        sync = not enabled
        if sync != self._syncing:  # only when it changes: the calls walk every submodule
            inner = self.unwrap(module)
            inner.set_requires_gradient_sync(sync)  # type: ignore[operator]
            inner.set_reshard_after_backward(sync)  # type: ignore[operator]
            self._syncing = sync
        return contextlib.nullcontext()

    def discard_gradients(self, module: nn.Module) -> None:
        """Also FSDP's state of an iteration an error cut short (a forward that never reached its
        post-forward left the root "in a forward": the next forward skipped the root's set-up)
        and the unsharded gradients it holds between the micro-steps of a window (no
        reduce-scatter before its last backward): they sit on the unsharded parameters, which are
        the module's own while it is unsharded."""
        from torch.distributed.fsdp import FSDPModule

        inner = self.unwrap(module)
        if hasattr(inner, "reset_iter_state"):  # torch's recovery after an aborted forward/backward
            inner.reset_iter_state()  # type: ignore[operator]
        units = [m for m in inner.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        inner.zero_grad(set_to_none=True)
        for unit in units:
            unit.reshard()
        inner.zero_grad(set_to_none=True)  # the sharded gradients

    def __repr__(self) -> str:
        return (f"FSDPStrategy(rank={self.global_rank}/{self.world_size}, mesh={tuple(self.mesh.shape) if self.mesh else None}, "
                f"precision={self.precision.name!r}, offload={self.offload})")


def _mark(t: torch.Tensor) -> int:
    """Fill a tensor to_empty() allocated with a mark (NaN, the largest integer, False); its
    version counter after that."""
    local = _local(t)
    local.fill_(float("nan") if t.is_floating_point() or t.is_complex() else
                False if t.dtype == torch.bool else torch.iinfo(t.dtype).max)
    return local._version


def _verdict(t: torch.Tensor, version: int) -> str | None:
    """None where initialisation set the tensor; else why not. An in-place write counts (its
    version counter moved); a write through ``.data`` (Hugging Face's init writes so) does not,
    and the mark's value is then all there is to go by: NaN (all NaN after a write is NaN on
    purpose), and for integer and bool tensors the largest integer and False, which such a write
    cannot be told from (the error says so)."""
    local = _local(t)
    written = local._version != version
    if t.is_floating_point() or t.is_complex():
        nan = local.isnan()
        if not bool(nan.any()):
            return None
        if written:
            return None if bool(nan.all()) else "set in part"
        return "unset"
    if written:
        return None
    if t.dtype == torch.bool:
        return None if bool(local.any()) else "still all False: if written through .data, write it in place"
    if bool((local == torch.iinfo(t.dtype).max).any()):
        return "still holds the largest integer: if written through .data, write it in place"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _reset_whole(m: nn.Module) -> None:
    """``m.reset_parameters()`` on full-size tensors standing in for its sharded ones (its own,
    not its children's), then each rank copies its shard of the result into place."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    own: list[dict[str, Any]] = [m._parameters, m._buffers]
    slots = [(d, n) for d in own for n, t in d.items() if isinstance(t, DTensor)]
    if not slots:
        m.reset_parameters()  # type: ignore[operator]
        return
    sharded = {(id(d), n): d[n] for d, n in slots}
    try:
        for d, n in slots:
            t = d[n]
            full = torch.empty(t.shape, dtype=t.dtype, device=t.device_mesh.device_type)
            d[n] = nn.Parameter(full, requires_grad=t.requires_grad) if d is m._parameters else full
        m.reset_parameters()  # type: ignore[operator]
        for d, n in slots:
            t = sharded[(id(d), n)]
            mine = distribute_tensor(d[n].detach(), t.device_mesh, t.placements, src_data_rank=None)
            t.to_local().copy_(mine.to_local())
    finally:
        for d, n in slots:
            d[n] = sharded[(id(d), n)]


def _reshard(module: nn.Module) -> None:
    """Free the full parameters every FSDP unit of ``module`` holds, leaving the shards."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
