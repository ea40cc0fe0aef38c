"""LOMO and AdaLOMO (``lomo_optim``): the update fused into backward, through the step context.

LOMO updates each parameter as its gradient is computed (``optimizer.fused_backward(loss, lr)``,
with ``optimizer.grad_norm(loss)`` first when ``max_grad_norm`` clips), so no gradient is ever
kept. ``StepContext.backward`` runs that for the optimizer (``FusedBackward``) and
``StepContext.step`` then only steps the scheduler: one step path still. The learning rate
passed is the scheduler's current one, as the HF Trainer passes it.

What cannot work with an update inside backward is refused by name at set-up (``check_lomo``):
gradient accumulation (each backward updates), the ``"skip"`` non-finite policy (the update is
done before anything could veto it), a loss scaler (``16-mixed``) or fp16 losses (``16-true``:
LOMO's own scaler needs a process group), several processes (DDP/FSDP/DeepSpeed: LOMO updates
the local gradient, before any reduction), several optimizers, and ``weight_decay`` (LOMO's decays
every parameter alike, biases and norms too; lightlike's never decays those).

``lomo_optim`` registers its update hook on every parameter for good and keeps no handle; they
are removed as soon as it is built (by the ids ``RemovableHandle`` gave them) and registered for
each fused backward only, and removed after it, so the module is left as it came. AdaLOMO's
second moments live in attributes of its own: its state dict carries them (``lomo_state``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from lightlike.errors import ConfigError


def is_fused(optimizer: Any) -> bool:
    """Whether ``optimizer`` updates inside backward (LOMO's ``fused_backward``)."""
    return callable(getattr(optimizer, "fused_backward", None)) and callable(getattr(optimizer, "grad_func", None))


def check_lomo(config: Any) -> None:
    """The fields that cannot work with LOMO: one ``ConfigError`` naming them (module docstring)."""
    name = config.optimizer
    bad = [(config.grad_accum_steps != 1, "grad_accum_steps", "each backward updates the weights at once: "
                                                               "there is no gradient to accumulate"),
           (config.nonfinite_loss == "skip", "nonfinite_loss='skip'", "the update is made inside backward, "
                                                                     "before a non-finite loss could veto it"),
           (config.weight_decay != 0, "weight_decay", "LOMO decays every parameter alike (biases and norms too), "
                                                      "lightlike's weight_decay never decays those"),
           (config.precision in ("16-mixed", "16-true"), f"precision={config.precision!r}",
            "LOMO scales fp16 losses itself (its scaler needs a process group); use bf16-mixed or bf16-true")]
    given = [f"{field} ({why})" for cond, field, why in bad if cond]
    if given:
        raise ConfigError(f"optimizer={name!r} cannot work with: {'; '.join(given)}", settings=("optimizer",))


def check_lomo_run(strategy: Any, optimizers: tuple[Any, ...]) -> None:
    """What the step context refuses for a fused optimizer: several processes, several optimizers,
    a loss scaler."""
    why = []
    if strategy.world_size > 1:
        why.append(f"{strategy.world_size} processes (LOMO updates with the local gradient, before any reduction "
                   "over the ranks: DDP, FSDP and DeepSpeed are refused; run on one device)")
    if len(optimizers) > 1:
        why.append("several optimizers (LOMO updates every parameter of its module inside backward)")
    if strategy.precision.uses_scaler:
        why.append(f"precision {strategy.precision.name!r} (a loss scaler: LOMO scales fp16 losses itself)")
    if why:
        raise ConfigError(f"LOMO ({type(optimizers[0]).__name__}) cannot work with {'; '.join(why)}",
                          settings=("optimizer", "strategy"))


def build_lomo(module: torch.nn.Module, config: Any, kwargs: dict[str, Any]) -> Any:
    """``Lomo``/``AdaLomo`` over ``module`` with ``lr=learning_rate``, ``max_grad_norm`` and
    ``max_grad_value`` as its clipping, its permanent hooks removed (module docstring)."""
    from lightlike.optimizers import optimizer_class

    check_lomo(config)
    cls: Any = optimizer_class(config.optimizer)
    params = [p for p in module.parameters() if p.requires_grad]
    first = RemovableHandle.next_id
    optimizer = cls(module, lr=config.learning_rate, clip_grad_norm=config.max_grad_norm,
                    clip_grad_value=config.max_grad_value, **kwargs)
    ids = range(first, RemovableHandle.next_id)
    for p in params:  # RemovableHandle.remove(), for handles lomo_optim did not keep
        hooks = p._backward_hooks or {}
        for i in ids:
            hooks.pop(i, None)
    if hasattr(optimizer, "exp_avg_sq"):  # AdaLomo
        optimizer.register_state_dict_post_hook(_save_moments)
        optimizer.register_load_state_dict_pre_hook(_load_moments)
    return optimizer


#: AdaLomo's own attributes that its updates read (kept in the state dict under "lomo_state")
MOMENTS = ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col")


def _save_moments(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    state_dict["lomo_state"] = {"step_num": optimizer.step_num,
                                **{k: {n: t.clone() for n, t in getattr(optimizer, k).items()} for k in MOMENTS}}
    return state_dict


def _load_moments(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    state_dict = dict(state_dict)
    saved = state_dict.pop("lomo_state", None)
    if saved is None:
        raise ConfigError("this AdaLomo state has no 'lomo_state' (its second moments): it was not saved by lightlike")
    optimizer.step_num = saved["step_num"]
    for k in MOMENTS:
        own = getattr(optimizer, k)
        for n, t in saved[k].items():
            own[n].copy_(t)
    return state_dict


class FusedBackward:
    """The fused backward-and-update of one LOMO optimizer: its update hook registered on every
    trainable parameter for this backward only; ``grad_norm`` first when it clips by norm.
    Returns the gradient norm it computed (a device tensor), or None."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]

    def __call__(self, loss: torch.Tensor, lr: float) -> torch.Tensor | None:
        opt = self.optimizer
        handles = [p.register_hook(opt.grad_func) for p in self.params]
        try:
            norm = None
            if opt.clip_grad_norm is not None and opt.clip_grad_norm > 0:
                opt.grad_norm(loss)
                norm = torch.linalg.vector_norm(opt.grad_norms, 2.0)
            opt.fused_backward(loss, lr)
        finally:
            for h in handles:
                h.remove()
        return norm
