#!/usr/bin/env bash
# The wheels the GPU machines' image lacks (DeepSpeed and what it needs: its Python is 3.12), for
# tests/gpu/test_cuda.py's DeepSpeed cases, and liger-kernel (pure Python over the image's Triton) for
# tests/gpu/test_liger_gpu.py and benchmarks/liger.py, and the optimizer libraries of
# tests/gpu/test_optimizer_libs_cuda.py (bitsandbytes 43 MB of the ~50). Made here, where PyPI is reachable, into .whl/ (ignored
# by git: .git/info/exclude); the device tool carries them (carry=[".whl"]) and
# benchmarks/gpu_session.sh installs them there. ~50 MB (the carry limit is 64 MiB).
#
#   bash benchmarks/gpu_wheels.sh            # needs this checkout's .venv (torch, for DeepSpeed's build)
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
# DeepSpeed has no wheel on PyPI: built from its sdist, pure Python (no ops compiled), with the venv's torch
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
for spec in hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
            typing_extensions==4.16.0 liger-kernel==0.8.5 \
            bitsandbytes==0.50.2 torchao==0.18.0 galore-torch==1.0 schedulefree==1.4.1 lomo-optim==0.1.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls .whl
