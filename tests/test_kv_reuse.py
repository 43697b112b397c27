"""benchmarks/kv_reuse.py: the dialogue schedule and FLOP count by hand, and a tiny end-to-end run."""

import pytest

from benchmarks import kv_reuse as kv
from tests.model_fixtures import TINY


def test_schedule_reuse_prefills_only_the_new_message():
    assert kv.schedule("reuse", 0, 5, 3) == (0, 5)
    assert kv.schedule("reuse", 2, 5, 3) == (16, 5)
    assert kv.schedule("recompute", 2, 5, 3) == (0, 21)


def test_attended_pairs_by_hand():
    assert kv.attended_pairs("causal", 0, 4) == 1 + 2 + 3 + 4
    assert kv.attended_pairs("causal", 3, 2) == 4 + 5
    assert kv.attended_pairs("prefix", 0, 4) == 16
    # reuse over the turns attends exactly the pairs of one causal pass over the whole dialogue
    user, reply, turns = 5, 3, 3
    reuse = sum(kv.attended_pairs("causal", t * 8, user) for t in range(turns))
    whole = kv.attended_pairs("causal", 0, turns * 8)
    replies = sum(kv.attended_pairs("causal", t * 8 + user, reply) for t in range(turns))
    assert reuse + replies == whole


@pytest.mark.slow  # compiles 4 masks x 2 prompt lengths of a tiny model
def test_tiny_run_rows(capsys):
    rows = kv.run(dict(TINY), turns=2, user=4, reply=2, steps=1)
    assert len(rows) == 8 and all(r["ttft_ms"] > 0 for r in rows)
    t = {(r["mask"], r["mode"]): r for r in kv.totals(rows)}
    assert t["causal", "reuse"]["tokens prefilled"] == 8 < t["causal", "recompute"]["tokens prefilled"] == 14
    assert t["causal", "reuse"]["total gflops"] < t["prefix", "recompute"]["total gflops"]
