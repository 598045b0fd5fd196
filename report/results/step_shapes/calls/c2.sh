#!/usr/bin/env bash
# call 2 (x4): the one-GPU test files on GPUs 1-3 beside a LLaMA-7B set-up on GPU 0; then on GPU 0 alone the step
# shapes (issue 56 item 1: 4 micro-batches before and after, 1 and 16 after) and text against random ids (item 4)
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT; sha256sum offload_llama.py calls/before.py > $O/version.txt
nvidia-smi --query-gpu=index,name,memory.total --format=csv >> $O/version.txt; free -g >> $O/version.txt; nproc >> $O/version.txt
mkdir -p $O/tests
T="timeout 420 python3 -m pytest -q -p no:cacheprovider"
CUDA_VISIBLE_DEVICES=1 $T tests/test_placement_gpu.py > $O/tests/placement.log 2>&1 &
CUDA_VISIBLE_DEVICES=2 $T tests/test_train_gpu.py > $O/tests/train.log 2>&1 &
CUDA_VISIBLE_DEVICES=3 $T tests/test_gpu.py tests/test_bad_input.py tests/test_saving_gpu.py tests/test_disk_gpu.py tests/test_data_gpu.py > $O/tests/rest.log 2>&1 &
export CUDA_VISIBLE_DEVICES=0
L7="--preset llama-7b --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 4 --seq-len 1024 --steps 2 --warmup 1 --repeat 1"
timeout 240 python3 offload_llama.py $L7 --json $O/tests/setup_llama7b.json > $O/tests/setup_llama7b.md 2> $O/tests/setup_llama7b.log; echo "setup llama7b rc $?"
grep -h "state on the host\|weights in the masters\|set-up" $O/tests/setup_llama7b.log $O/tests/setup_llama7b.md
wait
tail -n 2 $O/tests/*.log | grep -v "^$"
F7="--preset 7b-8l --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 1 --seq-len 4096 --steps 6 --warmup 2 --repeat 1"
mkdir -p $O/s
for k in 4 1 16; do
  if [ $k = 4 ]; then timeout 150 python3 calls/before.py $F7 --grad-accum 4 --json $O/s/before_4.json > $O/s/before_4.md 2> $O/s/before_4.log; echo "before $k rc $?"; fi
  timeout 150 python3 offload_llama.py $F7 --grad-accum $k --json $O/s/after_$k.json > $O/s/after_$k.md 2> $O/s/after_$k.log; echo "after $k rc $?"
done
corpus=/tmp/stdlib_corpus
python3 -c "
import pathlib, shutil, sys, sysconfig
src, dst = pathlib.Path(sysconfig.get_paths()['stdlib']), pathlib.Path(sys.argv[1])
for f in src.rglob('*.py'):
    if f.relative_to(src).parts[0] != 'site-packages' and f.is_file():
        (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst / f.relative_to(src))" "$corpus"
M="--hidden-size 2048 --intermediate-size 5504 --layers 11 --heads 16 --kv-heads 16 --vocab-size 8192"
B="--mode overlapped --train --no-inference $M --seq-len 1024 --batch-size 4 --grad-accum 1 --dtype bfloat16 --max-gpu-memory 11 --steps 60 --warmup 5 --repeat 2"
D=(--data "$corpus" --data-glob "*.py" --skip-undecodable --train-tokenizer 8192 --data-cache /tmp/text_cache)
timeout 150 python3 offload_llama.py $B "${D[@]}" --steps 2 --warmup 1 --repeat 1 > /dev/null 2> $O/s/text_prep.log; echo "text prep rc $?"
timeout 100 python3 offload_llama.py $B "${D[@]}" --json $O/s/text.json > $O/s/text.md 2> $O/s/text.log; echo "text rc $?"
timeout 100 python3 offload_llama.py $B --json $O/s/random.json > $O/s/random.md 2> $O/s/random.log; echo "random rc $?"
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/s/*.json")):
    r = json.load(open(f)); t = r["results"]["overlapped"]["training"]
    print(os.path.basename(f), "step", round(t["time_ms"], 1), "bound", round(t.get("bound_ms") or 0, 1), t.get("bound_by"),
          "eff", round(t.get("efficiency") or 0, 3), "TFLOPS", round(t.get("model_tflops") or 0), "peak", round(t.get("peak_gpu_bytes", 0) / 2**30, 2))
PY
cd $O && tar czf tests.tgz tests && tar czf s.tgz s && rm -rf tests s
