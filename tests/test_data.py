"""--data: documents read and checked, tokenized once into the token cache, packed into blocks, a held-out share never
trained on, the others shuffled by --seed; and each bad input refused with one line, exit 2, before the model."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import transformers

import offload_llama as ol
from helpers import build, offloaded_trainer, run_main, tiny_run

CPU = torch.device("cpu")
WORDS = [
    "def",
    "return",
    "import",
    "class",
    "self",
    "for",
    "in",
    "range",
    "if",
    "else",
    "while",
    "print",
    "lambda",
    "yield",
    "with",
    "as",
    "try",
    "except",
]


def corpus(folder, files=6, lines=120):
    """A folder of small .py files of random keywords, one in a subfolder, and a JSONL file."""
    generator = torch.Generator().manual_seed(0)
    (folder / "sub").mkdir(parents=True)
    for i in range(files):
        picks = torch.randint(len(WORDS), (lines, 10), generator=generator).tolist()
        path = folder / ("sub" if i == 0 else "") / f"f{i}.py"
        path.write_text("\n".join(" ".join(WORDS[w] for w in line) for line in picks))
    (folder / "d.jsonl").write_text('{"text": "hello world"}\n\n{"text": "more text"}\n')
    return folder


def data_run(tmp_path, **fields) -> ol.RunConfig:
    """A run on the corpus under tmp_path, a 300-token BPE trained on it, caches under tmp_path."""
    folder = tmp_path / "corpus"
    if not folder.exists():
        corpus(folder)
    fields = {
        "data": str(folder),
        "train_tokenizer": 300,
        "data_cache": str(tmp_path / "cache"),
        "seq_len": 32,
    } | fields
    return ol.RunConfig(preset="tiny", train=True, **fields)


def test_a_folder_is_read_in_sorted_order_at_any_depth(tmp_path):
    run = data_run(tmp_path)
    files = ol.data_files(run)
    assert files == sorted(files) and any(f.parent.name == "sub" for f in files)
    assert {f.suffix for f in files} == {".py", ".jsonl"}
    assert [f.suffix for f in ol.data_files(ol.dataclasses.replace(run, data_glob="*.jsonl"))] == [".jsonl"]


def test_matches_that_are_not_files_are_left_out_with_a_note(tmp_path, capsys):
    """A FIFO and a broken link that --data-glob matches: not read (a FIFO would block), but said."""
    run = data_run(tmp_path)
    before = ol.data_files(run)
    os.mkfifo(Path(run.data) / "fifo.py")
    os.symlink(tmp_path / "nowhere", Path(run.data) / "broken.py")
    capsys.readouterr()
    assert ol.data_files(run) == before
    assert "2 match(es) of --data-glob left out, not files to read, such as" in capsys.readouterr().err


def test_jsonl_documents_are_the_field_of_each_line(tmp_path):
    path = tmp_path / "a.jsonl"
    assert ol.file_documents(path, '{"text": "a"}\n\n{"text": "b", "x": 1}\n', "text") == ["a", "b"]
    assert ol.file_documents(tmp_path / "a.txt", '{"text": "a"}', "text") == ['{"text": "a"}']


def test_packing_and_shuffling_are_deterministic_by_seed_and_never_train_on_held_out_blocks(tmp_path):
    blocks, _ = ol.prepare_data(data_run(tmp_path, eval_fraction=0.1), 512)
    again, _ = ol.prepare_data(data_run(tmp_path, eval_fraction=0.1), 512)
    other, _ = ol.prepare_data(data_run(tmp_path, eval_fraction=0.1, seed=1), 512)
    n = len(blocks.training)
    steps = [blocks.step_blocks(i, 3) for i in range(2 * n // 3 + 1)]  # two epochs and a step
    assert steps == [again.step_blocks(i, 3) for i in range(len(steps))]
    assert steps[:4] != [other.step_blocks(i, 3) for i in range(4)]
    assert torch.equal(blocks.held_out, other.held_out)  # held out whatever the seed
    trained = [b for step in steps for b in step]
    assert not set(trained) & set(blocks.held_out.tolist())
    assert sorted(trained[:n]) == blocks.training.tolist()  # each epoch takes every training block once
    assert trained[:n] != trained[n : 2 * n]  # in another order
    assert len(blocks.held_out) == round(0.1 * (n + len(blocks.held_out)))
    ids = blocks.gather([0, 1])
    assert ids.dtype == torch.int64 and ids.shape == (2, 32) and torch.equal(ids.flatten(), blocks.ids[:64].long())


def test_documents_are_joined_with_the_end_of_text_token(tmp_path):
    blocks, tokenizer = ol.prepare_data(data_run(tmp_path), 512)
    eos = tokenizer.eos_token_id
    assert blocks.ids.dtype == torch.uint16
    ids = blocks.ids.long()
    assert int((ids == eos).sum()) == 8  # 6 files and 2 JSONL records, the empty line none
    first = ids.tolist().index(eos)
    assert tokenizer.decode(ids[:first]) == "hello world"  # d.jsonl sorts first


def test_the_token_cache_is_reused_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    run = data_run(tmp_path)
    blocks, tokenizer = ol.prepare_data(run, 512)
    write = ol.write_tokens
    monkeypatch.setattr(ol, "write_tokens", lambda *a: pytest.fail("tokenized again"))
    again, _ = ol.prepare_data(run, 512)
    assert torch.equal(again.ids, blocks.ids)
    (tmp_path / "corpus" / "f1.py").write_text("while while while")
    calls = []
    monkeypatch.setattr(ol, "write_tokens", lambda *a: (calls.append(1), write(*a)))
    changed, _ = ol.prepare_data(run, 512)
    assert calls and changed.ids.numel() != blocks.ids.numel()


def test_a_cache_file_cut_short_is_rebuilt_never_read(tmp_path):
    run = data_run(tmp_path)
    expected = ol.prepare_data(run, 512)[0].ids.clone()  # the map reads the file, which the test now cuts short
    (path,) = (tmp_path / "cache").glob("tokens-*.bin")
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])  # as a process killed while writing would leave it, were it written in place
    assert ol.mapped_tokens(path) is None
    rebuilt, _ = ol.prepare_data(run, 512)
    assert torch.equal(rebuilt.ids, expected) and path.read_bytes() == whole


def test_the_trained_tokenizer_is_saved_and_loaded_by_auto_tokenizer(tmp_path):
    _, tokenizer = ol.prepare_data(data_run(tmp_path), 512)
    (folder,) = (tmp_path / "cache").glob("tokenizer-*")
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(loaded) == len(tokenizer) == 300 and loaded.eos_token == ol.END_OF_TEXT
    text = "def range(self):\n    return 1"
    assert loaded.decode(loaded(text).input_ids) == text


def test_training_on_data_saves_the_tokenizer_beside_the_model(tmp_path, capsys):
    run = data_run(tmp_path)
    args = ["--preset", "tiny", "--vocab-size", "512", "--mode", "cpu", "--train", "--no-inference", "--steps", "4"]
    args += ["--seq-len", "32", "--data", run.data, "--train-tokenizer", "300", "--data-cache", run.data_cache]
    code, out, err = run_main(capsys, *args, "--save-pretrained", tmp_path / "out", "--json", tmp_path / "r.json")
    assert code == 0, err
    assert "blocks of 32 tokens to train on" in err and "  step 4: loss" in err
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = tokenizer("def return", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)
    assert json.loads((tmp_path / "r.json").read_text())["run"]["data"] == run.data


def refusal(capsys, tmp_path, *args) -> str:
    """The one line a command line on the tiny preset with `args` ends with, exit 2, before a model is built."""
    base = ["--preset", "tiny", "--vocab-size", "512", "--mode", "cpu", "--train", "--seq-len", "32"]
    code, _, err = run_main(capsys, *base, "--data-cache", tmp_path / "cache", *args)
    lines = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(lines) == 1 and "building" not in err, err
    return lines[0]


def test_bad_data_is_refused_before_the_model_is_built(tmp_path, capsys):
    folder = corpus(tmp_path / "corpus")
    assert "no such file or folder" in refusal(
        capsys, tmp_path, "--data", tmp_path / "nothing", "--train-tokenizer", 300
    )
    (tmp_path / "empty").mkdir()
    assert "no file in it matches" in refusal(capsys, tmp_path, "--data", tmp_path / "empty", "--train-tokenizer", 300)
    (tmp_path / "e.txt").write_text("")
    assert "empty" in refusal(capsys, tmp_path, "--data", tmp_path / "e.txt", "--train-tokenizer", 300)
    (tmp_path / "j.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    assert "j.jsonl line 2 has no text under 'text'" in refusal(
        capsys, tmp_path, "--data", tmp_path / "j.jsonl", "--train-tokenizer", 300
    )
    (tmp_path / "k.jsonl").write_text('{"text": "a"}\n{"text": \n')
    assert "k.jsonl line 2 is not JSON" in refusal(
        capsys, tmp_path, "--data", tmp_path / "k.jsonl", "--train-tokenizer", 300
    )
    assert ol.file_documents(Path("b.jsonl"), '\ufeff{"text": "a"}\n', "text") == ["a"]  # a BOM at the start
    web = '{"text": "quote\u2028from the web\u0085"}\r\n{"text": "b"}\n'  # line breaks JSON strings may hold
    assert ol.file_documents(Path("w.jsonl"), web, "text") == ["quote\u2028from the web\u0085", "b"]
    (tmp_path / "deep.jsonl").write_text("[" * 10**5 + "]" * 10**5 + "\n")
    assert "deep.jsonl line 1 is not JSON (nested too deeply)" in refusal(
        capsys, tmp_path, "--data", tmp_path / "deep.jsonl", "--train-tokenizer", 300
    )
    assert "no tokenizer" in refusal(capsys, tmp_path, "--data", folder)
    assert "larger than the model's vocab_size 512" in refusal(
        capsys, tmp_path, "--data", folder, "--train-tokenizer", 600
    )
    (tmp_path / "short.txt").write_text("def return")
    line = refusal(capsys, tmp_path, "--data", tmp_path / "short.txt", "--train-tokenizer", 300)
    assert "tokens: --seq-len 32 needs 64" in line


def test_an_over_long_prompt_is_refused_in_one_short_line(tmp_path, capsys):
    """A prompt longer than the model's positions is named by its start and length, not echoed whole."""
    prompt = "def return " * 3000
    line = refusal(
        capsys, tmp_path, "--data", corpus(tmp_path / "corpus"), "--train-tokenizer", 300, "--sample", prompt
    )
    assert "and --sample-tokens make" in line and f"({len(prompt)} characters)" in line and len(line) < 300


def test_a_file_that_is_not_utf8_is_named_with_its_byte_offset_or_skipped(tmp_path, capsys):
    folder = corpus(tmp_path / "corpus")
    (folder / "bad.py").write_bytes(b"def f():\n    return '\xff'\n")
    line = refusal(capsys, tmp_path, "--data", folder, "--train-tokenizer", 300)
    assert "bad.py is not UTF-8 (byte 21)" in line and "--skip-undecodable" in line
    run = ol.dataclasses.replace(data_run(tmp_path, skip_undecodable=True))
    skipped = []
    assert len(list(ol.corpus_documents(run, ol.data_files(run), skipped))) == 8 and [p.name for p in skipped] == [
        "bad.py"
    ]


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
    _, tokenizer = ol.prepare_data(data_run(tmp_path), 512)
    tokenizer.save_pretrained(tmp_path / "tok")
    line = refusal(
        capsys, tmp_path, "--data", tmp_path / "corpus", "--tokenizer", tmp_path / "tok", "--vocab-size", 256
    )
    assert "the tokenizer's 300 ids exceed the model's vocab_size 256: give a tokenizer of at most 256" in line
    sample = ["--preset", "tiny", "--vocab-size", 256, "--mode", "cpu", "--train", "--sample", "hi", "--tokenizer"]
    code, _, err = run_main(capsys, *sample, tmp_path / "tok")  # no --data: the tokenizer only samples
    assert code == 2 and "the tokenizer's 300 ids exceed" in err and "--vocab-size 300" in err and "building" not in err


def test_data_flags_out_of_place_are_refused_at_once(capsys):
    for args, words in [
        (["--train", "--train-tokenizer", "300"], "--train-tokenizer does nothing without --data PATH"),
        (["--data", "x"], "add --train"),
        (["--train", "--data", "x", "--train-tokenizer", "100"], "at least 257"),
        (["--train", "--data", "x", "--eval-fraction", "1"], "between 0 and 1"),
        (["--train", "--data", "x", "--tokenizer", "t", "--train-tokenizer", "300"], "give one"),
    ]:
        with pytest.raises(SystemExit) as e:
            ol.command_line(args)
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_offloaded_samples_and_held_out_loss_equal_the_resident_models(tmp_path):
    """Through the streamed shell, generate (KV cache and all) and the forward give what the resident model with the
    same weights gives: before training and after two steps."""
    model, ids = build(tiny_run())
    trainer = offloaded_trainer(model, CPU, 1, [ids])
    prompt = ids[:, :5]
    for step in range(3):
        if step:
            trainer.step([ids])
        trainer.wait_updates()
        resident = ol.copy.deepcopy(model)
        resident.load_state_dict({k: v.to(model.dtype) for k, v in trainer.state_dict().items()}, strict=False)
        shell = ol.forward_model(trainer, model.config, CPU)
        expected = resident.generate(prompt, max_new_tokens=8, do_sample=False)
        assert torch.equal(shell.generate(prompt, max_new_tokens=8, do_sample=False), expected)
        shell = ol.forward_model(trainer, model.config, CPU)
        loss = shell(ids, labels=ids, use_cache=False).loss
        assert torch.equal(loss, resident(ids, labels=ids, use_cache=False).loss)
    trainer.finish()


def test_training_on_text_reports_held_out_losses_and_samples(tmp_path, capsys):
    run = data_run(tmp_path)
    args = ["--preset", "tiny", "--vocab-size", "512", "--mode", "cpu", "--train", "--no-inference", "--steps", "7"]
    args += ["--seq-len", "32", "--data", run.data, "--train-tokenizer", "300", "--data-cache", run.data_cache]
    args += ["--eval-every", "3", "--sample", "def", "--sample", "import", "--sample-tokens", "5", "--lr", "0.003"]
    code, out, err = run_main(capsys, *args, "--json", tmp_path / "r.json")
    assert code == 0, err
    t = json.loads((tmp_path / "r.json").read_text())["results"]["cpu"]["training"]
    assert [e["step"] for e in t["evaluations"]] == [0, 3, 6, 7]
    assert [e["tokens"] for e in t["evaluations"]] == [0, 96, 192, 224]
    assert t["evaluations"][-1]["loss"] < t["evaluations"][0]["loss"]
    assert [len(t["samples"][when]) for when in ("before", "after")] == [2, 2]
    tokenizer = transformers.AutoTokenizer.from_pretrained(next((tmp_path / "cache").glob("tokenizer-*")))
    assert all(len(tokenizer(text).input_ids) <= 5 for text in t["samples"]["after"])
    assert "cpu training: held-out loss" in out and "cpu sample after training: 'def' -> " in out
    assert "held-out loss after step 3:" in err


def test_sampling_is_refused_without_a_tokenizer_or_a_prompt(tmp_path, capsys):
    base = ["--preset", "tiny", "--mode", "cpu", "--train", "--seq-len", "32"]
    code, _, err = run_main(capsys, *base, "--sample", "def")
    assert code == 2 and "--sample needs a tokenizer" in err and "building" not in err
    for args, words in [
        (["--train", "--sample", ""], "needs a prompt"),
        (["--sample", "x"], "add --train"),
        (["--train", "--sample", "x", "--top-k", "5"], "add --temperature T"),
        (["--train", "--eval-every", "5"], "--eval-every does nothing without --data PATH"),
    ]:
        with pytest.raises(SystemExit) as e:
            ol.command_line(args)
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_corpus_whose_every_file_is_skipped_is_refused(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.py").write_bytes(b"\xff\xfe")
    args = ["--data", tmp_path / "bad", "--skip-undecodable", "--train-tokenizer", 300]
    assert "all 1 file(s) were skipped as not UTF-8" in refusal(capsys, tmp_path, *args)
    assert not list((tmp_path / "cache").glob("tokens-*"))  # nothing half-made is left to be read


@pytest.mark.parametrize(
    "texts, words",
    [
        (['{"text": ""}'] * 20_000, "holds no text to train on: its 20,000 document(s) are all empty"),
        (["", " ", "\t"] * 50, "holds no text to train on: its JSONL lines are all blank, end-of-text tokens alone"),
    ],
    ids=["20,000 empty texts", "blank lines"],
)
def test_a_corpus_with_nothing_to_learn_is_refused_saying_so(texts, words, tmp_path, capsys):
    """Documents every one empty would train on end-of-text tokens alone, and a JSONL file of blank lines was said to
    be 'all 0 file(s) skipped as not UTF-8': each refused with a line saying what it holds, the token cache not
    written."""
    (tmp_path / "d.jsonl").write_text("\n".join(texts) + "\n")
    assert words in refusal(capsys, tmp_path, "--data", tmp_path / "d.jsonl", "--train-tokenizer", 300)
    assert not list((tmp_path / "cache").glob("tokens-*"))


def test_a_signal_whose_raise_a_callback_dropped_still_ends_the_wait():
    """Ctrl-C's KeyboardInterrupt can fall in a callback that prints and drops it (once, under load, in importlib's
    module-lock callback while the tokenizer trained): the handler notes the signal, and the wait raises it again."""

    def work():  # the handler ran, and its raise went nowhere
        ol.CAUGHT.append(signal.SIGINT)
        time.sleep(3)

    ol.CAUGHT.clear()
    start = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            ol.waited(work, "still working")
        assert time.perf_counter() - start < 2, "the wait went on after the signal"
        ol.CAUGHT[:] = [signal.SIGTERM]
        with pytest.raises(ol.Terminated):
            ol.waited(lambda: time.sleep(3), "still working")
    finally:
        ol.CAUGHT.clear()
