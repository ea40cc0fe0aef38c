"""Where this process sits in the job: torchrun/TorchElastic, SLURM, or a plain single process.

Launching is torch's (``torchrun``) or SLURM's (``srun``) job; this module only reads what they
set. ``detect_environment()`` returns rank, world size, local rank, node rank and the rendezvous
address and port.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from lightlike.errors import ConfigError


@dataclass(frozen=True)
class ClusterEnvironment:
    kind: str  # "torchrun", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    main_address: str
    main_port: int

    def export(self) -> None:
        """Set the variables ``torch.distributed``'s env:// rendezvous reads."""
        os.environ["MASTER_ADDR"] = self.main_address
        os.environ["MASTER_PORT"] = str(self.main_port)
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)


def _int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from e


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
    m = re.match(r"^(.*?)\[(\d+)", first)
    return m.group(1) + m.group(2) if m else first


def slurm_port(job_id: str) -> int:
    """A port derived from the job id (so every task computes the same one): 15000-19999."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + int(digits[-4:]) % 5000


def detect_environment() -> ClusterEnvironment:
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env):
        return ClusterEnvironment("torchrun", _int("RANK"), _int("WORLD_SIZE"), _int("LOCAL_RANK"),
                                  int(env.get("GROUP_RANK", "0")), env.get("MASTER_ADDR", "127.0.0.1"),
                                  int(env.get("MASTER_PORT", "29500")))
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        return ClusterEnvironment("slurm", _int("SLURM_PROCID"), _int("SLURM_NTASKS"), _int("SLURM_LOCALID"),
                                  int(env.get("SLURM_NODEID", "0")),
                                  env.get("MASTER_ADDR") or slurm_main_address(nodelist),
                                  int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"))))
    return ClusterEnvironment("single", 0, 1, 0, 0, "127.0.0.1", 29500)
