#!/usr/bin/env bash
# Issue 72, items 2 and 6, on one H200 (7b-8l): the gradient-copy trace test twice at 8192 tokens; then overlapped with
# the CPU Adam leaving 1 or 3 cores to the threads that drive the GPU (--grad-accum 1: the in-step Adam was busy 410-450
# ms a step against 339 alone), and at --grad-accum 4 with Python's collector kept off the set-up's objects. Within 420 s.
source calls/runs.sh
for i in 1 2; do
  timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_train_gpu.py -k "gradient_copies_under or overlaps_nothing" \
    > $OUT/trace_$i.log 2>&1
  echo "trace $i rc=$? at $SECONDS s"; grep -E "passed|failed|Error" $OUT/trace_$i.log | cut -c1-400
done
for case in "1 1 on" "1 3 on" "4 1 on" "4 3 on" "4 1 frozen"; do
  set -- $case
  name=ga$1_$2_$3
  if (( SECONDS + 65 > 420 )); then echo "$name skipped: $SECONDS s spent"; continue; fi
  timeout 65 python3 calls/variant.py $2 $3 --train --no-inference --mode overlapped --grad-accum $1 \
    --json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc=$? at $SECONDS s"
  grep -E "^\| overlapped |  step " $OUT/$name.log | cut -c1-200
done
