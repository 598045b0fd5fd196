"""The core reads and runs alone: with the accelerations' and several GPUs' sections deleted from the script, the
plain path (store, streamer, StreamedUnit, CPU Adam, step) still trains, bitwise as the whole script's plain path."""

import ast
import re
import sys
import types

import pytest
import torch

import offload_llama as ol
from helpers import SCRIPT, build, tiny_run

CORE = ("parameter store", "layer streamer", "training", "modes")
PLUG_INS = ("compiled Adam", "the GPU's Adam", "activation offload", "float16 and clipping", "the disk tier")
PLUG_INS += ("several GPUs",)


def sections(source: str) -> dict[str, tuple[int, int]]:
    """Each section's title -> its lines [first, end), 1-based, from its rule to the next."""
    rules = [
        (i + 1, m.group(1)) for i, line in enumerate(source.splitlines()) if (m := re.match(r"# -{20,} (.*)$", line))
    ]
    ends = [line for line, _ in rules[1:]] + [len(source.splitlines()) + 1]
    return {title: (line, end) for (line, title), end in zip(rules, ends, strict=True)}


def defined_in(source: str, titles) -> dict[str, str]:
    """The top-level names defined in the sections `titles`, each with its section."""
    spans = {title: sections(source)[title] for title in titles}
    names = {}
    for node in ast.parse(source).body:
        for target in getattr(node, "targets", [node]):
            name = getattr(target, "name", None) or getattr(target, "id", None)
            for title, (first, end) in spans.items():
                if name and first <= node.lineno < end:
                    names[name] = title
    return names


def test_the_core_names_nothing_of_the_accelerations_or_several_gpus():
    """The core's policies are installed from outside it (make_trainer, training_store, ShardedTraining, the stores):
    no name it uses is defined in a plug-in's section."""
    source = SCRIPT.read_text()
    plug_ins, core = defined_in(source, PLUG_INS), defined_in(source, CORE)
    spans = [sections(source)[title] for title in CORE]
    tree = ast.parse(source)
    used = {
        (node.id, plug_ins[node.id])
        for top in tree.body
        if any(first <= top.lineno < end for first, end in spans)
        for node in ast.walk(top)
        if isinstance(node, ast.Name) and node.id in plug_ins
    }
    assert used == set() and {"OffloadedTraining", "CpuAdam", "LayerStreamer"} <= core.keys()


def without_plug_ins() -> types.ModuleType:
    """The script with every plug-in section deleted, loaded as a module of its own."""
    source = SCRIPT.read_text()
    lines = source.splitlines(keepends=True)
    spans = sorted((sections(source)[title] for title in PLUG_INS), reverse=True)
    for first, end in spans:
        del lines[first - 1 : end - 1]
    module = types.ModuleType("offload_llama_plain")
    module.__file__ = str(SCRIPT)
    sys.modules[module.__name__] = module  # dataclasses look their module up by name
    try:
        exec(compile("".join(lines), "offload_llama_plain.py", "exec"), module.__dict__)
    except BaseException:
        del sys.modules[module.__name__]
        raise
    return module


def plain_training(ol, depth: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three plain steps of the tiny model on the CPU (CpuAdam, HostMoments, AdamUpdate) with module `ol`'s core."""
    torch.manual_seed(0)
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float32", batch_size=4))
    batches = list(ids.chunk(2))
    store = ol.MasterStore(ol.model_units(model.config), ol.Adam(lr=1e-3), pin=False)
    store.load(model)
    kwargs = ol.decoder_kwargs(model, tuple(batches[0].shape), torch.float32, torch.device("cpu"))
    trainer = ol.OffloadedTraining(
        store, model.config, torch.float32, torch.device("cpu"), depth, model.loss_function, kwargs
    )
    try:
        losses = [trainer.step(batches).item() for _ in range(3)]
        return losses, trainer.state_dict()
    finally:
        trainer.finish()


@pytest.mark.parametrize("depth", [0, 1])  # blocked, overlapped
def test_the_core_trains_alone_as_in_the_whole_script(depth):
    plain = without_plug_ins()
    try:
        assert not hasattr(plain, "StreamedAdam") and not hasattr(plain, "ShardedTraining")
        losses, masters = plain_training(plain, depth)
    finally:
        del sys.modules[plain.__name__]
    expected_losses, expected = plain_training(ol, depth)
    assert losses == expected_losses and losses[-1] < losses[0]
    assert masters.keys() == expected.keys() and all(torch.equal(masters[k], expected[k]) for k in expected)
