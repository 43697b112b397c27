"""Routing plots and tokens.html on a synthetic-but-realistic routing (4 layers, 16 experts, top-2, 9 domains).

`python -m tests.test_routing_plots OUT_DIR` writes every sample plot and tokens.html for a visual check."""

import sys

import numpy as np
import pytest

from analysis import routing_html, routing_plots, routing_stats

DOMAINS = ["religion", "literature", "law", "speeches", "mathematics", "technical", "code", "encyclopedia",
           "science"]
TOKEN_TEXT = {0: ".", 1: " the", 2: ":", 3: "what", 4: "\n", 5: " <tag>", 6: "  ", 7: "&amp;"}
L, E, K, V = 4, 16, 2, 200


def synthetic_routing(rng, B=18, S=96):
    """Router logits = domain preference (stronger in deeper layers) + per-token preference + AR(1) noise
    (gives above-random locality); expert 15 is dead in layer 0."""
    domains_BxS = np.repeat(np.arange(B) % len(DOMAINS), S).reshape(B, S)
    tokens_BxS = (rng.zipf(1.3, (B, S)) - 1) % V
    dom_pref_DxE, tok_pref_VxE = rng.normal(0, 1, (len(DOMAINS), E)), rng.normal(0, 1.5, (V, E))
    routing = []
    for layer in range(L):
        noise_BxSxE = rng.normal(0, 1, (B, S, E))
        for t in range(1, S):  # AR(1) in time: consecutive tokens route alike
            noise_BxSxE[:, t] = 0.6 * noise_BxSxE[:, t - 1] + 0.8 * noise_BxSxE[:, t]
        logits_BxSxE = (0.5 + 0.5 * layer) * dom_pref_DxE[domains_BxS] + tok_pref_VxE[tokens_BxS] + noise_BxSxE
        if layer == 0:
            logits_BxSxE[..., 15] = -np.inf
        ids_BxSxK = np.argsort(-logits_BxSxE, -1)[..., :K].astype(np.int32)
        top_BxSxK = np.take_along_axis(logits_BxSxE, ids_BxSxK, -1)
        gates_BxSxK = np.exp(top_BxSxK - top_BxSxK.max(-1, keepdims=True))
        routing.append({"expert_ids": ids_BxSxK, "gates": gates_BxSxK / gates_BxSxK.sum(-1, keepdims=True)})
    valid_BxS = np.ones((B, S), bool)
    valid_BxS[:, -7:] = False  # padding
    segment_ids_BxS = (np.arange(S) >= S // 2)[None].repeat(B, 0).astype(np.int32)
    return routing, tokens_BxS, domains_BxS, valid_BxS, segment_ids_BxS


@pytest.fixture(scope="module")
def data():
    return make_data()


def make_data():
    rng = np.random.default_rng(0)
    acc = routing_stats.RoutingAccumulator(L, E, K, len(DOMAINS), V, track_tokens=list(TOKEN_TEXT), n_frequent=8)
    sat = routing_stats.SaturationAccumulator(L)
    for _ in range(2):
        routing, tokens, domains, valid, seg = synthetic_routing(rng)
        acc.update(routing, tokens, domains, valid, seg)
        # An "earlier checkpoint": the final routing with the second choice perturbed in deeper layers.
        early = [np.where(rng.random(r["expert_ids"].shape) < 0.1 * (i + 1), (r["expert_ids"] + 1) % E,
                          r["expert_ids"]) for i, r in enumerate(routing)]
        sat.update(early, routing, valid)
    result = acc.finalize()
    steps = np.arange(0, 5000, 50)
    series = {layer: (steps, 5.0 * np.exp(-steps / (800 + 300 * layer)) + 0.1 + 0.02 * layer) for layer in range(L)}
    sat_L = sat.finalize()["saturation_L"]
    sat_by_step = {s: np.clip(sat_L * (0.3 + 0.7 * s / 4000), 0, 1) for s in (500, 1000, 2000, 4000)}
    return result, series, sat_by_step, routing, tokens, domains


def write_all(data, out_dir, full=True):
    """full=False draws fewer subplots (matplotlib spends ~0.1 s per axes) to keep the test fast."""
    result, series, sat_by_step, routing, tokens, domains = data
    text = lambda i: TOKEN_TEXT.get(int(i), f"tok{int(i)}")
    layers, n_tok = (None, 12) if full else ([3], 2)
    paths = [
        routing_plots.plot_domain_bars(result, 3, f"{out_dir}/domain_bars_layer3.png", DOMAINS),
        routing_plots.plot_domain_heatmaps(result, f"{out_dir}/domain_heatmaps.png", DOMAINS, layers),
        routing_plots.plot_token_experts(result, f"{out_dir}/token_experts.png", text, max_tokens=n_tok),
        routing_plots.plot_token_experts(result, f"{out_dir}/frequent_token_experts.png", text, which="freq",
                                         max_tokens=n_tok),
        routing_plots.plot_locality(result, f"{out_dir}/locality.png"),
        routing_plots.plot_vocab_specialization(result, f"{out_dir}/vocab_specialization.png"),
        routing_plots.plot_coactivation(result, f"{out_dir}/coactivation.png", layers),
        routing_plots.plot_maxvio_series(series, f"{out_dir}/maxvio_training.png"),
        routing_plots.plot_maxvio_global(result, f"{out_dir}/maxvio_global.png"),
        routing_plots.plot_saturation(sat_by_step, f"{out_dir}/saturation.png", final_step=5000,
                                     random_baseline=K / E),
        routing_plots.plot_saturation({2000: sat_by_step[2000]}, f"{out_dir}/saturation_one.png"),
    ]
    samples = []
    for row in range(0, 18, 2):
        first_LxN = [r["expert_ids"][row, :40, 0].tolist() for r in routing]
        samples.append((DOMAINS[domains[row, 0]], [text(t) for t in tokens[row, :40]], first_LxN))
    paths.append(routing_html.render_tokens_html(samples, [0, 3], E, f"{out_dir}/tokens.html"))
    return paths


def test_every_plot_writes_png_and_html_escapes(data, tmp_path):
    paths = write_all(data, tmp_path, full=False)
    for path in paths[:-1]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    doc = open(paths[-1], encoding="utf-8").read()
    assert "religion" in doc and "code" in doc and " the" in doc and "layer 3" in doc
    assert "&lt;tag&gt;" in doc and "<tag>" not in doc and "&amp;amp;" in doc
    assert "\u21b5" in doc  # the newline token is visible


def test_plot_edge_cases(data, tmp_path):
    result = dict(data[0], track_n_T=np.zeros_like(data[0]["track_n_T"]))
    assert routing_plots.plot_token_experts(result, tmp_path / "none.png", {}) == tmp_path / "none.png"
    routing_plots.plot_maxvio_series({}, tmp_path / "empty.png")
    routing_plots.plot_domain_heatmaps(data[0], tmp_path / "top1.png", layers=[0], key="share_top1_LxDxE")
    assert (tmp_path / "empty.png").stat().st_size > 0
    colors = routing_html.expert_colors(64)
    assert len(set(c for c, _ in colors)) == 64
    assert [c for c, _ in colors[:20]] == list(routing_html.DISTINCT_20)  # the hand-picked palette first


if __name__ == "__main__":
    import pathlib

    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/routing_plots")
    out.mkdir(parents=True, exist_ok=True)
    d = make_data()
    print("\n".join(map(str, write_all(d, out))))
    print(routing_stats.summary_text(d[0], DOMAINS))
