"""Peak memory of this process on its device."""

from __future__ import annotations

import torch


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated bytes on a CUDA device; peak resident set size of the process otherwise."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return None
