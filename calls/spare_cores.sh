#!/usr/bin/env bash
# Issue 72, item 2, on one H200 (7b-8l): --grad-accum 4 overlapped with the CPU Adam leaving 1, 2 and 3 cores to the
# threads that drive the GPU (the step after each bound round, with no update pending, ran 433 ms against 480-520 in
# the others, and 437 in the resident gpu mode). Logs and JSON under $OUT, within 420 s.
source calls/runs.sh
for spare in 1 2 3; do
  if (( SECONDS + 70 > 420 )); then echo "spare $spare skipped: $SECONDS s spent"; continue; fi
  timeout 70 python3 calls/spare_cores.py $spare --train --no-inference --mode overlapped --grad-accum 4 \
    --json $OUT/ga4_spare$spare.json > $OUT/ga4_spare$spare.log 2>&1
  echo "spare $spare rc=$? at $SECONDS s"
  grep -E "^\| overlapped |bound, each part" $OUT/ga4_spare$spare.log | cut -c1-500
done
