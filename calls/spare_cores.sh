#!/usr/bin/env bash
# Issue 72, item 2, on one H200 (7b-8l): --grad-accum 4 overlapped with the CPU Adam leaving 1 and 2 cores to the
# threads that drive the GPU, and with Python's collector kept off the set-up's objects (the step after each bound
# round, with no update pending, ran 433 ms against 480-520 in the others, and 437 in the resident gpu mode).
# Logs and JSON under $OUT, within 420 s.
source calls/runs.sh
for variant in "1 on" "2 on" "1 frozen"; do
  name=ga4_$(echo $variant | tr ' ' '_')
  if (( SECONDS + 70 > 420 )); then echo "$name skipped: $SECONDS s spent"; continue; fi
  timeout 70 python3 calls/variant.py $variant --train --no-inference --mode overlapped --grad-accum 4 \
    --json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$? at $SECONDS s"
  grep -E "^\| overlapped |bound, each part|  step " $OUT/$name.log | cut -c1-300
done
