"""A new user's first contact: the README's command without a GPU, --help, and the command line's mistakes answered
with one line, exit 2, before the model is built."""

import subprocess
import sys

import pytest

import offload_llama as ol
from helpers import SCRIPT, cli, planned, run_main

README = SCRIPT.parent / "README.md"


def test_the_readme_gives_a_command_that_runs_without_a_gpu():
    assert ol.FIRST_CONTACT in README.read_text()
    args = ol.FIRST_CONTACT.split()[2:]  # after "python offload_llama.py"
    assert "--mode" in args and args[args.index("--mode") + 1] == "cpu"
    r = cli(*args, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| cpu | " in r.stdout and "Table 2 (training)" in r.stdout
    assert "  step 1: loss" in r.stderr and "  step 5: loss" in r.stderr and "step 0:" not in r.stderr


@pytest.mark.slow
def test_the_readmes_text_commands_train_on_the_cpu_with_the_held_out_loss_falling(tmp_path):
    """The README's corpus folder and CPU text command, run as written (the cache in tmp_path): the losses it quotes."""
    text = README.read_text()
    block = text.split("mkdir -p corpus", 1)[1].split("```", 1)[0]
    subprocess.run(["bash", "-c", "mkdir -p corpus" + block.split("\n", 1)[0]], cwd=tmp_path, check=True)
    command = block.split("\n", 1)[1].replace("\\\n", " ").split()
    assert command[:2] == ["python", "offload_llama.py"] and "--mode" in command and "cpu" in command
    env = {**ol.os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, SCRIPT, *command[2:]], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    losses = [
        float(line.split(": ")[1].split(",")[0]) for line in r.stderr.splitlines() if "held-out loss after" in line
    ]
    quoted = (
        text.split("Training on text without a GPU", 1)[1].split("held-out loss ", 1)[1].split(":")[0].split(" -> ")
    )
    assert abs(losses[0] - float(quoted[0])) < 0.05 and abs(losses[-1] - float(quoted[1])) < 0.05, (losses, quoted)


def help_text(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        ol.command_line(["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_shows_every_default_each_preset_and_three_examples(capsys):
    text = help_text(capsys)
    parser = ol.Parser()
    ol.add_run_flags(parser)
    ol.add_training_flags(parser)
    ol.add_saving_flags(parser)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    formatter = ol.HelpFormatter("offload_llama.py")
    assert [a.dest for a in flags if "default:" not in formatter._get_help_string(a)] == []
    for name, sizes in ol.PRESETS.items():
        described = f"{name}: {sizes['num_hidden_layers']} layers, hidden {sizes['hidden_size']}"
        assert described in " ".join(text.split())
    assert text.count("\n  python offload_llama.py ") == 3 and ol.FIRST_CONTACT in text


def test_parameter_counts_are_the_models():
    """The arithmetic count equals the parameters of the model built on the meta device, for every preset and for
    configs with tied embeddings, biases and a head dimension of their own."""
    configs = [ol.llama_config(ol.RunConfig(preset=name)) for name in ol.PRESETS]
    tiny = ol.PRESETS["tiny"]
    configs += [
        ol.LlamaConfig(**tiny, tie_word_embeddings=True),
        ol.LlamaConfig(**tiny, attention_bias=True, mlp_bias=True),
        ol.LlamaConfig(**tiny, head_dim=24),
    ]
    for config in configs:
        with ol.torch.device("meta"):
            built = sum(p.numel() for p in ol.LlamaForCausalLM(config).parameters())
        assert ol.param_count(config) == built, config
    assert ol.parameter_count(tiny) == ol.param_count(configs[0])


def test_counts_and_sizes_in_words():
    assert [ol.count_text(n) for n in (900, 171_456, 53_200_000, 1_880_000_000)] == ["900", "171K", "53.2M", "1.88B"]
    assert [ol.size_text(n) for n in (1, 4096, 120 * 2**20, 3.5 * ol.GiB)] == [
        "1 byte",
        "4.0 KiB",
        "120.0 MiB",
        "3.5 GiB",
    ]
    assert [ol.duration_text(s) for s in (45, 720, 11520, 1.6e6)] == ["45 s", "12 min", "3.2 h", "19 days"]


REFUSED_AT_ONCE = {  # flags wrong in themselves: answered before the model is built, most before torch loads
    "a prefix of a flag": (["--save-pretrain", "x"], "unrecognized arguments: --save-pretrain"),
    "a model folder and sizes": (["--model", "{tmp}", "--hidden-size", "128"], "brings its own sizes: drop --hidden"),
    "a model folder and a preset": (["--model", "{tmp}", "--preset", "tiny"], "drop --preset"),
    "one path for two outputs": (["--json", "{tmp}/x", "--save-output", "{tmp}/x"], "--json and --save-output both"),
    "a trace over the JSON": (
        ["--mode", "overlapped", "--train", "--profile", "{tmp}/t.json", "--json", "{tmp}/t.train.json"],
        "both name",
    ),
    "a checkpoint in the weights' folder": (
        ["--train", "--save-pretrained", "{tmp}/m", "--checkpoint", "{tmp}/m"],
        "--save-pretrained and --checkpoint both name",
    ),
    "sizes no LLaMA has": (["--preset", "tiny", "--heads", "5"], "not divisible by 5 attention heads"),
    "text without a tokenizer": (
        ["--preset", "tiny", "--train", "--data", "{tmp}/site/torch/__init__.py"],
        "no tokenizer: give --tokenizer DIR",
    ),
    "a prompt without a tokenizer": (["--preset", "tiny", "--train", "--sample", "def"], "--sample needs a tokenizer"),
    "a tokenizer folder without one": (
        ["--preset", "tiny", "--train", "--sample", "def", "--tokenizer", "{tmp}/site"],
        "no tokenizer.json, tokenizer.model or vocab.json there",
    ),
}


@pytest.mark.parametrize("case", REFUSED_AT_ONCE)
def test_mistakes_are_answered_before_the_model_is_built(case, tmp_path, capsys, monkeypatch):
    """One line that says what is wrong, exit 2, nothing written, and no model built."""
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text("")
    monkeypatch.setattr(ol, "load_model", lambda *a: pytest.fail("the model was built"))
    args, message = REFUSED_AT_ONCE[case]
    code, out, err = run_main(capsys, "--mode", "cpu", *(a.format(tmp=tmp_path) for a in args))
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # nothing written


def host_checked(monkeypatch, available_gib: float, **fields) -> ol.RunConfig:
    """A cpu-mode run checked against a host with `available_gib` GiB available."""
    monkeypatch.setattr(ol, "host_memory_available", lambda: int(available_gib * ol.GiB))
    return ol.RunConfig(**{"preset": "tiny", "mode": "cpu", "dtype": "bfloat16", **fields})


def test_eager_attentions_scores_count_in_the_host_check(monkeypatch):
    """65,536 tokens of eager attention on the CPU: 4 heads' scores of 65,536² elements, scaled beside the raw ones,
    64 GiB in bfloat16, refused before they are allocated; sdpa's flash kernel keeps none."""
    run = host_checked(monkeypatch, 23, attention="eager", seq_len=65536)
    with pytest.raises(ol.UsageError, match=r"the run needs 6\d\.\d GiB of host memory, .*: passes 6\d\.\d GiB"):
        planned(run, ol.measured_facts(run))
    sdpa = host_checked(monkeypatch, 23, seq_len=65536)
    planned(sdpa, ol.measured_facts(sdpa))


def test_a_refusal_for_host_memory_suggests_only_what_the_mode_allows(monkeypatch):
    """cpu mode has no disk tier: a model too large for the host is told to shrink, not to use --nvme."""
    run = host_checked(monkeypatch, 1, preset="7b-8l", train=True)
    with pytest.raises(ol.UsageError, match=r"use fewer or smaller layers \(--layers, [^)]*\)$"):
        planned(run, ol.measured_facts(run))


def test_a_refusal_under_the_users_host_cap_says_to_raise_it(monkeypatch):
    """--max-host-memory below what the model needs: the refusal, before or with the plan, names the cap."""
    with pytest.raises(ol.UsageError, match=r"or a larger --max-host-memory, or a host with more memory$"):
        capped = ol.RunConfig(preset="7b-8l", train=True, max_host_memory=1e-9)
        ol.check_host_holds(capped, ol.model_sizes(capped)[0])
    run = host_checked(monkeypatch, 1, preset="7b-8l", train=True, max_host_memory=1.0)
    with pytest.raises(ol.UsageError, match=r"or a larger --max-host-memory$"):
        planned(run, ol.measured_facts(run))


def test_a_sequence_the_host_cannot_hold_is_refused_and_a_long_one_is_estimated(monkeypatch, capsys):
    run = host_checked(monkeypatch, 23, seq_len=10_000_000, batch_size=4)
    with pytest.raises(ol.UsageError, match="of host memory, only 23.0 GiB are available"):
        planned(run, ol.measured_facts(run))
    long = host_checked(monkeypatch, 23, seq_len=10_000_000)
    monkeypatch.setattr(ol, "matmul_rate", lambda device, dtype: 1e11)  # a 100 GFLOP/s CPU
    ol.warn_if_long(long, ol.llama_config(long))
    flops = ol.pass_flops(long, ol.llama_config(long))  # one pass on the CPU: 4 x 3 layers x 1e14 x 64, and more
    assert 7.6e16 < flops < 7.8e16
    assert "note: this run computes for 8.9 days at least" in capsys.readouterr().err
    short = host_checked(monkeypatch, 23, seq_len=256)
    monkeypatch.setattr(ol, "matmul_rate", lambda device, dtype: pytest.fail("a short run needs no estimate"))
    ol.warn_if_long(short, ol.llama_config(short))
