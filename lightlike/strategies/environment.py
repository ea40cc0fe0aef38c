"""Where this process sits in the job: torchrun/TorchElastic, SLURM, or a plain single process.

Launching is torch's (``torchrun``) or SLURM's (``srun``) job; this module only reads what they
set. ``detect_environment()`` returns rank, world size, local rank, node rank and the rendezvous
address and port.

The rule, in order:

1. ``TORCHELASTIC_RUN_ID``, or all of ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``: torchrun.
2. A numbered srun step (``SLURM_STEP_ID``, or the older ``SLURM_STEPID``, a step number; not the
   batch, extern or interactive step): one of ``SLURM_STEP_NUM_TASKS`` tasks (``SLURM_NTASKS``
   where a Slurm version lacks it), rank ``SLURM_PROCID``. A step of one task is a single process.
   This holds inside interactive allocations too (``SLURM_JOB_NAME=interactive`` or ``bash``).
3. ``WORLD_SIZE`` > 1 without ``RANK`` and ``LOCAL_RANK``, or ``RANK`` (or a nonzero
   ``LOCAL_RANK``) without ``WORLD_SIZE``: an error (which process is this, one of how many?).
4. Anything else is one process. A SLURM allocation of N > 1 tasks whose script runs
   ``python train.py`` directly (the batch step, or a shell of ``salloc``) is one process too,
   with a warning to launch with ``srun`` to use the N tasks: only srun starts them.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass

from lightlike.errors import ConfigError

log = logging.getLogger("lightlike")
#: Step ids at or above this are Slurm's special steps (batch, extern, interactive, pending), in
#: every version: 0xfffffff0 and up.
_SPECIAL_STEP = 0xFFFFFFF0
_warned: set[str] = set()


@dataclass(frozen=True)
class ClusterEnvironment:
    kind: str  # "torchrun", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    main_address: str
    main_port: int
    #: processes on this node (torchrun's LOCAL_WORLD_SIZE; under srun, the step's tasks on this
    #: node); None where it cannot be told. ``even_nodes``: every node runs as many.
    local_world_size: int | None = 1
    even_nodes: bool = True

    def export(self) -> None:
        """Set the variables ``torch.distributed``'s env:// rendezvous reads (and LOCAL_WORLD_SIZE,
        which torchrun sets and srun does not)."""
        os.environ["MASTER_ADDR"] = self.main_address
        os.environ["MASTER_PORT"] = str(self.main_port)
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        if self.local_world_size is not None:
            os.environ["LOCAL_WORLD_SIZE"] = str(self.local_world_size)


def _int(name: str, default: str | None = None) -> int:
    value = os.environ.get(name, default)
    if value is None:
        raise ConfigError(f"environment variable {name} is not set, but the launcher's other variables are "
                          "(torchrun sets RANK, WORLD_SIZE and LOCAL_RANK together): launch with torchrun, or set all three")
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from e


def _check_local_rank(name: str, local: int, of: str, local_world: int) -> None:
    if not 0 <= local < local_world:  # it would pick another process's device, or none
        raise ConfigError(f"{name}={local} but {of} is {local_world}: the launcher's variables disagree "
                          f"({name} must be in 0..{local_world - 1})")


def slurm_main_address(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[003-005,007]`` -> ``node003``."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (FileNotFoundError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        pass
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    # each bracket's first value: rack[1-2]-node[01-04] -> rack1-node01
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)


def slurm_port(job_id: str, step_id: str | int = 0) -> int:
    """A port derived from the job and step ids (so every task of a step computes the same one,
    and steps of one job running side by side get different ones): 15000-19999."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + (int(digits[-4:]) + 1009 * int(step_id)) % 5000


def slurm_tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts, node by node: ``2(x3),1`` -> ``[2, 2, 2, 1]``; ``[]`` if
    the text is not of that form."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def srun_step() -> str | None:
    """The number of the srun step this process is a task of, or ``None`` outside one (no
    SLURM, the batch script, ``salloc``'s shell, the extern step)."""
    raw = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID"))
    if raw is None or not raw.strip().isdigit() or int(raw) >= _SPECIAL_STEP:
        return None  # absent, or "batch" / "extern" / "interactive" / their numeric codes
    return raw.strip()


def detect_environment() -> ClusterEnvironment:
    """Rank, world size and rendezvous of this process; the rule is in the module docstring."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env):
        rank, world = _int("RANK"), _int("WORLD_SIZE")
        if not 0 <= rank < world:  # a process group would wait for ranks that never come
            raise ConfigError(f"RANK={rank} but WORLD_SIZE={world}: the launcher's variables disagree (RANK must "
                              "be in 0..WORLD_SIZE-1)")
        local, local_world = _int("LOCAL_RANK"), _int("LOCAL_WORLD_SIZE", str(world))
        _check_local_rank("LOCAL_RANK", local, "LOCAL_WORLD_SIZE", local_world)
        return ClusterEnvironment("torchrun", rank, world, local, _int("GROUP_RANK", "0"),
                                  env.get("MASTER_ADDR", "127.0.0.1"), _int("MASTER_PORT", "29500"), local_world)
    if (step := srun_step()) is not None and "SLURM_PROCID" in env:
        tasks = next(n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_PROCID") if n in env)
        world = _int(tasks) if tasks != "SLURM_PROCID" else 1
        rank = _int("SLURM_PROCID")
        if not 0 <= rank < world:
            raise ConfigError(f"SLURM_PROCID={rank} but {tasks}={world}: the srun step's variables disagree")
        if world > 1:
            nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                        or "127.0.0.1")
            local, node = _int("SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, _int("SLURM_NODEID", "0")
            # this node's tasks: the step's counts (the job's only where they add up to this step)
            counts = slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
            if sum(counts) != world:
                counts = slurm_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ""))
            even = len(set(counts)) <= 1
            on_node = (None if sum(counts) != world else counts[0] if even
                       else counts[node] if node < len(counts) else None)
            if on_node is not None:
                _check_local_rank("SLURM_LOCALID", local, "this node's task count", on_node)
            port = _int("MASTER_PORT") if env.get("MASTER_PORT") else slurm_port(env.get("SLURM_JOB_ID", "0"), step)
            return ClusterEnvironment("slurm", rank, world, local, node,
                                      env.get("MASTER_ADDR") or slurm_main_address(nodelist), port, on_node, even)
    elif "WORLD_SIZE" not in env and ("RANK" in env or env.get("LOCAL_RANK", "0").strip() not in ("", "0")):
        given = " and ".join(f"{n}={env[n]}" for n in ("RANK", "LOCAL_RANK") if n in env)
        raise ConfigError(f"{given} is set but WORLD_SIZE is not, so this process cannot tell how many processes "
                          "run with it: launch with torchrun (which sets RANK, WORLD_SIZE and LOCAL_RANK), set "
                          "WORLD_SIZE too, or unset RANK and LOCAL_RANK to run one process")
    elif "WORLD_SIZE" in env and _int("WORLD_SIZE") > 1:
        missing = " and ".join(n for n in ("RANK", "LOCAL_RANK") if n not in env)
        raise ConfigError(f"WORLD_SIZE={env['WORLD_SIZE']} is set but {missing} {'is' if ' ' not in missing else 'are'} "
                          "not, so this process cannot tell which of them it is: launch with torchrun (which sets "
                          "all three), set them yourself, or unset WORLD_SIZE to run one process")
    else:
        tasks = env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", ""))
        if tasks.strip().isdigit() and int(tasks) > 1 and "ntasks" not in _warned:
            _warned.add("ntasks")
            log.warning("this SLURM allocation has SLURM_NTASKS=%s tasks but this process was not started by "
                        "srun (no SLURM_STEP_ID: the batch script or an salloc shell), so it runs as one process; "
                        "launch with `srun python ...` to use the %s tasks", tasks, tasks)
    return ClusterEnvironment("single", 0, 1, 0, 0, "127.0.0.1", 29500)
