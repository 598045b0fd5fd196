"""The assignment reads and runs alone: the script cut at its line '# === Beyond the assignment ===', with a short
runner added, runs the four inference modes and trains blocked and overlapped, bitwise as the whole script does."""

import ast
import sys
import types

import pytest
import torch

import offload_llama as ol
from helpers import SCRIPT

MARK = "# === Beyond the assignment ==="

RUNNER = '''
def run_assignment(run):
    """Every mode's logits, then three training steps of each mode: (logits, losses, masters), on the CPU."""
    cpu = torch.device("cpu")
    model = build_model(run, llama_config(run))
    ids = random_input_ids(run, model.config.vocab_size, run.grad_accum)
    store = ParamStore(model, pin=False)
    logits = {}
    for mode in MODES:
        if mode in ("gpu", "cpu"):
            logits[mode] = infer_resident(model, ids[: run.batch_size], cpu, run)[1]
        else:
            shell, _ = infer_offloaded(model, store, cpu, mode_depth(mode, run.prefetch))
            with torch.inference_mode():
                logits[mode] = logits_of(shell, ids[: run.batch_size])
    batches = list(ids.chunk(run.grad_accum))
    kwargs = decoder_kwargs(model, (run.batch_size, run.seq_len), run.torch_dtype, cpu)
    losses, masters = {}, {}
    for mode in ("blocked", "overlapped"):
        adam = OffloadedAdam(model_units(model.config), run.adam, pin=False)
        adam.load(model)
        depth = mode_depth(mode, run.prefetch)
        trainer = OffloadedTraining(adam, model.config, run.torch_dtype, cpu, depth, model.loss_function, kwargs)
        losses[mode] = [trainer.step(batches).item() for _ in range(run.steps)]
        masters[mode] = trainer.state_dict()
        trainer.finish()
    reference = ResidentTraining(model, cpu, run.adam)
    losses["cpu"] = [reference.step(batches).item() for _ in range(run.steps)]
    masters["cpu"] = reference.state_dict(reference.masters)
    return logits, losses, masters
'''


def assignment() -> types.ModuleType:
    """The script above its line, with RUNNER, loaded as a module of its own."""
    source = SCRIPT.read_text()
    assert source.count(f"\n{MARK}\n") == 1
    module = types.ModuleType("offload_llama_assignment")
    module.__file__ = str(SCRIPT)
    sys.modules[module.__name__] = module  # dataclasses look their module up by name
    try:
        exec(compile(source.split(f"\n{MARK}\n")[0] + RUNNER, "offload_llama_assignment.py", "exec"), module.__dict__)
    except BaseException:
        del sys.modules[module.__name__]
        raise
    return module


def test_the_assignment_comes_first_and_names_nothing_after_its_line():
    """The line stands at most 1,500 lines down, and no name used above it is defined below it."""
    source = SCRIPT.read_text()
    mark = source.splitlines().index(MARK) + 1
    tree = ast.parse(source)
    below = {
        getattr(t, "name", None) or getattr(t, "id", None)
        for n in tree.body
        if n.lineno > mark
        for t in [n, *getattr(n, "targets", [])]
    }
    used = {m.id for n in tree.body if n.lineno < mark for m in ast.walk(n) if isinstance(m, ast.Name)}
    assert mark <= 1500 and used & below == set()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_assignment_runs_alone_as_in_the_whole_script(dtype):
    """gpu, blocked, overlapped and cpu inference give the same logits, bit for bit; blocked and overlapped train to
    the same losses and masters, bit for bit, as the whole script's plain path, and to torch.optim.Adam's masters to
    float32 rounding."""
    run = ol.Config(preset="tiny", dtype=dtype, batch_size=2, seq_len=32, grad_accum=2, steps=3, lr=1e-3)
    alone = assignment()
    try:
        logits, losses, masters = alone.run_assignment(alone.Config(**vars(run)))
    finally:
        del sys.modules[alone.__name__]
    exec(compile(RUNNER, "runner", "exec"), vars(ol))  # the same runner over the whole script
    expected_logits, expected_losses, expected = ol.run_assignment(run)
    del ol.run_assignment
    assert all(
        torch.equal(logits[mode], logits["gpu"]) and torch.equal(logits[mode], expected_logits[mode])
        for mode in ol.MODES
    )
    for mode in ("blocked", "overlapped"):
        assert losses[mode] == expected_losses[mode] and losses[mode][-1] < losses[mode][0]
        assert all(torch.equal(masters[mode][k], expected[mode][k]) for k in expected[mode])
        largest = max(m.abs().max().item() for m in masters["cpu"].values())
        for name, m in masters[mode].items():
            torch.testing.assert_close(m, masters["cpu"][name], rtol=0, atol=ol.masters_tolerance(largest, 3))
