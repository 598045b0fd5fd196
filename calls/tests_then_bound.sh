#!/usr/bin/env bash
# Every GPU test file (calls/gpu_tests.sh), then while the call's 440 s last, 7b-8l blocked and overlapped (the bound's
# CPU Adam fixed: efficiency at most 1.02?). Logs and JSON under $OUT.
bash calls/gpu_tests.sh
source calls/runs.sh
if (( SECONDS < 360 )); then run bo1 $(( 430 - SECONDS )) --mode blocked,overlapped; fi
