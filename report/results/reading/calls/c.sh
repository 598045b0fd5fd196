#!/usr/bin/env bash
# call c (x2): the second half of the two-GPU tests at the final script, then the old and new scripts side by side again.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/c; mkdir -p $O
source calls/side.sh
sha256sum offload_llama.py calls/old_offload.py > $O/version.txt
timeout 360 python3 -m pytest -q -p no:cacheprovider -rA --durations=10 tests/test_ranks_gpu.py -k "not train_as_one and not more_ranks and not compose" > $O/tests_ranks_2.log 2>&1; echo "ranks 2 rc $? at $SECONDS s"
tail -n 2 $O/tests_ranks_2.log
[ $SECONDS -lt 390 ] && side 2
python3 calls/summary.py $O
cd $OUT && tar czf c.tgz c && rm -rf c
