"""One line a JSON file under argv[1]: each mode's inference or training figures that the calls compare."""

import json
import sys
from pathlib import Path

for path in sorted(Path(sys.argv[1]).glob("*.json")):
    try:
        results = json.loads(path.read_text())["results"]
    except (ValueError, KeyError) as e:
        print(path.name, "unreadable:", e)
        continue
    for mode, r in results.items():
        for kind in ("inference", "training"):
            t = r.get(kind) if isinstance(r, dict) else None
            if not t:
                continue
            keys = ("time_ms", "bound_ms", "bound_by", "efficiency", "model_tflops", "executed_tflops", "tokens_per_s")
            keys += ("peak_gpu_bytes", "peak_host_bytes", "setup_s", "gpu_compute_ms", "resident_adam_ms")
            cells = []
            for k in keys:
                v = t.get(k)
                if v is None:
                    continue
                if k.endswith("_bytes"):
                    v = f"{v / 2**30:.2f}GiB"
                elif isinstance(v, float):
                    v = f"{v:.3f}" if v < 10 else f"{v:.1f}"
                cells.append(f"{k}={v}")
            print(path.name, mode, kind, " ".join(cells))
