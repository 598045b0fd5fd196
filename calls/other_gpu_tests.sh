#!/usr/bin/env bash
# The GPU test files but test_train_gpu.py and test_placement_gpu.py (calls/rows_and_tests.sh runs those), in one
# process, each test's result a line; about 350 s.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee $OUT/version.txt
T="-p no:cacheprovider -rfE --tb=short --timeout 300"
timeout 500 python3 -m pytest $T -v tests/test_gpu.py tests/test_disk_gpu.py tests/test_saving_gpu.py \
  tests/test_data_gpu.py tests/test_ranks_gpu.py > $OUT/other_gpu.log 2>&1
echo "rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/other_gpu.log | tail -20
