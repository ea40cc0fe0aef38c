#!/usr/bin/env bash
# What a session lent a GPU runs, in one call (CI has no GPU; see benchmarks/RESULTS.md):
#   1. benchmarks/gpt_peers.py: the same GPT (124 M, bf16-mixed, compiled) through a hand-written
#      loop, lightlike (compile=True, and compile_regions=True), the HF Trainer and the Lightning
#      Trainer, one process each: ms/step, tokens/s, MFU, peak memory side by side (issue 33);
#   2. tests/gpu/test_cuda.py: each precision against a hand-written CUDA loop, a real fp16 overflow,
#      DDP with nccl, FSDP2 and (carried) DeepSpeed ZeRO against one device, resume bit for bit
#      with CUDA's random state;
#   3. benchmarks/overhead.py --device cuda: the per-step overhead on a tiny model on the GPU;
#   4. benchmarks/gpt_throughput.py: FSDP2 under torchrun against a hand-written FSDP2 loop;
#   4b. benchmarks/liger.py: use_liger_kernel=True against the unpatched Llama, peak memory and step time
#      (tests/gpu/test_liger_gpu.py and test_optimizer_libs_cuda.py run with test_cuda.py in 2.; liger-kernel's wheel from gpu_wheels.sh);
#   5. the whole suite with the GPU visible, for what time is left of BUDGET seconds.
# Results go to $OUT (the device tool's folder) or ./gpu-out.
#
#   bash benchmarks/gpu_session.sh            # BUDGET=540 s by default
#   bash benchmarks/gpu_session.sh --tiny     # on the CPU: only the Liger line, on a tiny model (its own check)
#
# Through the device tool: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
# (.whl/ from benchmarks/gpu_wheels.sh: DeepSpeed, which the image lacks; without it its cases skip): with the
# machine's start, ~10 of a session's 15 device minutes. The 2026-11-27 run (H200) took 400 s
# with BUDGET=400; its figures and what it found are in benchmarks/RESULTS.md.
set -u
OUT=${OUT:-gpu-out}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $((BUDGET - (SECONDS - start))); }
liger_line() {  # Liger kernels against the unpatched model: peak memory and step time ratios
  echo "== liger.py: use_liger_kernel=True against the unpatched Llama (peak memory, step time) $*"
  timeout 120 "${PYTHON:-python3}" benchmarks/liger.py "$@" >"$OUT/liger.txt" 2>&1
  echo "liger rc $?"
  grep -E '^(Llama|HFCausalLM|loss from labels)' "$OUT/liger.txt"
}
if [ "${1:-}" = "--tiny" ]; then
  liger_line --tiny
  exit 0
fi

if ls .whl/*.whl >/dev/null 2>&1; then  # DeepSpeed and its needs (benchmarks/gpu_wheels.sh), carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/wheels.txt" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
  python3 -m pip list 2>/dev/null | grep -i -E '^(torch|tensorboard|tqdm|safetensors|deepspeed|numpy|pytest|pytest-xdist|transformers|lightning|accelerate|liger[-_]kernel|triton) '
  nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== gpt_peers.py: hand loop, lightlike, HF Trainer, Lightning (one process each), first: issue 33's table"
python3 -c "import lightning, transformers, accelerate; print('lightning', lightning.__version__, 'transformers', \
  transformers.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tail -1
# 20 timed steps after 10, each driver in its own process, its row printed as it ends (a missing
# peer is skipped with a note; lightlike-regions last, so that a cut keeps the four main rows)
timeout 300 python3 benchmarks/gpt_peers.py --drivers hand,lightlike,hf,lightning,lightlike-regions --steps 30 \
  --warmup 10 --timeout 100 >"$OUT/gpt_peers.txt" 2>&1
tail -12 "$OUT/gpt_peers.txt"

export LIGHTLIKE_TEST_GPU=1  # tests/conftest.py hides the GPU from the tests without it
echo "== tests/gpu/test_cuda.py, $(left) s left"
# one worker per test (pyproject's --dist loadfile and 4 workers ran the file's 14 tests one after
# another: each launch starts CUDA, and over 180 s the last two, three launches each, did not finish)
timeout 180 python3 -m pytest tests/gpu/test_cuda.py tests/gpu/test_liger_gpu.py tests/gpu/test_optimizer_libs_cuda.py -n 14 --maxprocesses 14 --dist load -p no:cacheprovider \
  -v -o console_output_style=classic --durations=0 --junitxml="$OUT/cuda.xml" >"$OUT/cuda.log" 2>&1
grep -E ' (PASSED|FAILED|ERROR) |passed|failed' "$OUT/cuda.log" | sed 's/^\[gw[0-9]*\] *//' | tail -20

echo "== overhead.py --device cuda"
[ "$(left)" -gt 60 ] && timeout 60 python3 benchmarks/overhead.py --device cuda --steps 2000 --repeats 5 >"$OUT/overhead_cuda.txt" 2>&1
tail -8 "$OUT/overhead_cuda.txt"

[ "$(left)" -gt 150 ] && liger_line

rest=$(left)
if [ "$rest" -gt 100 ]; then
  echo "== gpt_throughput.py, FSDP2 under torchrun (1 process)"
  timeout 90 python3 -m torch.distributed.run --nproc_per_node 1 benchmarks/gpt_throughput.py --strategy fsdp \
    --steps 30 --warmup 10 >"$OUT/gpt_fsdp.txt" 2>&1
  tail -8 "$OUT/gpt_fsdp.txt"
fi

rest=$(left)
echo "== the whole suite with the GPU visible (a probe: tests that compare with CPU tensors or start two ranks fail), $rest s"
if [ "$rest" -gt 30 ]; then
  timeout "$rest" python3 -m pytest tests -n 14 --maxprocesses 14 -p no:cacheprovider -v -o console_output_style=classic \
    >"$OUT/suite.log" 2>&1
  echo "suite rc $?"
  grep -c ' PASSED ' "$OUT/suite.log"
  grep -E ' (FAILED|ERROR) ' "$OUT/suite.log" | sed 's/^\[gw[0-9]*\] *//' | sort | head -60
  tail -3 "$OUT/suite.log"
fi
