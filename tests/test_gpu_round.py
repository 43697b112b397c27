"""The decoder-only GPU round's one command (experiments.gpu_round): every part's flags and config are checked
before anything trains, and the parts run in order through their own runners."""

import types

import pytest

from experiments.gpu_round import runner as gpu_round


def test_dry_run_checks_every_part_and_trains_nothing(tmp_path, capsys):
    gpu_round.main(["--dry_run", "--out", str(tmp_path / "round")])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("]")[0] for line in lines] == ["[study", "[encdec", "[head_sweep", "[mlm"]
    assert "causal_half" in lines[0] and "experiments/mlm/config_gpu.py" in lines[3]
    assert not (tmp_path / "round").exists()


@pytest.mark.parametrize("argv,msg", [(["--parts", "study,rank"], "--parts"), (["--parts", "mlm,mlm"], "--parts"),
                                      (["--seeds", "1"], "--seeds")])
def test_bad_flags_are_one_line_errors_before_any_part_runs(argv, msg, capsys, monkeypatch):
    monkeypatch.setattr(gpu_round, "run_part", lambda *a: pytest.fail("a part ran"))
    with pytest.raises(SystemExit) as e:
        gpu_round.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1


def test_parts_run_in_order_and_a_failing_part_stops_the_round(monkeypatch):
    calls = []

    def fake_module(name, code):
        def main(argv):
            calls.append((name, argv[1:]))
            if code:
                raise SystemExit(code)
        return types.SimpleNamespace(main=main)

    modules = {"experiments.masks_round2.runner": fake_module("study", 0),
               "experiments.encdec.runner": fake_module("encdec", 2), "experiments.mlm.runner": fake_module("mlm", 0)}
    monkeypatch.setattr("importlib.import_module", lambda name: modules[name])
    monkeypatch.setattr(gpu_round, "check_part", lambda *a: None)
    gpu_round.main(["--parts", "mlm,study", "--out", "o", "--seeds", "3"])
    assert [c[0] for c in calls] == ["mlm", "study"]
    assert calls[1][1][-4:] == ["--seeds", "3", "--out", "o/study"]
    calls.clear()
    with pytest.raises(SystemExit) as e:
        gpu_round.main(["--parts", "encdec,mlm", "--out", "o"])
    assert e.value.code == 2 and [c[0] for c in calls] == ["encdec"]
