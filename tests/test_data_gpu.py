"""GPU tier, text: greedy samples through the offloaded modes equal Hugging Face's generate on the resident model with
the same weights, token for token (KV cache and all), and training on --data computes what gpu mode computes: the
first step's gradients bitwise and the masters to float32 rounding, as on random ids."""

import json

import pytest
import torch
from test_data import corpus

import offload_llama as ol
from helpers import build, cli, offloaded_trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
SIZES = (("hidden_size", 256), ("intermediate_size", 688), ("num_hidden_layers", 4), ("vocab_size", 512))


@pytest.mark.parametrize("placed", [{}, {"resident": (0, 2)}, {"gpu_adam": (0, 1, 5)}])
def test_offloaded_greedy_samples_equal_generate_on_the_resident_model(placed):
    model, ids = build(ol.RunConfig(preset="tiny", sizes=SIZES, seq_len=64, batch_size=2))
    batches = [ids.to(CUDA)]
    trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, **placed)
    prompt = batches[0][:, :7]
    for step in range(3):
        if step:
            trainer.step(batches)
        trainer.wait_updates()
        masters = trainer.state_dict()
        resident = ol.copy.deepcopy(model).to(CUDA)
        resident.load_state_dict({k: v.to(model.dtype) for k, v in masters.items()}, strict=False)
        expected = resident.generate(prompt, max_new_tokens=16, do_sample=False)
        shell = ol.forward_model(trainer, model.config, CUDA)
        assert torch.equal(shell.generate(prompt, max_new_tokens=16, do_sample=False), expected), f"after {step}"
    trainer.finish()


def test_training_on_data_computes_what_gpu_mode_computes(tmp_path):
    folder = corpus(tmp_path / "corpus")
    args = ["--preset", "tiny", "--vocab-size", "512", "--mode", "gpu,blocked,overlapped", "--train", "--steps", "6"]
    args += ["--no-inference", "--seq-len", "64", "--batch-size", "2", "--attention", "eager", "--data", folder]
    args += ["--train-tokenizer", "300", "--data-cache", tmp_path / "cache", "--sample", "def", "--sample-tokens", "8"]
    r = cli(*args, "--eval-every", "3", "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    gpu = results["gpu"]["training"]
    for mode in ("blocked", "overlapped"):
        t = results[mode]["training"]
        assert t["grads_equal_to_gpu"] and t["masters_close_to_gpu"], mode
        assert t["samples"]["before"] == gpu["samples"]["before"], mode  # the same weights before the first step
        assert t["evaluations"][0]["loss"] == gpu["evaluations"][0]["loss"], mode
        assert [e["step"] for e in t["evaluations"]] == [0, 3, 6]
        assert t["losses"][-1] < t["losses"][0]


def test_a_steps_blocks_reach_the_gpu_without_a_wait_on_the_host():
    """step_batches copies a step's blocks from pinned memory: no synchronizing call (from pageable memory, CUDA waits
    for every kernel queued first, and the next step starts from an idle GPU), and the ids arrive whole."""
    blocks = ol.Blocks(torch.randint(0, 512, (4096,), dtype=torch.int32), 64, 0.1, 0)
    run = ol.RunConfig(preset="tiny", seq_len=64, batch_size=2, grad_accum=2, train=True)
    step = ol.step_batches(blocks, run, CUDA)
    step(0)  # the caching host allocator's first block
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(torch.cat(got).cpu(), blocks.gather(blocks.step_blocks(1, 4)))
