"""moe/dispatch/platform.py and Execution.resolved(): the one place `auto` becomes a concrete choice per platform, applied
on the model's entry and recorded in a run's config.json (and left out of a study's fingerprint)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from moe import Execution
from moe.dispatch import platform
from rundir.config_layout import RESOLVED_KEY, pre_split_layout
from tests.model_fixtures import tiny_model


@pytest.mark.parametrize("name, grouped, permute, cudnn", [
    ("cpu", "slab", "scatter", "xla"), ("cuda", "slab", "gather", "cudnn"), ("rocm", "slab", "gather", "xla"),
    ("tpu", "ragged_dot", "gather", "xla"), ("metal", "ragged_dot", "gather", "xla")])
def test_auto_per_platform(name, grouped, permute, cudnn):
    ex = Execution(attention_impl="cudnn", dtype="bfloat16").resolved(name)
    assert (ex.platform, ex.grouped_matmul, ex.permute_grad, ex.attention_impl) == (name, grouped, permute, cudnn)


def test_explicit_choices_are_kept_and_resolving_twice_changes_nothing():
    ex = Execution(grouped_matmul="blocked", permute_grad="gather", attention_impl="einsum").resolved("cpu")
    assert (ex.grouped_matmul, ex.permute_grad, ex.attention_impl) == ("blocked", "gather", "einsum")
    assert ex.resolved() == ex and ex.resolved("tpu") == ex.replace(platform="tpu")
    assert Execution().resolved().platform == platform.current() == "cpu"


def test_the_model_resolves_auto_on_entry():
    """A call with `auto` computes exactly what the platform's concrete choices compute."""
    model = tiny_model()
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 61, (2, 16)))
    auto, _ = model(tokens)
    concrete, _ = model(tokens, execution=Execution(grouped_matmul="slab", permute_grad="scatter"))
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(concrete))


def test_a_run_records_its_platforms_choices(tiny_run):
    doc = json.loads((tiny_run / "config.json").read_text())
    # configs/tiny.py asks for ragged_dot and leaves permute_grad to the platform
    assert doc[RESOLVED_KEY] == {"platform": "cpu", "grouped_matmul": "ragged_dot", "permute_grad": "scatter",
                                 "attention_impl": "blockwise"}
    assert doc["execution"]["permute_grad"] == "auto"  # the config itself keeps what was asked for
    without = {k: v for k, v in doc.items() if k != RESOLVED_KEY}
    assert pre_split_layout(doc) == pre_split_layout(without)  # not part of a study's fingerprint
