"""CPU tier, placement: layers and units kept resident on the device change no bit of the logits or the gradients;
only the streamed ones are copied, ahead of the resident ones' compute; the plans fit their budget and take units in
their order."""

import pytest
import torch

import offload_llama as ol
from helpers import (
    build,
    machine,
    offloaded_trainer,
    reference_trainer,
    resident_logits,
    streamed_logits,
    tiny_run,
    train,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("resident", [(0,), (3,), (0, 2), (1, 2), (0, 1, 2, 3)])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_resident_layers_change_no_logit(depth, resident):
    model, ids = build(tiny_run(num_hidden_layers=4))
    assert torch.equal(streamed_logits(model, ids, "cpu", depth, resident=resident), resident_logits(model, ids, "cpu"))


@pytest.mark.parametrize("depth", [1, 2])
def test_streamed_layers_are_copied_before_the_resident_layers_ahead_of_them_run(depth):
    model, ids = build(tiny_run(num_hidden_layers=4))
    events = []

    def record(streamer):
        acquire, release, prefetch = streamer.acquire, streamer.release, streamer.prefetch
        streamer.acquire = lambda u: (events.append(("run", u)), acquire(u))[1]
        streamer.release = lambda u: (events.append(("issued", u)), release(u))
        streamer.prefetch = lambda p: (events.append(("copy", streamer.window.units[p])), prefetch(p))

    streamed_logits(model, ids, "cpu", depth, streamer_hook=record, resident=(0, 2))
    # both streamed layers' copies start once layer 0's kernels are issued, and the ring has a slot for each
    assert events == [
        ("run", 0),
        ("issued", 0),
        ("copy", 1),
        ("copy", 3),
        ("run", 1),
        ("issued", 1),
        ("run", 2),
        ("issued", 2),
        ("run", 3),
        ("issued", 3),
    ]


def tiny_training(dtype="bfloat16", k=1):
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=2 * k))
    return model, list(ids.chunk(k))


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("resident", [(0,), (1, 3), (4, 5), (0, 1, 2, 3, 4, 5)])  # the tiny model has 6 units
def test_resident_units_train_like_gpu_mode(resident, dtype, k):
    """Gradients bitwise; the resident units' masters after the first step bitwise too (the same torch Adam on the
    same device as the reference's), the streamed ones' to float32 rounding (the CPU Adam's kernel)."""
    model, batches = tiny_training(dtype, k)
    grads, masters_1, _, losses = train(offloaded_trainer(model, CPU, 1, batches, resident=resident), batches, 2)
    ref_grads, ref_masters_1, _, ref_losses = train(reference_trainer(model, CPU, ol.Adam(lr=1e-3)), batches, 2)
    assert all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
    names = [unit.name for unit in ol.model_units(model.config)]
    for name, m in masters_1.items():
        if any(name.startswith(names[u] + ".") for u in resident):
            assert torch.equal(m, ref_masters_1[name]), name
        else:
            torch.testing.assert_close(m, ref_masters_1[name], rtol=0, atol=ol.masters_tolerance(1.0, 1), msg=name)
    assert losses[0] == ref_losses[0]


def test_resident_units_sharing_one_gradient_buffer_train_the_same():
    model, batches = tiny_training()
    own = train(offloaded_trainer(model, CPU, 1, batches, resident=(0, 1, 5)), batches, 3)
    shared = train(offloaded_trainer(model, CPU, 1, batches, resident=(0, 1, 5), own_grads=False), batches, 3)
    assert all(torch.equal(m, own[2][name]) for name, m in shared[2].items())
    assert shared[3] == own[3]


def test_shared_gradients_live_in_the_streamed_units_gradient_buffer():
    """Without gradients of their own the resident units' float32 gradients take the memory of the streamed units'
    gradient buffer, made as large as the largest resident unit's."""
    model, batches = tiny_training()
    trainer = offloaded_trainer(model, CPU, 1, batches, resident=(0, 2), own_grads=False)
    numels = [m.numel() for m in trainer.store.masters]
    streamed = max(n for u, n in enumerate(numels) if u not in (0, 2))
    assert trainer.steppers.of[0].shares_buffer and trainer.steppers.buffers[0].numel() == streamed
    for u in (0, 2):
        grads = trainer.steppers.grads(u)
        assert grads.dtype == torch.float32 and grads.numel() == numels[u]
        assert grads.untyped_storage().data_ptr() == trainer.steppers.buffers[0].untyped_storage().data_ptr()
    assert not offloaded_trainer(model, CPU, 1, batches, resident=(0, 2)).steppers.of[0].shares_buffer


def test_every_unit_resident_streams_nothing():
    model, batches = tiny_training()
    trainer = offloaded_trainer(model, CPU, 1, batches, resident=range(6))
    trainer.streamer.prefetch = lambda p: pytest.fail("a resident unit was copied")
    *_, losses = train(trainer, batches, 3)
    assert trainer.streamer.n_slots == 0 and trainer.steppers.buffers[0].numel() == 0
    assert losses[-1] < losses[0]


def test_float16_resident_units_need_their_own_gradients():
    model, batches = tiny_training("float16")
    with pytest.raises(ValueError, match="resident units need their own gradients"):
        offloaded_trainer(model, CPU, 1, batches, resident=(1,), own_grads=False)


def budget_run(budget_bytes: int, **fields) -> ol.RunConfig:
    """A run of the tiny model's overlapped training whose placement budget is about `budget_bytes`."""
    return ol.RunConfig(
        **{"preset": "tiny", "mode": "overlapped", "train": True, **fields},
        max_gpu_memory=(ol.PLAN_MARGIN + budget_bytes) / ol.GiB,
    )


class Placed:
    """training_placement's choice for `run` in `mode` (a bfloat16 copy of the masters), its parts and peak."""

    def __init__(self, run: ol.RunConfig, mode: str = "overlapped"):
        config = ol.llama_config(run)
        self.resident, self.gpu_adam, self.parts, self.fits = ol.training_placement(
            run, config, machine(), mode, torch.bfloat16
        )
        self.peak_bytes = sum(self.parts.values())


@pytest.fixture
def besides(monkeypatch):
    """What no placement changes, fixed: saved inputs, a working set and the rest."""
    fixed = {"saved inputs": 1000, "working set": 5000, "other": 300}
    monkeypatch.setattr(ol, "unplaced_bytes", lambda run, config, facts, keep=(): fixed)
    return fixed


def tiny_numels() -> list[int]:
    """The tiny model's units' elements, padding included."""
    return ol.shard_numels(ol.llama_config(ol.RunConfig(preset="tiny")), ol.Ranks())


def test_training_plan_fits_its_budget_and_keeps_a_run_from_the_start_of_the_forward_order(besides):
    numels = tiny_numels()
    streamed = Placed(ol.RunConfig(preset="tiny", mode="overlapped", train=True, seq_len=256))  # bound by the host
    assert streamed.resident == () and streamed.parts["saved inputs"] == 1000 and streamed.fits
    least = streamed.peak_bytes - streamed.parts["GPU Adam staging"]  # every unit streamed, on the CPU Adam
    assert not Placed(budget_run(least - 1000)).fits  # train_mode reports it OOM, check_plan refuses it under ranks
    assert streamed.parts["slots"] == 2 * max(numels) * 2 and streamed.parts["resident weights"] == 0
    budgets = range(streamed.peak_bytes, streamed.peak_bytes + 20 * sum(numels), sum(numels) // 4)
    plans = [Placed(budget_run(b)) for b in budgets]
    for plan, budget in zip(plans, budgets, strict=False):
        k = len(plan.resident)
        assert plan.resident == tuple(range(k)) and plan.peak_bytes <= budget + 1
    assert [len(p.resident) for p in plans] == sorted(len(p.resident) for p in plans)
    assert plans[-1].resident == tuple(range(6)) and plans[-1].parts["slots"] == 0
    # resident, a parameter takes 14 bytes, and the gradient buffer holds the largest resident unit's float32
    # gradients; 18 bytes with gradients of their own (compared with gpu mode's), beside the streamed units' buffer
    kept = sum(numels)
    assert plans[-1].parts["resident weights"] + plans[-1].parts["resident masters and moments"] == 14 * kept
    assert plans[-1].parts["gradient buffer"] == 4 * max(numels) and plans[-1].parts["resident gradients"] == 0
    assert streamed.parts["gradient buffer"] == 2 * max(numels)
    own = Placed(budget_run(10**9, mode="gpu,overlapped"))
    assert own.parts["resident gradients"] == 4 * kept and own.parts["gradient buffer"] == 0


def test_under_a_cap_the_gpus_adam_steps_nothing_where_the_compute_bounds_the_step():
    """Under --max-gpu-memory, where the GPU's compute bounds the step with every streamed unit on the CPU Adam (7b-8l,
    8 micro-batches of 4096 tokens), the GPU's Adam steps none: it would only add to the compute; where the host
    bounds it (1 micro-batch) it takes its share; --gpu-adam-share is kept as given; several ranks alike."""
    run = ol.RunConfig(preset="7b-8l", mode="overlapped", train=True, grad_accum=8, max_gpu_memory=20)
    config = ol.llama_config(run)
    bound = ol.training_placement(run, config, machine(), "overlapped", torch.bfloat16)
    assert bound[1] == () and ol.compute_bound(run, config, machine(), ([], ()), torch.bfloat16)
    one = ol.dataclasses.replace(run, grad_accum=1)
    assert ol.training_placement(one, config, machine(), "overlapped", torch.bfloat16)[1] != ()
    given = ol.dataclasses.replace(run, gpu_adam_share=0.3)
    assert ol.training_placement(given, config, machine(), "overlapped", torch.bfloat16)[1] != ()
    ranks = ol.dataclasses.replace(run, grad_accum=16)  # 8 micro-batches a rank
    assert ol.training_placement(ranks, config, machine(world=2), "overlapped", torch.bfloat16)[1] == ()


def test_a_compute_bound_step_keeps_the_gpu_adams_units_resident_without_a_cap():
    """No cap: where the GPU's compute bounds the step (7b-8l, 4 micro-batches of 4096 tokens), the units the GPU's
    Adam would step over streamed state stay on the GPU instead, the GPU's Adam steps none; where the host bounds it
    (1 micro-batch) they stream; a GPU too small for them all keeps those from the forward's start it holds."""
    run = ol.RunConfig(preset="7b-8l", mode="overlapped", train=True, grad_accum=4)
    config = ol.llama_config(run)
    one = ol.dataclasses.replace(run, grad_accum=1)
    streamed = ol.training_placement(one, config, machine(), "overlapped", torch.bfloat16)
    assert streamed[0] == () and streamed[1] == (0, 1, 2)  # the embeddings and the first two layers
    assert not ol.compute_bound(one, config, machine(), streamed[:2], torch.bfloat16)
    kept = ol.training_placement(run, config, machine(), "overlapped", torch.bfloat16)
    assert kept[0] == (0, 1, 2) and kept[1] == () and kept[3]
    assert ol.compute_bound(run, config, machine(), kept[:2], torch.bfloat16)
    peak = sum(kept[2].values())
    layer = ol.layer_numel(config)
    gpu = machine(gpu_gib=(peak - 10 * layer + ol.PLAN_MARGIN) / ol.GiB)  # short of one layer: 14 bytes a parameter
    smaller = ol.training_placement(run, config, gpu, "overlapped", torch.bfloat16)
    assert smaller[0] == (0, 1) and smaller[1] == ()
    assert ol.training_placement(run, config, machine(), "blocked", torch.bfloat16)[0] == ()


def test_training_plan_overrides_and_blocked(besides):
    assert Placed(budget_run(10**9)).resident == tuple(range(6))
    assert Placed(budget_run(10**9), "blocked").resident == ()
    assert Placed(budget_run(10**9, resident_layers=2)).resident == (1, 2)  # layers: unit 0 is the embeddings
    assert Placed(budget_run(10**9, resident_layers=0)).resident == ()
    # no budget, bound by the host (256 tokens): every unit streamed
    assert Placed(ol.RunConfig(preset="tiny", mode="overlapped", seq_len=256)).resident == ()


def test_training_plan_gives_the_gpu_adam_its_share_of_the_streamed_units_and_counts_its_staging(besides):
    numels = tiny_numels()
    half = ol.RunConfig(preset="tiny", mode="overlapped", train=True, gpu_adam_share=0.5, seq_len=256)
    streamed = Placed(half)
    units = ol.model_units(ol.llama_config(half))
    assert streamed.gpu_adam == ol.gpu_adam_units(units, (), 0.5) != ()
    assert sum(numels[u] for u in streamed.gpu_adam) <= 0.5 * sum(numels)
    largest = max(numels[u] for u in streamed.gpu_adam)  # bfloat16 gradients and copy: 14 bytes a slot, 4 to cast
    assert streamed.parts["GPU Adam staging"] == 2 * largest + 2 * 14 * largest + 4 * largest
    assert Placed(half, "blocked").gpu_adam == ()
    without = Placed(ol.dataclasses.replace(half, gpu_adam_share=0.0))
    assert without.parts["GPU Adam staging"] == 0
    everything = Placed(budget_run(10**9))  # every unit resident: nothing left for it
    assert everything.resident == tuple(range(6)) and everything.gpu_adam == ()
    # a budget that holds every unit streamed but not the GPU Adam's staging beside them: the CPU Adam steps them all
    tight = Placed(budget_run(without.peak_bytes, gpu_adam_share=0.5))
    assert tight.resident == () and tight.gpu_adam == () and tight.peak_bytes == without.peak_bytes


def test_inference_plan_spreads_what_the_budget_holds():
    run = ol.RunConfig(preset="7b-8l", max_gpu_memory=11)
    config = ol.llama_config(run)
    assert ol.inference_placement(run, config, machine(), "overlapped")[0] == tuple(range(8))
    assert ol.inference_placement(run, config, machine(), "blocked")[0] == ()
    assert ol.inference_placement(ol.RunConfig(preset="7b-8l"), config, machine(), "overlapped")[0] == ()
    counts = []
    for gib in (2, 3, 4, 5, 6):
        capped = ol.dataclasses.replace(run, max_gpu_memory=gib)
        resident, parts = ol.inference_placement(capped, config, machine(), "overlapped")
        assert sum(parts.values()) <= gib * ol.GiB - ol.PLAN_MARGIN or not resident
        assert resident == ol.spread(8, len(resident))
        counts.append(len(resident))
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 8
    assert ol.spread(8, 4) == (0, 2, 4, 6) and ol.spread(8, 1) == (0,) and ol.spread(8, 8) == tuple(range(8))
    forced = ol.dataclasses.replace(run, resident_layers=3)
    assert ol.inference_placement(forced, config, machine(), "overlapped")[0] == (0, 2, 5)


def test_without_a_cap_units_stay_resident_only_where_the_compute_hides_the_copies():
    """Uncapped, overlapped streams every unit where the two copies together outlast the compute (7b-8l, one
    micro-batch: the main command), though residents would be faster; where the compute hides them (2, 4 and 16
    micro-batches, every unit recomputed), the fewest leading units stay resident whose predicted step is the fastest
    (2: more than the GPU's Adam's share), at least that share (16: as fast predicted with none), every streamed unit
    on the CPU Adam; a given --gpu-adam-share is kept, every unit streamed."""
    facts = machine(139.0)
    share = ol.gpu_adam_units(ol.model_units(ol.llama_config(ol.RunConfig(preset="7b-8l"))), [], ol.GPU_ADAM_SHARE, ())

    def placed(grad_accum: int, **options) -> tuple:
        run = ol.RunConfig(preset="7b-8l", mode="overlapped", train=True, grad_accum=grad_accum, **options)
        config = ol.llama_config(run)

        def step(resident) -> float:
            return round(max(ol.predicted_bound(run, config, facts, 1, list(resident), (), torch.bfloat16).values()), 1)

        return ol.training_placement(run, config, facts, "overlapped", torch.bfloat16), step

    (resident, gpu_adam, _, fits), step = placed(1)
    assert resident == () and gpu_adam == share and fits and step([0]) < step([])
    counts = {}
    for grad_accum in (2, 4):
        (resident, gpu_adam, _, fits), step = placed(grad_accum)
        assert resident == tuple(range(len(resident))) and len(resident) >= len(share) and gpu_adam == () and fits
        assert step(resident[:-1]) > step(resident) == step([*resident, len(resident)])
        counts[grad_accum] = len(resident)
    assert counts[2] > counts[4] and counts[2] > len(share)
    (resident, gpu_adam, _, fits), step = placed(16)
    assert resident == share and gpu_adam == () and fits and step([]) == step(resident)
    (resident, gpu_adam, _, fits), step = placed(4, gpu_adam_share=0.5)
    assert resident == () and len(gpu_adam) > len(share) and fits


def test_the_search_keeps_the_graphs_that_fit_where_that_makes_the_step_fastest():
    """The search weighs every unit recomputed against the most graphs that fit and half as many: on a described
    139 GiB GPU (7b-8l, 4 micro-batches) keeping every decoder layer's and the head's graphs predicts the fastest step,
    each option recomputing more predicts slower; on a 12 GiB GPU, recomputing all and keeping units resident wins."""
    run = ol.RunConfig(preset="7b-8l", mode="overlapped", train=True, grad_accum=4)
    config = ol.llama_config(run)
    units = ol.model_units(config)
    graphs = tuple(u for u, unit in enumerate(units) if unit.kind in ("layer", "head"))

    def search(gpu_gib: float) -> list:
        facts = machine(gpu_gib, host_gib=120.0)
        return ol.searched_placement(run, config, facts, "overlapped", torch.bfloat16, len(units))

    tried = search(139.0)
    assert tried[0].keep == graphs and all(p.fits and p.host_fits for p in tried)
    assert [len(p.keep) for p in tried] == sorted((len(p.keep) for p in tried), reverse=True)  # more kept: faster
    assert [p.step_ms for p in tried] == sorted(p.step_ms for p in tried) and tried[0].step_ms < tried[1].step_ms
    small = search(12.0)
    assert small[0].keep == () and small[0].resident and small[0].step_ms < min(p.step_ms for p in small[1:])
