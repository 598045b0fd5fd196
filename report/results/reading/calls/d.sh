#!/usr/bin/env bash
# call d (x2): the two-GPU test that call c's time cut (two launchers), then the old and new scripts side by side once more.
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT/d; mkdir -p $O
source calls/side.sh
sha256sum offload_llama.py calls/old_offload.py > $O/version.txt
timeout 300 python3 -m pytest -q -p no:cacheprovider -rA --durations=5 tests/test_ranks_gpu.py -k "two_launchers" > $O/tests_ranks_3.log 2>&1; echo "ranks 3 rc $? at $SECONDS s"
tail -n 2 $O/tests_ranks_3.log
[ $SECONDS -lt 330 ] && side 3
python3 calls/summary.py $O
cd $OUT && tar czf d.tgz d && rm -rf d
