#!/usr/bin/env bash
# call a (x2): the one-GPU test files at the final script, split over the two GPUs at once.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/a; mkdir -p $O
{ sha256sum offload_llama.py; nvidia-smi -L; free -g; nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > $O/version.txt 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 575 python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/test_train_gpu.py > $O/tests_train_gpu.log 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 575 python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/test_gpu.py tests/test_placement_gpu.py tests/test_disk_gpu.py tests/test_saving_gpu.py tests/test_data_gpu.py > $O/tests_gpu_files.log 2>&1 &
B=$!
wait $A; echo "train_gpu rc $? at $SECONDS s"; wait $B; echo "gpu files rc $? at $SECONDS s"
tail -n 3 $O/tests_train_gpu.log $O/tests_gpu_files.log
grep -h "^FAILED\|^ERROR" $O/*.log | head -20
cd $OUT && tar czf a.tgz a && rm -rf a
