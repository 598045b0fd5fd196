"""Saving and resuming overlapped training on the GPU, with units resident and the GPU's Adam over streamed state:
a resumed run equal to one run bit for bit, and the Hugging Face folder round trip."""

import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import assert_same_checkpoint, cli, cli_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# eager attention: a backward that is bitwise reproducible, so two runs can be compared bit for bit
OVERLAPPED = ["--preset", "tiny", "--seq-len", "64", "--mode", "overlapped", "--train", "--no-inference"]
OVERLAPPED += ["--attention", "eager", "--resident-layers", "1", "--warmup", "1", "--repeat", "1"]
PLACEMENTS = {
    "bfloat16, GPU Adam share": ["--dtype", "bfloat16", "--gpu-adam-share", "0.5"],
    "float16, loss scale": ["--dtype", "float16"],
}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_overlapped_resumed_run_equals_one_run(tmp_path, placement):
    """6 steps in one run against 3, then 3 more in a new process that resumes: masters, moments and step counts.
    The one run also saves its trained weights, which from_pretrained loads bit for bit, resident (copied from the
    GPU) and streamed alike."""
    one, two, folder, out = tmp_path / "one", tmp_path / "two", tmp_path / "hf", tmp_path / "out.pt"
    args = [*OVERLAPPED, *PLACEMENTS[placement]]
    saved = ["--save-pretrained", folder, "--save-output", out]
    runs = {
        "one": [*args, "--steps", "6", "--checkpoint", one, *saved],
        "two": [*args, "--steps", "3", "--checkpoint", two],
    }
    first = cli_all(runs)
    assert all(r.returncode == 0 for r in first.values()), [r.stderr for r in first.values()]
    assert "units resident on the GPU: model.layers.0;" in first["two"].stderr
    r = cli(*args, "--steps", "3", "--resume", two, "--checkpoint", two)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr
    assert_same_checkpoint(one, two)
    masters = torch.load(out)["training"]["overlapped"]["masters"]
    loaded = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert loaded.keys() == masters.keys()
    assert all(torch.equal(loaded[name], t) for name, t in masters.items())
