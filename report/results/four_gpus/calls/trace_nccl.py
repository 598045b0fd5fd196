"""A traced step of one rank: the compute stream's busy time, idle gaps and what ran beside them, the NCCL kernels'
time, and how much slower the compute stream's kernels ran while an NCCL kernel ran (same kernel name, mean duration
with and without one beside it). argv: trace.json, out.json."""

import bisect
import collections
import gzip
import json
import sys

opener = gzip.open if sys.argv[1].endswith(".gz") else open
events = json.load(opener(sys.argv[1], "rt"))
events = events["traceEvents"] if isinstance(events, dict) else events
gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def is_nccl(e) -> bool:
    """Whether a GPU event is an NCCL kernel."""
    return e["cat"] == "kernel" and "nccl" in e["name"].lower()


streams = collections.defaultdict(list)
for e in gpu:
    streams[e["args"].get("stream", e.get("tid"))].append(e)
compute = max(streams, key=lambda s: sum(1 for e in streams[s] if e["cat"] == "kernel" and not is_nccl(e)))
ks = sorted(streams[compute], key=lambda e: e["ts"])
nccl = sorted((e for e in gpu if is_nccl(e)), key=lambda e: e["ts"])


def union(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


nccl_spans = union((e["ts"], e["ts"] + e["dur"]) for e in nccl)
starts = [a for a, _ in nccl_spans]


def overlap(a, b):
    i = max(0, bisect.bisect_right(starts, a) - 1)
    got = 0.0
    while i < len(nccl_spans) and nccl_spans[i][0] < b:
        got += max(0.0, min(b, nccl_spans[i][1]) - max(a, nccl_spans[i][0]))
        i += 1
    return got


busy = sum(e["dur"] for e in ks)
span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
by_name = collections.defaultdict(lambda: [[], []])  # name -> durations alone, durations beside NCCL
for e in ks:
    if e["cat"] != "kernel":
        continue
    beside = overlap(e["ts"], e["ts"] + e["dur"]) > 0.5 * e["dur"]
    by_name[e["name"][:70]][beside].append(e["dur"])
slow = []
for name, (alone, beside) in by_name.items():
    if alone and beside:
        a, b = sum(alone) / len(alone), sum(beside) / len(beside)
        slow.append(
            {
                "kernel": name,
                "alone_us": round(a, 1),
                "beside_nccl_us": round(b, 1),
                "n_beside": len(beside),
                "extra_ms": round((b - a) * len(beside) / 1e3, 2),
            }
        )
slow.sort(key=lambda r: -r["extra_ms"])
nccl_by = collections.Counter()
for e in nccl:
    nccl_by[e["name"].split("(")[0][:60]] += e["dur"]
gaps, end = [], ks[0]["ts"] + ks[0]["dur"]
for e in ks[1:]:
    idle = e["ts"] - end
    if idle > 300:
        others = []
        for s, v in streams.items():
            if s == compute:
                continue
            b = sum(max(0, min(x["ts"] + x["dur"], e["ts"]) - max(x["ts"], end)) for x in v)
            if b > 0:
                others.append(f"{s}:{b / 1e3:.1f}ms")
        gaps.append(
            {
                "at_ms": round((end - ks[0]["ts"]) / 1e3, 1),
                "idle_ms": round(idle / 1e3, 2),
                "next": e["name"][:50],
                "others": " ".join(others),
            }
        )
    end = max(end, e["ts"] + e["dur"])
summary = {
    "span_ms": round(span / 1e3, 1),
    "compute_busy_ms": round(busy / 1e3, 1),
    "idle_in_gaps_ms": round(sum(g["idle_ms"] for g in gaps), 1),
    "nccl_kernel_ms": round(sum(e["dur"] for e in nccl) / 1e3, 1),
    "nccl_union_ms": round(sum(b - a for a, b in nccl_spans) / 1e3, 1),
    "compute_under_nccl_ms": round(sum(overlap(e["ts"], e["ts"] + e["dur"]) for e in ks) / 1e3, 1),
    "slowdown_beside_nccl_ms": round(sum(r["extra_ms"] for r in slow), 1),
    "nccl_by_kind_ms": {k: round(v / 1e3, 1) for k, v in nccl_by.most_common()},
    "streams": {
        str(s): {"ops": len(v), "busy_ms": round(sum(e["dur"] for e in v) / 1e3, 1)} for s, v in streams.items()
    },  # noqa: E501
}
with open(sys.argv[2], "w") as f:
    json.dump(summary | {"slow": slow[:30], "gaps": gaps}, f, indent=1)
print(json.dumps(summary))
for r in slow[:12]:
    print(r)
for g in sorted(gaps, key=lambda g: -g["idle_ms"])[:15]:
    print(g)
