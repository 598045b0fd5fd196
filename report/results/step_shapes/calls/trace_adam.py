"""Call o's trace read for the CPU Adam against the forward: for each traced step, when the compute stream's forward
ran, how long its gaps were, and how many of the CPU Adam's units (the compiled update, on its worker thread) ran
inside the forward. Usage: python3 trace_adam.py TRACE.json.gz OUT.json"""

import gzip
import json
import sys

with gzip.open(sys.argv[1], "rt") as f:
    events = json.load(f)
spans = [e for e in events if e.get("ph") == "X"]
gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
t0 = min(e["ts"] for e in gpu)
adam = sorted((e for e in spans if e.get("name") == "Torch-Compiled Region: 0/0"), key=lambda e: e["ts"])
backward = sorted((e for e in spans if e.get("name") == "StreamedUnitBackward"), key=lambda e: e["ts"])
forward = sorted((e for e in spans if e.get("name") == "StreamedUnit"), key=lambda e: e["ts"])
steps, phases = [], []  # each forward: the host's StreamedUnit calls between two backwards
for e in sorted(forward + backward, key=lambda e: e["ts"]):
    if e["name"] == "StreamedUnit":
        if not phases or phases[-1][1] is not None:
            phases.append([[], None])
        phases[-1][0].append(e)
    elif phases and phases[-1][1] is None:
        phases[-1][1] = e["ts"]  # the first backward after that forward
for fwd, first_bwd in phases:
    begin = fwd[0]["ts"]
    inside = [a for a in adam if begin <= a["ts"] < first_bwd]
    steps.append(
        {
            "forward_host_ms": round((first_bwd - begin) / 1e3, 1),
            "forward_units": len(fwd),
            "units_over_20ms": sum(f["dur"] > 20_000 for f in fwd),
            "host_ms_in_those": round(sum(f["dur"] for f in fwd if f["dur"] > 20_000) / 1e3, 1),
            "cpu_adam_units_in_forward": len(inside),
            "cpu_adam_ms_in_forward": round(sum(a["dur"] for a in inside) / 1e3, 1),
            "cpu_adam_ms_each": [round(a["dur"] / 1e3, 1) for a in inside],
        }
    )
summary = {"cpu_adam_units": len(adam), "cpu_adam_ms": round(sum(a["dur"] for a in adam) / 1e3, 1), "steps": steps}
with open(sys.argv[2], "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary))
