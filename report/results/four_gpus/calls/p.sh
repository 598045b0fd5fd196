#!/usr/bin/env bash
# call p (x2): the several-rank GPU tests the refactors touch (two launchers, issue 57 item 3; the sharded steppers'
# exactness; the GPU's Adam on two ranks; the sharded inference store; a 2-rank checkpoint resumed on one), then the
# one-GPU test files, split over the two GPUs at once.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/p; mkdir -p $O
{ sha256sum offload_llama.py; git log --oneline -1; nvidia-smi -L; free -g; nproc; } > $O/version.txt 2>&1
K="two_launchers or bfloat16-4-2 or extra2 or offloaded_forward or 2-1"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rA tests/test_ranks_gpu.py -k "$K" > $O/tests_ranks_gpu.log 2>&1; echo "ranks rc $? at $SECONDS s"
tail -n 2 $O/tests_ranks_gpu.log
left=$((575 - SECONDS))
CUDA_VISIBLE_DEVICES=0 timeout $left python3 -m pytest -q -p no:cacheprovider -rfE tests/test_train_gpu.py > $O/tests_train_gpu.log 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout $left python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gpu.py tests/test_placement_gpu.py tests/test_disk_gpu.py tests/test_saving_gpu.py > $O/tests_gpu_files.log 2>&1 &
B=$!
wait $A; echo "train_gpu rc $? at $SECONDS s"; wait $B; echo "gpu files rc $? at $SECONDS s"
tail -n 3 $O/tests_train_gpu.log $O/tests_gpu_files.log
cd $OUT && tar czf p.tgz p && rm -rf p
