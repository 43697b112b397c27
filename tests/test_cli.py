"""Every CLI answers --help (exit 0, usage on stdout); `python -m train --help` lists the config keys of the
chosen --config; overrides are parsed by the key's type."""

import pytest

from analysis import loss_curves
from analysis.rank import cli as rank
from analysis.routing import cli as routing
from experiments.masks_round1 import runner as experiments
from plumbing.errors import UserError
from train import __main__ as train_cli
from train import export, generate
from train.command_line import apply_override, load_config_file

CLIS = {"train": lambda a: train_cli.main(["train", *a]), "experiments.masks_round1": lambda a: experiments.main(["x", *a]),
        "analysis.routing": routing.main, "analysis.rank": rank.main, "analysis.loss_curves": loss_curves.main,
        "train.export": export.main, "train.generate": generate.main}


@pytest.mark.parametrize("name", sorted(CLIS))
def test_help_exits_0_with_usage(name, capsys):
    with pytest.raises(SystemExit) as e:
        CLIS[name](["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python -m"), out[:200]


def test_train_help_lists_the_keys_of_the_chosen_config(capsys):
    with pytest.raises(SystemExit):
        train_cli.main(["train", "--config=configs/tiny.py", "--config.train.steps=7", "--help"])
    out = capsys.readouterr().out
    assert "train.steps = 7" in out and "model.d_model = 64" in out and "--workdir" in out


def test_overrides_are_parsed_by_type():
    c = load_config_file("configs/tiny.py")
    for key, text, value in [("train.steps", "12", 12), ("train.lr", "1e-3", 1e-3), ("train.lr", "2", 2.0),
                             ("model.rope", "False", False), ("model.rope", "yes", True),
                             ("data.name", "lm1b", "lm1b")]:
        apply_override(c, key, text)
        node = c
        for part in key.split("."):
            node = node[part]
        assert node == value and type(node) is type(value), (key, text, node)
    for key, text in [("train.steps", "12.5"), ("model.rope", "2"), ("model.n_shared_experts", "True")]:
        with pytest.raises(UserError, match=key):
            apply_override(c, key, text)


# What no command may load before it has read its flags: each costs seconds of start-up (tensorboardX imports torch
# when torch is installed), and --help or a mistyped flag must answer at once (benchmarks/cli_start.py times it).
HEAVY = ("torch", "tensorboardX", "orbax.checkpoint", "tensorflow_datasets", "grain", "matplotlib")


# (command, a mistyped flag): every command's --help and bad flag, before its heavy imports.
FLAG_CASES = [("train", ["--config.train.stepz=3"]), ("train.generate", ["--workdir", "x", "--prompt", "p", "--top_p", "2"]),
              ("train.export", ["--workdir", "x", "--out", "y", "--format", "onnx"]),
              *[(f"analysis.{name}", ["--workdr", "x"])
                for name in ("routing", "specialization", "ablate", "dynamics", "rank", "loss_curves", "compare", "paths",
                             "counterfactual", "importance")]]


@pytest.mark.parametrize("module,bad", FLAG_CASES, ids=[c for c, _ in FLAG_CASES])
def test_commands_answer_help_and_bad_flags_without_heavy_imports(module, bad):
    import subprocess
    import sys

    for argv, code in ((["--help"], 0), (bad, 2)):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *argv], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == code, (argv, out.stderr[-500:])
        loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
        # the analyses do not even load JAX to read their flags
        heavy = set(HEAVY) | ({"jax"} if module.startswith("analysis.") else set())
        assert not loaded & heavy, (argv, sorted(loaded & heavy))
        if code == 0:
            assert out.stdout.startswith(f"usage: python -m {module}"), out.stdout[:200]
        else:
            errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
            assert len(errors) == 1, errors
