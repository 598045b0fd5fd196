#!/usr/bin/env bash
# Issue 72 at e5dc161 on one H200, call 4: the one-micro-batch step's spread (item 2 at --grad-accum 1: 0.854 of its
# bound in calls/final_2.sh), overlapped three times, then --grad-accum 4 against the gpu mode once more. Logs and
# JSON under $OUT; give it 300 s.
source calls/runs.sh
run o1_a 60 --mode overlapped
run o1_b 60 --mode overlapped
run o1_c 60 --mode overlapped
run ga4 70 --mode overlapped --grad-accum 4
run ga4_gpu 50 --mode gpu --grad-accum 4
cd $OUT && tar czf rows.tar.gz o1_* ga4.* ga4_gpu.* && rm o1_* ga4.* ga4_gpu.*  # 8 files come back
