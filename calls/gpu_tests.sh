#!/usr/bin/env bash
# Every GPU test file at this commit, in two pytest processes side by side on the one GPU (test_train_gpu.py over two
# xdist workers; the other files in one process, so conftest's memory runs run once), each test's result a line.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
sha256sum offload_llama.py | tee $OUT/version.txt
git log --oneline -1 >> $OUT/version.txt 2>/dev/null
T="-p no:cacheprovider -rfE --tb=short --timeout 400"
(timeout 560 python3 -m pytest $T -v -n 2 --dist load tests/test_train_gpu.py > $OUT/train_gpu.log 2>&1; echo "rc=$?" >> $OUT/train_gpu.log) &
timeout 560 python3 -m pytest $T -v tests/test_gpu.py tests/test_placement_gpu.py tests/test_disk_gpu.py \
  tests/test_saving_gpu.py tests/test_data_gpu.py tests/test_ranks_gpu.py > $OUT/other_gpu.log 2>&1; echo "rc=$?" >> $OUT/other_gpu.log
wait
for f in $OUT/train_gpu.log $OUT/other_gpu.log; do echo "== $f"; grep -E "FAILED|ERROR|passed|failed|rc=" $f | tail -30; done
