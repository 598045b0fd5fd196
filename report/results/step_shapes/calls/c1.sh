#!/usr/bin/env bash
# call 1 (x1): set-up physics; a trace of two 4-micro-batch steps; text against random ids at 590M, 4 x 1024 tokens
set -o pipefail
export PYTHONUNBUFFERED=1
O=$OUT; sha256sum offload_llama.py > $O/version.txt; nvidia-smi --query-gpu=name,memory.total --format=csv >> $O/version.txt
timeout 150 python3 calls/probe_setup.py $O/probe_setup.json > $O/probe_setup.log 2>&1; echo "probe rc $?"
F7="--preset 7b-8l --mode overlapped --train --no-inference --dtype bfloat16 --batch-size 1 --seq-len 4096"
mkdir -p /tmp/t
timeout 150 python3 calls/trace_two_steps.py /tmp/t $F7 --grad-accum 4 --steps 4 --warmup 2 --repeat 1 --json $O/trace_accum4.json > $O/trace_accum4.log 2>&1; echo "trace rc $?"
cp /tmp/t/trace.train.json.gz $O/ 2>/dev/null; python3 calls/trace_gaps.py /tmp/t/trace.train.json.gz $O/trace_gaps.json > $O/trace_gaps.txt 2>&1; echo "gaps rc $?"
head -c 6000 $O/trace_gaps.txt
corpus=/tmp/stdlib_corpus
python3 -c "
import pathlib, shutil, sys, sysconfig
src, dst = pathlib.Path(sysconfig.get_paths()['stdlib']), pathlib.Path(sys.argv[1])
for f in src.rglob('*.py'):
    if f.relative_to(src).parts[0] != 'site-packages' and f.is_file():
        (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst / f.relative_to(src))" "$corpus"
M="--hidden-size 2048 --intermediate-size 5504 --layers 11 --heads 16 --kv-heads 16 --vocab-size 8192"
B="--mode overlapped --train --no-inference $M --seq-len 1024 --batch-size 4 --grad-accum 1 --dtype bfloat16 --steps 60 --warmup 5 --repeat 2"
D="--data $corpus --data-glob *.py --skip-undecodable --train-tokenizer 8192 --data-cache /tmp/text_cache"
timeout 120 python3 offload_llama.py $B $D --steps 2 --warmup 1 --repeat 1 > /dev/null 2>&1  # the tokenizer and cache, untimed
for r in 1 2; do
  timeout 100 python3 offload_llama.py $B $D --json $O/text_$r.json > $O/text_$r.md 2> $O/text_$r.log; echo "text $r rc $?"
  timeout 100 python3 offload_llama.py $B --json $O/random_$r.json > $O/random_$r.md 2> $O/random_$r.log; echo "random $r rc $?"
done
cd $O && tar czf runs.tgz text_* random_* trace_accum4.* && rm -f text_* random_* trace_accum4.*
python3 - <<'PY'
import json, tarfile
t = tarfile.open("runs.tgz")
for n in sorted(t.getnames()):
    if n.endswith(".json"):
        r = json.load(t.extractfile(n)); tr = r["results"]["overlapped"]["training"]
        print(n, round(tr["time_ms"], 2), "bound", round(tr.get("bound_ms") or 0, 1), sorted(round(x, 1) for x in tr["step_ms"])[:5])
PY
