"""``torchrun ... fsdp_fits_in_a_row.py OUT``: four fits in one script (FSDP with async_save,
hsdp, then both again), each printing how many process groups and open files the rank holds."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
from helpers import Classifier, DictDataset  # noqa: E402

import lightlike as ll  # noqa: E402
from lightlike.strategies.fsdp import FSDPStrategy  # noqa: E402

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
for j, kind in enumerate(["async", "hsdp", "async", "hsdp"]):
    kw = {"strategy": FSDPStrategy(hybrid=True, shard_size=1)} if kind == "hsdp" else \
        {"strategy": "fsdp", "async_save": True, "save_every": 2}
    ll.Fitter(output_dir=str(out / str(j)), max_steps=2, batch_size=4, model_summary=False, log_level="error",
              loggers=[], **kw).fit(Classifier(), DictDataset(32))
    print(f"HELD rank={rank} fit={j} groups={len(dist.distributed_c10d._world.pg_map)} "
          f"fds={len(os.listdir('/proc/self/fd'))}", flush=True)
