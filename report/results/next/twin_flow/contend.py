"""How the CPU Adam and the copy engines share host memory: the compiled Adam over one LLaMA-7B layer's scratch state
alone, and while H2D, D2H or both stream without pause; the copies' rates alone and beside the Adam.
Threads: the Adam compiled for 15 threads (the committed default) and for fewer."""
import json, os, statistics, sys, time
import torch
sys.path.insert(0, os.getcwd())
import offload_llama as ol

N = 202_383_360  # a LLaMA-7B decoder layer's parameters
out = {}
dev = torch.device("cuda")


def scratch_adam(update):
    """A function that steps one layer's scratch state (float32 master and moments, bfloat16 gradients and copy)."""
    master, m, v = (ol.host_zeros(N, torch.float32, False) for _ in range(3))
    master.normal_()
    g = ol.host_zeros(N, torch.bfloat16, False).normal_().mul_(1e-3)
    c = ol.host_zeros(N, torch.bfloat16, False)
    step = torch.zeros(())
    return lambda: update(master, g, m, v, c, step)


CH = 2**28  # 512 MiB of bf16 per copy
h_src = ol.host_zeros(CH, torch.bfloat16, True)
h_dst = ol.host_zeros(CH, torch.bfloat16, True)
d_buf = torch.empty(CH, dtype=torch.bfloat16, device=dev)
d_src = torch.empty(CH, dtype=torch.bfloat16, device=dev)
s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()


def enqueue(kind, count):
    """Queue `count` copies of 512 MiB; return (start, end) events per stream used."""
    ev = {}
    for name, stream, dst, src in (("h2d", s_in, d_buf, h_src), ("d2h", s_out, h_dst, d_src)):
        if kind in (name, "both"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                a.record()
                for _ in range(count):
                    dst.copy_(src, non_blocking=True)
                b.record()
            ev[name] = (a, b, count * CH * 2)
    return ev


def rates(ev):
    """GB/s of each stream's queued copies, once they are done."""
    torch.cuda.synchronize()
    return {k: round(nb / a.elapsed_time(b) / 1e6, 1) for k, (a, b, nb) in ev.items()}


for kind in ("h2d", "d2h", "both"):
    enqueue(kind, 2); torch.cuda.synchronize()
    out[f"dma_alone_{kind}_gbps"] = rates(enqueue(kind, 16))
print(json.dumps(out), flush=True)

for spare in (1, 8):
    ol.ADAM_SPARE_CORES = spare
    ol.compiled_adam_update.cache_clear()
    upd = ol.AdamUpdate(ol.Adam(), torch.bfloat16, torch.bfloat16)
    threads = torch.get_num_threads() - spare
    adam = scratch_adam(upd)
    adam()
    alone = []
    for _ in range(5):
        t = time.perf_counter(); adam(); alone.append((time.perf_counter() - t) * 1e3)
    r = {"alone_ms": alone}
    for kind in ("h2d", "d2h", "both"):
        ev = enqueue(kind, 60)  # about 0.6 s per direction at 50 GB/s
        time.sleep(0.01)
        during = []
        while not all(b.query() for a, b, nb in ev.values()):  # the Adam runs for as long as the copies do
            t = time.perf_counter(); adam(); during.append((time.perf_counter() - t) * 1e3)
        during = during[:-1]  # the last one may outlast the copies
        r[f"with_{kind}_ms"] = during
        r[f"with_{kind}_dma_gbps"] = rates(ev)
    out[f"threads_{threads}"] = r
    print(json.dumps({f"threads_{threads}": r}), flush=True)
    del adam
print("RESULT", json.dumps(out))
