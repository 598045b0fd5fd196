"""Twin flow, the premise: a GPU Adam over state streamed through the copy engines (float32 master and moments in,
12 B/param H2D; master, moments and a bf16 copy out, 14 B/param D2H), beside the CPU Adam over other state. Rates
in parameters per ms alone and together."""
import json, os, statistics as st, sys, time
import torch
sys.path.insert(0, os.getcwd())
import offload_llama as ol

N = 202_383_360
C = 2**24
dev = torch.device("cuda")
adam = ol.Adam()

# the GPU path's host state (pinned) and the gradients it steps with (on the GPU, bf16)
P, M, V = (ol.host_zeros(N, torch.float32, True) for _ in range(3))
P.normal_()
CP = ol.host_zeros(N, torch.bfloat16, True)
G = torch.randn(N, device=dev, dtype=torch.bfloat16) * 1e-3
slots = [[torch.empty(C, device=dev) for _ in range(3)] + [torch.empty(C, device=dev, dtype=torch.bfloat16)]
         for _ in range(2)]
s_in, s_cmp, s_out = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
in_done = [torch.cuda.Event() for _ in range(2)]
cmp_done = [torch.cuda.Event() for _ in range(2)]
out_done = [torch.cuda.Event() for _ in range(2)]
steps = [torch.zeros((), device=dev) for _ in range(2)]


def gpu_path(passes):
    """Queue `passes` updates of the whole unit, chunk by chunk; return (start, end) events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(s_in)
    i = 0
    for _ in range(passes):
        for lo in range(0, N, C):
            n, k = min(C, N - lo), i % 2
            p, m, v, bf = (t[:n] for t in slots[k])
            s_in.wait_event(out_done[k])  # the slot's last chunk has left
            with torch.cuda.stream(s_in):
                for dst, src in ((p, P), (m, M), (v, V)):
                    dst.copy_(src[lo:lo + n], non_blocking=True)
                in_done[k].record()
            s_cmp.wait_event(in_done[k])
            with torch.cuda.stream(s_cmp):
                ol.torch_adam_step(adam, p, G[lo:lo + n].float(), m, v, steps[k])
                bf.copy_(p)
                cmp_done[k].record()
            s_out.wait_event(cmp_done[k])
            with torch.cuda.stream(s_out):
                for dst, src in ((P, p), (M, m), (V, v), (CP, bf)):
                    dst[lo:lo + n].copy_(src, non_blocking=True)
                out_done[k].record()
            i += 1
    b.record(s_out)
    return a, b


upd = ol.AdamUpdate(adam, torch.bfloat16, torch.bfloat16)
cpu_state = [ol.host_zeros(N, torch.float32, False) for _ in range(3)]
cpu_state[0].normal_(); cpu_state[1].zero_(); cpu_state[2].zero_()
cg = ol.host_zeros(N, torch.bfloat16, False).normal_().mul_(1e-3)
cc = ol.host_zeros(N, torch.bfloat16, False).zero_()
cstep = torch.zeros(())
cpu_adam = lambda: upd(cpu_state[0], cg, cpu_state[1], cpu_state[2], cc, cstep)

out = {}
a, b = gpu_path(1); torch.cuda.synchronize()
gpu_alone = []
for _ in range(3):
    a, b = gpu_path(2); torch.cuda.synchronize(); gpu_alone.append(2 * N / a.elapsed_time(b))
out["gpu_path_alone_params_per_ms"] = gpu_alone
cpu_alone = []
cpu_adam()
for _ in range(5):
    t = time.perf_counter(); cpu_adam(); cpu_alone.append(N / ((time.perf_counter() - t) * 1e3))
out["cpu_alone_params_per_ms"] = cpu_alone
print(json.dumps(out), flush=True)
for rep in range(3):
    a, b = gpu_path(6)
    time.sleep(0.005)
    during = []
    while not b.query():
        t = time.perf_counter(); cpu_adam(); during.append(N / ((time.perf_counter() - t) * 1e3))
    torch.cuda.synchronize()
    out[f"together_{rep}"] = {"gpu_params_per_ms": 6 * N / a.elapsed_time(b), "cpu_params_per_ms": during[:-1]}
print("TWIN", json.dumps(out))
