#!/usr/bin/env bash
# Issue 72, items 2, 3 and 6, on one H200 (7b-8l), with the CPU Adam's chain in the bound and the H200's rates in the
# plan: overlapped and the resident gpu mode at --grad-accum 4, blocked and overlapped at 1, overlapped at 16; then the
# GPU test files the change touches (the bound, the trace, the placements). Logs and JSON under $OUT; give it 600 s.
source calls/runs.sh
run ga4 90 --mode overlapped --grad-accum 4
run ga4_gpu 60 --mode gpu --grad-accum 4
run bo1 100 --mode blocked,overlapped
run ga16 120 --mode overlapped --grad-accum 16
T="-p no:cacheprovider -rfE --tb=short --timeout 300"
timeout $(( 590 - SECONDS )) python3 -m pytest $T -q -n 2 tests/test_train_gpu.py tests/test_placement_gpu.py \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at $SECONDS s"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -20
