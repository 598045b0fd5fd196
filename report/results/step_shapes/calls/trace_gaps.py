"""Where a traced step's compute stream idles: each gap over 0.3 ms, whether the host launched the next kernel late
(launch-bound) or early (the stream waited), what the other streams did then, and the host op around the launch."""

import collections
import gzip
import json
import sys

with gzip.open(sys.argv[1], "rt") as f:
    events = json.load(f)
gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
streams = collections.defaultdict(list)
for e in gpu:
    streams[e["args"].get("stream", e.get("tid"))].append(e)
compute = max(streams, key=lambda s: sum(1 for e in streams[s] if e["cat"] == "kernel"))
runtime = {
    e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
}
cpu_ops = sorted(
    (e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation")),
    key=lambda e: e["ts"],
)
t0 = min(e["ts"] for e in gpu)
ks = sorted(streams[compute], key=lambda e: e["ts"])
busy = sum(e["dur"] for e in ks)
span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
summary = {
    "compute_stream": compute,
    "span_ms": round(span / 1e3, 1),
    "busy_ms": round(busy / 1e3, 1),
    "streams": {
        str(s): {"ops": len(v), "busy_ms": round(sum(e["dur"] for e in v) / 1e3, 1)} for s, v in streams.items()
    },
}
gaps, end = [], ks[0]["ts"] + ks[0]["dur"]
for e in ks[1:]:
    idle = e["ts"] - end
    if idle > 300:
        launch = runtime.get(e["args"].get("correlation"))
        lag = None if launch is None else (e["ts"] - (launch["ts"] + launch["dur"])) / 1e3
        others = []
        for s, v in streams.items():
            if s == compute:
                continue
            busy_in = sum(max(0, min(x["ts"] + x["dur"], e["ts"]) - max(x["ts"], end)) for x in v)
            if busy_in > 0:
                others.append(f"{s}:{busy_in / 1e3:.1f}ms")
        host = ""
        if launch is not None:
            enclosing = [
                o
                for o in cpu_ops
                if o["ts"] <= launch["ts"] <= o["ts"] + o["dur"] and o.get("tid") == launch.get("tid")
            ]
            host = " < ".join(o["name"][:40] for o in enclosing[-3:])
        gaps.append(
            {
                "at_ms": round((end - t0) / 1e3, 1),
                "idle_ms": round(idle / 1e3, 2),
                "launched_before_start_ms": None if lag is None else round(lag, 2),
                "launch_call": launch["name"] if launch else None,
                "next": e["name"][:50],
                "other_streams_busy": " ".join(others),
                "host": host,
            }
        )
    end = max(end, e["ts"] + e["dur"])
summary["idle_ms"] = round(sum(g["idle_ms"] for g in gaps), 1)
summary["launch_bound_ms"] = round(sum(g["idle_ms"] for g in gaps if (g["launched_before_start_ms"] or 0) < 0.05), 1)
summary["gaps"] = gaps
with open(sys.argv[2], "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps({k: v for k, v in summary.items() if k != "gaps"}))
for g in sorted(gaps, key=lambda g: -g["idle_ms"])[:40]:
    print(g)
