"""GPU tier, placement: resident layers and units change no bit (logits; eager gradients; the resident units'
first-step masters, which the GPU's fused Adam steps as gpu mode's does), and under a cap the plan's predicted peak
is the measured one, within 3% or 64 MiB, and under the cap."""

import json

import pytest
import torch

import offload_llama as ol
from helpers import (
    assert_masters_close,
    build,
    machine,
    offloaded_trainer,
    reference_trainer,
    resident_logits,
    send_late,
    streamed_logits,
    train,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
SMALL = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "num_hidden_layers": 4,
}
# 13M parameters a layer, 94M in all: placements from none to every unit fit a GPU between 0.6 and 2.5 GiB
MID = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 8192,
    "num_hidden_layers": 6,
}


def small(dtype="bfloat16"):
    """The small model (eager attention, whose backward is deterministic) and one batch of 2 x 128 tokens."""
    run = ol.RunConfig(
        preset="tiny", sizes=tuple(SMALL.items()), dtype=dtype, seq_len=128, batch_size=2, attention="eager"
    )
    model, ids = build(run)
    return model, [ids.to(CUDA)]


@pytest.mark.parametrize("resident", [(0,), (3,), (0, 2), (0, 1, 2, 3)])
@pytest.mark.parametrize("depth", [1, 2])
def test_resident_layers_logits_bitwise_equal_gpu(depth, resident):
    model, batches = small()
    ids = batches[0].cpu()
    assert torch.equal(
        streamed_logits(model, ids, "cuda", depth, pin=True, resident=resident), resident_logits(model, ids, "cuda")
    )


@pytest.mark.parametrize("resident", [(0,), (1, 3), (5, 6), tuple(range(7))])  # the small model has 7 units
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_resident_units_grads_bitwise_and_masters_as_gpu_modes(dtype, resident):
    model, batches = small(dtype)
    grads, masters_1, _, losses = train(
        offloaded_trainer(model, CUDA, 1, batches, pin=True, resident=resident), batches, 2
    )
    ref_grads, ref_masters_1, _, ref_losses = train(reference_trainer(model, CUDA, ol.Adam(lr=1e-3)), batches, 2)
    assert all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
    assert losses[0] == ref_losses[0]
    names = [unit.name + "." for unit in ol.model_units(model.config)]
    kept = {name: m for name, m in masters_1.items() if any(name.startswith(names[u]) for u in resident)}
    assert kept and all(torch.equal(m, ref_masters_1[name]) for name, m in kept.items())
    assert_masters_close(masters_1, ref_masters_1, 1)


def test_resident_units_sharing_one_gradient_buffer_train_the_same():
    model, batches = small()
    own = train(offloaded_trainer(model, CUDA, 1, batches, pin=True, resident=(0, 1, 6)), batches, 3)
    shared = train(
        offloaded_trainer(model, CUDA, 1, batches, pin=True, resident=(0, 1, 6), own_grads=False), batches, 3
    )
    assert all(torch.equal(m, own[2][name]) for name, m in shared[2].items()) and shared[3] == own[3]


def test_race_shared_resident_gradients_wait_for_the_last_copy_out():
    """Shared, resident unit 1's float32 gradients take the memory that streamed unit 2, just before it in the backward,
    leaves its gradients in for the host. With unit 2's copy to the host held back 20 ms the intact wait trains as
    gradients of their own do; without it unit 2's Adam reads unit 1's bytes."""
    model, batches = small()
    own = train(offloaded_trainer(model, CUDA, 1, batches, pin=True, resident=(0, 1)), batches, 2)
    for drop, should_match in ((False, True), (True, False)):
        trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, resident=(0, 1), own_grads=False)
        send_late(trainer, 2, drop)
        shared = train(trainer, batches, 2)
        matches = all(torch.equal(m, own[2][name]) for name, m in shared[2].items())
        assert matches == should_match, "intact" if should_match else "wait removed"


RUN = ["--preset", "tiny", "--seq-len", 2048, "--mode", "overlapped", "--warmup", 1, "--repeat", 2]


def mid_args(*extra):
    sizes = [a for field, value in MID.items() for a in (f"--{ol.SIZE_FLAGS[field]}", value)]
    return [*RUN, *sizes, *extra]


ACCUM = ["--grad-accum", 16]  # 16 micro-batches of 2048 tokens: 64 MiB of inputs per unit


def low_host_gib() -> float:
    """A --max-host-memory for the accumulating MID run under which the plan leaves the host no room for the masters'
    bfloat16 copy (half of it short, beyond HOST_MARGIN) of the units it streams under a 2.5 GiB cap: the GPU streams
    the float32 masters and casts them."""
    sizes = tuple(MID.items())
    run = ol.RunConfig(preset="tiny", sizes=sizes, mode="overlapped", train=True, inference=False, grad_accum=16)
    run = ol.dataclasses.replace(run, seq_len=2048, batch_size=1, max_gpu_memory=2.5)
    config, facts = ol.llama_config(run), machine(gpu_gib=139.8, process=ol.PROCESS_BYTES)
    resident = ol.resident_everywhere(run, ol.make_plan(run, config, facts).modes)  # their state leaves the host
    least = sum(ol.host_parts(run, config, facts, None, 2, resident).values())
    copy = 2 * sum(n for u, n in enumerate(ol.shard_numels(config, ol.Ranks())) if u not in resident)
    return (least + ol.HOST_MARGIN + copy / 2) / ol.GiB


TRAINING = {
    "all streamed": [],
    "cap 0.9": ["--max-gpu-memory", 0.9],
    "cap 1.4": ["--max-gpu-memory", 1.4],
    "4 resident layers": ["--resident-layers", 4],
    "cap 4": ["--max-gpu-memory", 4],
    "accumulation": ACCUM,
    "accumulation, activation offload": [*ACCUM, "--offload-activations"],
    "accumulation, segments of 3": [*ACCUM, "--segment", 3],  # the plan's way of the two
    "accumulation, segments of 3 remade": [*ACCUM, "--segment", 3, "--remake-segments"],
    "accumulation, cap 2.5": [*ACCUM, "--max-gpu-memory", 2.5],
    "accumulation, cap 2.5, no host copy": [*ACCUM, "--max-gpu-memory", 2.5, "--max-host-memory", low_host_gib()],
}
INFERENCE = {"cap 0.8": ["--max-gpu-memory", 0.8], "3 resident layers": ["--resident-layers", 3]}


MEMORY_RUNS = {  # run side by side by conftest's memory_runs
    **{
        f"training: {name}": mid_args("--train", "--no-inference", "--steps", 3, *flags)
        for name, flags in TRAINING.items()
    },
    **{f"inference: {name}": mid_args(*flags) for name, flags in INFERENCE.items()},
}


def overlapped_result(memory_runs, name: str, part: str):
    """The process that ran MEMORY_RUNS[name] and its overlapped mode's result for `part`, once it exited cleanly."""
    r, path = memory_runs[name]
    assert r.returncode == 0, r.stderr
    return json.loads(path.read_text())["results"]["overlapped"][part]


@pytest.mark.parametrize("name", TRAINING)
def test_training_peak_is_the_predicted_one_and_under_the_cap(name, memory_runs):
    t = overlapped_result(memory_runs, f"training: {name}", "training")
    extra = TRAINING[name]
    assert abs(t["peak_gpu_bytes"] - t["predicted_peak_bytes"]) <= max(0.03 * t["peak_gpu_bytes"], 64 * 2**20), t
    assert json.loads(memory_runs[f"training: {name}"][1].read_text())["expandable_segments"] is True
    flags = dict(zip(extra[::2], extra[1::2], strict=False))
    cap = flags.get("--max-gpu-memory")
    if cap is not None:
        assert t["peak_gpu_bytes"] <= cap * ol.GiB
    if cap == 1.4:
        assert t["resident_units"]
    if cap == 4:
        assert len(t["resident_units"]) == t["units"] == 9  # the embeddings, 6 layers, the norm and the head
    if "--resident-layers" in flags:
        assert t["resident_units"] == [f"model.layers.{i}" for i in range(4)]


@pytest.mark.parametrize("name", INFERENCE)
def test_inference_peak_with_resident_layers_is_the_predicted_one(name, memory_runs):
    result = overlapped_result(memory_runs, f"inference: {name}", "inference")
    predicted = sum(result["analytic_peak_bytes"].values())
    assert result["resident_layers"] and result["peak_gpu_bytes"] <= predicted
    assert predicted - result["peak_gpu_bytes"] <= max(0.03 * predicted, 64 * 2**20)


def test_the_low_host_path_casts_on_the_gpu_as_predicted_and_keeps_the_host_cap(memory_runs):
    """--max-host-memory leaves no room for the masters' bfloat16 copy: the GPU streams the float32 masters through a
    staging buffer and casts them, under a GPU cap too; the plan counts that path to 2%, and the process's peak
    resident set (the kernel's VmHWM over the whole run) stays under the host cap."""
    name = "training: accumulation, cap 2.5, no host copy"
    r, path = memory_runs[name]
    t = overlapped_result(memory_runs, name, "training")
    assert "no room on the host for the bfloat16 copy of the masters" in r.stderr
    assert abs(t["peak_gpu_bytes"] - t["predicted_peak_bytes"]) <= 0.02 * t["peak_gpu_bytes"], t
    assert t["peak_gpu_bytes"] <= 2.5 * ol.GiB and t["losses"][-1] < t["losses"][0]
    report = json.loads(path.read_text())
    cap = report["run"]["max_host_memory"] * ol.GiB
    assert report["host_budget_bytes"] <= cap and report["peak_host_bytes_process"] <= cap
    assert "host: the process's peak resident set" in r.stdout and "within the --max-host-memory cap" in r.stdout
