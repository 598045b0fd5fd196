#!/usr/bin/env bash
# call b (x2): the first half of the two-GPU tests at the final script, then the old and new scripts side by side.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/b; mkdir -p $O
source calls/side.sh
sha256sum offload_llama.py calls/old_offload.py > $O/version.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -rA --durations=10 tests/test_ranks_gpu.py -k "train_as_one or more_ranks or compose" > $O/tests_ranks_1.log 2>&1; echo "ranks 1 rc $? at $SECONDS s"
tail -n 2 $O/tests_ranks_1.log
[ $SECONDS -lt 360 ] && side 1
python3 calls/summary.py $O
cd $OUT && tar czf b.tgz b && rm -rf b
