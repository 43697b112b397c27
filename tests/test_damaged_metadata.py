"""A checkpoint whose metadata is damaged in ways that still parse as JSON -- a tokenizer that is not a tokenizer,
a model config claiming sizes the stored arrays do not have -- is a damaged checkpoint like any other: readers say
so in one line on stderr and use the previous readable one, quickly (nothing is allocated at the claimed size)."""

import json
import shutil
import time

import pytest

from analysis.routing import cli as routing
from train import export, generate


def _damage_meta(tiny_run, tmp_path, change) -> object:
    work = tmp_path / "run"
    shutil.copytree(tiny_run, work)
    path = work / "checkpoints" / "20" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))
    return work


def _garbage_tokenizer(meta):
    meta["tokenizer"] = '{"not": "a tokenizer"}'


def _absurd_vocabulary(meta):
    meta["model"]["vocab_size"] = 10 ** 9


@pytest.mark.parametrize("change, said", [(_garbage_tokenizer, "tokenizer is unreadable"),
                                          (_absurd_vocabulary, "the checkpoint holds [")])
def test_readers_fall_back_to_the_previous_checkpoint(tiny_run, tmp_path, capsys, change, said):
    work = _damage_meta(tiny_run, tmp_path, change)
    t0 = time.perf_counter()
    export.main(["--workdir", str(work), "--out", str(tmp_path / "export"), "--format", "safetensors"])
    assert time.perf_counter() - t0 < 60
    assert json.loads((tmp_path / "export" / "moe-export.json").read_text())["step"] == 10
    generate.main(["--workdir", str(work), "--prompt", "The", "--max_new_tokens", "2"])
    routing.main(["--workdir", str(work), "--out", str(tmp_path / "routing"), "--max_tokens", "200",
                  "--no_progress"])
    assert json.loads((tmp_path / "routing" / "routing.json").read_text())["step"] == 10
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    warnings = [line for line in captured.err.splitlines() if "checkpoint 20" in line]
    assert len(warnings) >= 3 and all(said in w and "using the previous one" in w for w in warnings), warnings
    assert "checkpoint 20" not in captured.out
