"""Summarise a Chrome trace of --profile: per stream, kernel time and busy span; the kernels taking the most time;
the host's waits on the GPU. Usage: python3 calls/trace_summary.py TRACE.json"""

import collections
import json
import sys


def busy(intervals: list) -> float:
    """The time covered by the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


with open(sys.argv[1]) as f:
    events = json.load(f)["traceEvents"]
kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
start, stop = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
print(f"kernels {len(kernels)}, span {(stop - start) / 1e3:.1f} ms")
by_stream = collections.defaultdict(list)
for e in kernels:
    by_stream[e["args"].get("stream", e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
for stream, spans in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
    summed = sum(b - a for a, b in spans) / 1e3
    print(f"stream {stream}: {len(spans)} kernels, {summed:.1f} ms, busy {busy(spans) / 1e3:.1f} ms")
print(f"all streams busy {busy([(e['ts'], e['ts'] + e['dur']) for e in kernels]) / 1e3:.1f} ms")
names = collections.Counter()
counts = collections.Counter()
for e in kernels:
    names[e["name"][:110]] += e["dur"]
    counts[e["name"][:110]] += 1
for name, dur in names.most_common(25):
    print(f"{dur / 1e3:9.1f} ms {counts[name]:6d}x  {name}")
runtime = collections.Counter()
runtime_n = collections.Counter()
for e in events:
    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
        runtime[e["name"]] += e["dur"]
        runtime_n[e["name"]] += 1
for name, dur in runtime.most_common(12):
    print(f"host {dur / 1e3:9.1f} ms {runtime_n[name]:6d}x  {name}")
