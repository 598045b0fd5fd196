#!/usr/bin/env bash
# Issue 72 after the segments' micro-batch backward, call 2: the GPU test files of the trainer and the placement
# whole (item 6), then 7b-8l's one-micro-batch step three times and --grad-accum 4 against the gpu mode (item 2).
# Logs and JSON under $OUT (the rows in one tar: 8 files come back); give it 600 s.
source calls/runs.sh
T="-p no:cacheprovider -rfE --tb=short --timeout 250"
timeout 400 python3 -m pytest $T -q -n 2 tests/test_train_gpu.py tests/test_placement_gpu.py > $OUT/tests.log 2>&1
echo "tests rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -8
run o1_a 60 --mode overlapped
run o1_b 60 --mode overlapped
run o1_c 60 --mode overlapped
run ga4 70 --mode overlapped --grad-accum 4
run ga4_gpu 50 --mode gpu --grad-accum 4
cd $OUT && tar czf rows.tar.gz o1_* ga4* && rm o1_* ga4*
