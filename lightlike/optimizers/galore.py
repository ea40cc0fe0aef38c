"""GaLore's parameter groups: the weights of the target ``nn.Linear`` modules get the low-rank
gradient projection (``rank``, ``update_proj_gap``, ``scale``, ``proj_type``), every other
trainable parameter the plain update, as the HF Trainer builds them.

``optimizer_target_modules`` matches module names as the Trainer's ``check_target_module_exists``
does: a string is a regex matched against the whole name (``re.fullmatch``); a list matches a
name equal to an entry, containing one, or fully matching one as a regex; ``"all-linear"`` is
every ``nn.Linear``. Only ``nn.Linear`` weights are projected (a match on another module type
is logged and left out, as the Trainer does). Weight decay keeps lightlike's rule: the groups
are ``lightlike.optim.param_groups``' split, the projected weights taken out into their own group.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from torch import nn

from lightlike.errors import ConfigError

log = logging.getLogger("lightlike")


def matches(targets: str | list[str], name: str) -> bool:
    """Whether the module ``name`` is one of ``targets`` (the Trainer's rule, module docstring)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets or any(t in name for t in targets) or any(re.fullmatch(t, name) for t in targets)


def target_weights(module: nn.Module, targets: Any, optimizer: str) -> list[Any]:
    """The trainable weights of the ``nn.Linear`` modules ``targets`` names; none found is one
    ``ConfigError`` naming the module names that exist."""
    if targets is None:
        raise ConfigError(f"optimizer={optimizer!r} needs optimizer_target_modules: the names (or a regex, or "
                          "'all-linear') of the nn.Linear modules whose weights get GaLore's low-rank projection",
                          settings=("optimizer_target_modules",))
    if isinstance(targets, tuple):
        targets = list(targets)
    if not isinstance(targets, (str, list)) or (isinstance(targets, list) and
                                                not all(isinstance(t, str) for t in targets)):
        raise ConfigError(f"optimizer_target_modules={targets!r}: give a list of module names, a regex, or "
                          "'all-linear'", settings=("optimizer_target_modules",))
    all_linear = isinstance(targets, str) and targets.replace("_", "-") == "all-linear"
    found: list[Any] = []
    for name, mod in module.named_modules():
        hit = all_linear or (bool(name) and matches(targets, name))
        if not hit:
            continue
        if not isinstance(mod, nn.Linear):
            if not all_linear:
                log.warning("%s: optimizer_target_modules matched %r (%s), which is not nn.Linear: GaLore projects "
                            "nn.Linear weights only, so it is left out", optimizer, name, type(mod).__name__)
            continue
        if mod.weight.requires_grad and all(mod.weight is not p for p in found):
            found.append(mod.weight)
    if not found:
        linear = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
        names = [n for n, _ in module.named_modules() if n]
        raise ConfigError(f"optimizer_target_modules={targets!r} matches no trainable nn.Linear module of "
                          f"{type(module).__name__}. Its nn.Linear modules: {', '.join(linear) or 'none'}; all its "
                          f"modules: {', '.join(names[:40])}{', ...' if len(names) > 40 else ''}",
                          settings=("optimizer_target_modules",))
    return found


def galore_groups(groups: list[dict[str, Any]], targets: list[Any],
                  galore: dict[str, Any]) -> list[dict[str, Any]]:
    """``groups`` (``param_groups``' split) with the ``targets`` taken out into a last group that
    carries the GaLore arguments ``galore`` and the weight decay of the group they came from."""
    ids = {id(p) for p in targets}
    decay = next((g["weight_decay"] for g in groups for p in g["params"] if id(p) in ids), 0.0)
    out = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
    out = [g for g in out if g["params"]]
    return out + [{"params": list(targets), "weight_decay": decay, **galore}]


def plain_projectors(optimizer: Any) -> None:
    """Checkpoint GaLore's per-parameter ``GaLoreProjector`` objects as their plain projection
    matrix (so the state loads with ``torch.load(weights_only=True)``), and rebuild them on load
    from their parameter group's ``rank``/``update_proj_gap``/``scale``/``proj_type`` (as GaLore
    builds them), through the optimizer's own state-dict hooks; saving never changes the live
    state. (No text in the state: torch's ``load_state_dict`` mangles strings there.)"""
    from galore_torch.galore_projector import GaLoreProjector

    def to_plain(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        for i, s in list(state_dict["state"].items()):
            if isinstance(s.get("projector"), GaLoreProjector):
                state_dict["state"][i] = {**s, "projector": {"ortho_matrix": s["projector"].ortho_matrix}}
        return state_dict

    def from_plain(opt: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                s = opt.state.get(p, {})
                if isinstance(s.get("projector"), dict):
                    projector = GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"],
                                                scale=group["scale"], proj_type=group["proj_type"])
                    projector.ortho_matrix = s["projector"]["ortho_matrix"]
                    s["projector"] = projector

    optimizer.register_state_dict_post_hook(to_plain)
    optimizer.register_load_state_dict_post_hook(from_plain)
