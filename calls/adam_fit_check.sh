#!/usr/bin/env bash
# Issue 72, items 2 and 3 on one H200 (7b-8l): blocked and overlapped with the CPU Adam's calls no longer scaled up
# (efficiency at most 1.02?), the bound's GPU tests, then --grad-accum 4 overlapped
# (its step against the resident gpu mode's). Logs and JSON under $OUT, within 420 s.
source calls/runs.sh
run bo1 130 --mode blocked,overlapped
timeout 100 python3 -m pytest -p no:cacheprovider -q -rfE --tb=short tests/test_train_gpu.py -k "bound" > $OUT/test.log 2>&1
tail -3 $OUT/test.log
run ga4 70 --mode overlapped --grad-accum 4
