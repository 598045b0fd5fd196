"""Twin flow, a step-level prototype (not the script's code): the units named in TWIN_UNITS (indices, comma-separated)
are stepped by the GPU's fused Adam over their float32 master and moments streamed in from pinned host memory and
back out, chunk by chunk, with the bfloat16 copy written out beside them; the other streamed units keep the CPU Adam.
Runs the CLI (its arguments) with offload_llama's make_trainer wrapped. TWIN_CHECK=1: first compares the masters of
3 steps of a small model on the GPU with the committed path (float32 rounding)."""
import os, sys, time
import torch
sys.path.insert(0, os.getcwd())
import offload_llama as ol

C = 2**23  # parameters per chunk


def twin(trainer, units):
    """Step `units` of `trainer` on the GPU over streamed state (a prototype of OffloadedTraining.send/update)."""
    store, dev = trainer.store, trainer.device
    if not units:
        return trainer
    numel = {u: store.masters[u].numel() for u in units}
    for u in units:  # the copy engines read and write the moments: pinned
        m, v = (ol.host_zeros(numel[u], torch.float32, True) for _ in range(2))
        m.copy_(store.moments[u][0]); v.copy_(store.moments[u][1])
        store.moments[u] = (m, v)
    gsteps = {u: torch.zeros((), device=dev) for u in units}
    gcopy = torch.empty(max(numel.values()), dtype=trainer.grad_buffer.dtype, device=dev)
    slots = [[torch.empty(C, device=dev) for _ in range(3)] + [torch.empty(C, device=dev, dtype=trainer.dtype)]
             for _ in range(2)]
    s_in, s_adam, s_out = (torch.cuda.Stream(dev) for _ in range(3))
    in_done, cmp_done, out_done = ([torch.cuda.Event() for _ in range(2)] for _ in range(3))
    stepped = {u: torch.cuda.Event() for u in units}
    adam = store.update.adam
    send = trainer.send

    def twin_send(u):
        if u not in units:
            return send(u)
        trainer.sent.append(u)
        n = numel[u]
        ready = torch.cuda.Event(); ready.record(trainer.streamer.compute_stream)
        s_adam.wait_event(ready)  # the unit's backward has written its gradients
        with torch.cuda.stream(s_adam):
            gcopy[:n].copy_(trainer.grad_buffer[:n])
            consumed = torch.cuda.Event(); consumed.record()
        trainer.last_landed = consumed  # the next backward overwrites grad_buffer after this
        master, (mo, vo), copy = store.masters[u], store.moments[u], store.copies[u]
        s_in.wait_event(stepped[u])  # last step's state of this unit is out
        with torch.cuda.stream(s_adam):
            step = gsteps[u]
        for i, lo in enumerate(range(0, n, C)):
            k, c = i % 2, min(C, n - lo)
            p, m, v, bf = (t[:c] for t in slots[k])
            s_in.wait_event(out_done[k])
            with torch.cuda.stream(s_in):
                for dst, src in ((p, master), (m, mo), (v, vo)):
                    dst.copy_(src[lo:lo + c], non_blocking=True)
                in_done[k].record()
            s_adam.wait_event(in_done[k])
            with torch.cuda.stream(s_adam):
                step_c = step.clone()
                ol.torch_adam_step(adam, p, gcopy[lo:lo + c].float(), m, v, step_c)
                bf.copy_(p)
                cmp_done[k].record()
            s_out.wait_event(cmp_done[k])
            with torch.cuda.stream(s_out):
                for dst, src in ((master, p), (mo, m), (vo, v), (copy, bf)):
                    dst[lo:lo + c].copy_(src, non_blocking=True)
                out_done[k].record()
        with torch.cuda.stream(s_adam):
            step += 1
        stepped[u].record(s_out)

    trainer.send = twin_send
    prefetch = trainer.streamer.prefetch

    def twin_prefetch(p):
        u = trainer.streamer.order[p]
        if u in units:  # its copy must be written out before it is streamed in again
            trainer.streamer.copy_stream.wait_event(stepped[u])
        prefetch(p)
    trainer.streamer.prefetch = twin_prefetch
    finish = trainer.finish
    trainer.finish = lambda: (torch.cuda.synchronize(), finish())  # the state written out is in before it is read
    return trainer


def units_from_env():
    return {int(x) for x in os.environ.get("TWIN_UNITS", "").split(",") if x}


make = ol.make_trainer
ol.make_trainer = lambda *a, **k: twin(make(*a, **k), units_from_env())


def check():
    """1 and 3 steps of a small model: the masters with twin units against the committed path; after 1 step they may
    differ by float32 rounding only (the same gradients), later by what a bfloat16 weight rounded the other way does."""
    sys.path.insert(0, "tests")
    from helpers import build, offloaded_trainer, train
    run = ol.RunConfig(preset="tiny", sizes=(("num_hidden_layers", 3),), dtype="bfloat16", seq_len=64, batch_size=2)
    model, ids = build(run)
    batches = [ids.to("cuda")]
    for steps in (1, 3):
        ref = train(offloaded_trainer(model, "cuda", 1, batches, pin=True), batches, steps)
        got = train(twin(offloaded_trainer(model, "cuda", 1, batches, pin=True), {0, 2, 5}), batches, steps)
        worst = max((got[2][k] - ref[2][k]).abs().max().item() for k in ref[2])
        largest = max(m.abs().max().item() for m in ref[2].values())
        print("TWIN_CHECK steps", steps, "losses", ref[3], got[3], "max master diff", worst, "float32 rounding allows",
              ol.masters_tolerance(largest, steps), flush=True)


if os.environ.get("TWIN_CHECK"):
    check()
sys.exit(ol.main(sys.argv[1:]))
