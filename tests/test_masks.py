"""What each mask mode lets a position see, checked through the model's logits (dependence = visibility)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe.attention import attention_mask
from tests.model_fixtures import forward_fn

L = 12


def _tokens(seed):
    return jax.random.randint(jax.random.key(seed), (1, L), 0, 61)


def _changed_positions(mode, change_at, prefix=None, segments=None):
    """Positions whose logits change when the token at `change_at` changes."""
    fwd = forward_fn(mask=mode)
    tok = _tokens(0)
    tok2 = tok.at[0, change_at].set((tok[0, change_at] + 1) % 61)
    p = None if prefix is None else jnp.asarray([prefix])
    a = fwd(tok, segments, p)
    b = fwd(tok2, segments, p)
    return set(np.nonzero(np.abs(np.asarray(a - b)).max(-1)[0] > 1e-6)[0].tolist())


def test_causal_future_tokens_do_not_matter():
    for t in (0, 5, L - 1):
        assert _changed_positions("causal", t) == set(range(t, L))


def test_prefix_sees_whole_prefix_and_nothing_after():
    P = 5
    # A token inside the prefix is seen by every position (prefix is bidirectional, later ones are causal).
    assert _changed_positions("prefix", 2, prefix=P) == set(range(L))
    # A token after the prefix is seen only from its own position on.
    assert _changed_positions("prefix", 7, prefix=P) == set(range(7, L))


def test_bidirectional_sees_everything():
    assert _changed_positions("bidirectional", 9) == set(range(L))


def test_segment_ids_isolate_documents():
    seg = jnp.asarray([[1] * 4 + [2] * 5 + [3] * 3])
    for mode in ("causal", "bidirectional"):
        assert _changed_positions(mode, 5, segments=seg) <= set(range(4, 9))
    assert _changed_positions("bidirectional", 5, segments=seg) == set(range(4, 9))


# `bidirectional` has no output part by definition (every position sees everything), so it is not listed.
@pytest.mark.parametrize("mode", ["causal", "prefix", "mixed"])
def test_no_output_position_depends_on_a_later_token(mode):
    """After the prefix, every mode is causal: a change at t >= P never reaches positions < t."""
    P = 4
    for t in (P, 8, L - 1):
        changed = _changed_positions(mode, t, prefix=P)
        assert min(changed) == t, (mode, t, changed)


def test_mixed_heads_are_triangular_inside_prefix():
    P, H = 5, 4
    idx = jnp.arange(8)[None]
    m = np.asarray(attention_mask("mixed", idx, idx, n_heads=H, prefix_len_B=jnp.asarray([P])))[0]
    lower, upper = np.tril(np.ones((P, P), bool)), np.triu(np.ones((P, P), bool))
    for h in range(H):
        expect = lower if h < H // 2 else upper
        np.testing.assert_array_equal(m[h, :P, :P], expect)
        assert not m[h, :P, P:].any()  # prefix never sees outputs
        np.testing.assert_array_equal(m[h, P:], np.tril(np.ones((8, 8), bool))[P:])  # outputs causal
