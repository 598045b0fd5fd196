# Sourced by the calls' scripts: the version line, and run(), one training run that fits what is left of 590 s.
set -u
export PYTHONUNBUFFERED=1
sha256sum offload_llama.py | tee -a $OUT/version.txt
run() {  # run NAME LIMIT ARGS...: one training run, if LIMIT seconds are left before 590
  local name=$1 limit=$2; shift 2
  if (( SECONDS + limit > 590 )); then echo "$name skipped: $SECONDS s spent"; return; fi
  timeout $limit python3 offload_llama.py --train --no-inference --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$? at $SECONDS s"
  grep -E "^\| (gpu|w/o|blocked|overlapped) |bound, each part|keeping their graphs|Error|error" $OUT/$name.log | cut -c1-900
}
