#!/usr/bin/env bash
# Issue 72 at e5dc161 on one H200, call 3 of 3: the GPU test files calls/final_1.sh does not run (item 6).
bash calls/other_gpu_tests.sh
