#!/bin/bash
# One run on a lent GPU machine (the device tool), from the repository root:
#   bash benchmarks/device_run.sh            # results under $OUT (or ./bench/gpu)
# The machine has PyTorch and Triton but no network; headwise installs without deps.
# Kernel tests first (the same tests CI runs in Triton's interpreter, here on CUDA),
# then the GPU benchmark, with the decode step eager vs CUDA graphs vs graphs over the
# torch.compile'd body (issue #19).
# Engine tests need the default model's tokenizer (not carried).
set -o pipefail
export PYTHONUNBUFFERED=1
DEST="${OUT:-bench/gpu}"
mkdir -p "$DEST"
pip install -q --no-deps -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$DEST/gpu.txt"
python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py 2>&1 | tee "$DEST/kernel_tests.log" | tail -5
python benchmarks/gpu.py --out-dir "$DEST" --capture "$@" 2>&1 | tee "$DEST/gpu.log"
