#!/usr/bin/env bash
# 7b-8l blocked and overlapped first (the bound's CPU Adam as a step runs it: efficiency at most 1.02?), then every GPU
# test file (calls/gpu_tests.sh, about 345 s). Logs and JSON under $OUT; give the call 560 s.
source calls/runs.sh
run bo1 100 --mode blocked,overlapped
bash calls/gpu_tests.sh
