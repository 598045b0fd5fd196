#!/usr/bin/env bash
# Issue 72 at e5dc161 on one H200, call 7: the gpu mode's recomputed step traced (calls/gpu_trace.py) and summarised
# beside the segments' (calls/final_6.sh), whose step executes 3% fewer TFLOPS (441.8 against 456.9, the remade
# forwards counted): which kernels differ. Give it 150 s.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee $OUT/version.txt
timeout 100 python3 calls/gpu_trace.py /tmp/gpu_trace.json > $OUT/gpu_trace.log 2>&1
echo "trace rc=$? at $SECONDS s"; tail -3 $OUT/gpu_trace.log
timeout 40 python3 calls/trace_summary.py /tmp/gpu_trace.json 2>&1 | tee $OUT/summary.txt
