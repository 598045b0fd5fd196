#!/usr/bin/env bash
# Recompute only what memory forces, on one H200 (7b-8l): overlapped and the resident gpu mode at --grad-accum 4, blocked
# and overlapped at 1, overlapped at 16, while 420 s last; then the new GPU test. Logs and JSON under $OUT.
source calls/runs.sh
run ga4 120 --mode overlapped --grad-accum 4
run ga4_gpu 60 --mode gpu --grad-accum 4
run bo1 130 --mode blocked,overlapped
run ga16 150 --mode overlapped --grad-accum 16
timeout $(( 420 - SECONDS )) python3 -m pytest -p no:cacheprovider -q -rfE --tb=short tests/test_train_gpu.py -k keeping_their_graphs > $OUT/test.log 2>&1; tail -3 $OUT/test.log
