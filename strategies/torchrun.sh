#!/usr/bin/env bash
# One node, NPROC processes: bash strategies/torchrun.sh train.py [script args...]
# With MAX_RESTARTS=N, have the script call fit(..., resume="auto") so that a restart continues from
# the newest valid checkpoint (and the first start, with none yet, starts fresh).
set -euo pipefail
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python3 -c "import torch; print(torch.cuda.device_count() or 2)")
fi
exec python3 -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  --max-restarts "${MAX_RESTARTS:-0}" "$@"
