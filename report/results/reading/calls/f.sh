#!/usr/bin/env bash
# call f (x4): at the final script, the four-GPU tests, then the one-GPU test files spread over the four GPUs at once.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/f; mkdir -p $O
{ sha256sum offload_llama.py; nvidia-smi -L; free -g; nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > $O/version.txt 2>&1
T=tests/test_ranks_gpu.py
timeout 150 python3 -m pytest -q -p no:cacheprovider -rA "$T::test_gpus_train_as_one_on_every_micro_batch[bfloat16-4-4]" "$T::test_ranks_run_the_offloaded_forward_to_one_gpus_logits_bitwise[4]" > $O/tests_ranks_4gpus.log 2>&1; echo "4 gpus rc $? at $SECONDS s"
tail -n 3 $O/tests_ranks_4gpus.log
left=$((345 - SECONDS))
P="python3 -m pytest -q -p no:cacheprovider -rfE"
CUDA_VISIBLE_DEVICES=0 timeout $left $P tests/test_train_gpu.py > $O/tests_train_gpu.log 2>&1 & A=$!
CUDA_VISIBLE_DEVICES=1 timeout $left $P tests/test_gpu.py tests/test_placement_gpu.py > $O/tests_gpu_placement.log 2>&1 & B=$!
CUDA_VISIBLE_DEVICES=2 timeout $left $P tests/test_disk_gpu.py tests/test_saving_gpu.py > $O/tests_disk_saving.log 2>&1 & C=$!
CUDA_VISIBLE_DEVICES=3 timeout $left $P tests/test_data_gpu.py > $O/tests_data_gpu.log 2>&1 & D=$!
for p in $A $B $C $D; do wait $p; echo "rc $? at $SECONDS s"; done
tail -n 2 $O/tests_*.log
cd $OUT && tar czf f.tgz f && rm -rf f
