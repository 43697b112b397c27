"""Routing plots and tokens.html on a synthetic-but-realistic routing (4 layers, 16 experts, top-2, 9 domains).

`python -m tests.test_routing_plots OUT_DIR` writes every sample plot and tokens.html for a visual check."""

import pathlib
import sys

import numpy as np
import pytest

from analysis.routing import collect, outputs, tokens_html
from analysis.routing import plots as routing_plots
from analysis.routing import stats as routing_stats

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
    paths.append(tokens_html.render_tokens_html(samples, [0, 3], E, f"{out_dir}/tokens.html"))
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
    colors = tokens_html.expert_colors(64)
    assert len(set(c for c, _ in colors)) == 64
    assert [c for c, _ in colors[:20]] == list(tokens_html.DISTINCT_20)  # the hand-picked palette first


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions draw, captured before they are saved and closed."""
    captured, real_save = [], routing_plots.save
    monkeypatch.setattr(routing_plots, "save", lambda fig, path, **kw: (captured.append(fig), real_save(fig, path))[1])
    return captured


def _panels(fig):
    """(image axes, colourbar axes) of a heatmap figure."""
    images = [ax for ax in fig.axes if ax.images]
    return images, [ax for ax in fig.axes if not ax.images and ax.get_visible()]


@pytest.mark.parametrize("plot, chance", [
    (lambda r, p: routing_plots.plot_domain_heatmaps(r, p, DOMAINS, layers=[0, 3]), K / E),
    (lambda r, p: routing_plots.plot_domain_heatmaps(r, p, DOMAINS, layers=[0, 3], key="share_top1_LxDxE"), 1 / E),
    (lambda r, p: routing_plots.plot_coactivation(r, p, layers=[0, 3]), (K - 1) / (E - 1)),
])
def test_heatmaps_share_one_colour_scale_centred_on_chance(data, tmp_path, figures, plot, chance):
    plot(data[0], tmp_path / "h.png")
    images, colorbars = _panels(figures[0])
    assert len(images) == 2 and len(colorbars) == 1  # one colourbar for every layer
    (norm, *others) = [ax.images[0].norm for ax in images]
    assert all(o.vmin == norm.vmin and o.vmax == norm.vmax for o in others)
    # White (the colour map's middle) at chance: equal log-distance to both ends of the scale.
    np.testing.assert_allclose(np.sqrt(norm.vmin * norm.vmax), chance, rtol=1e-9)
    labels = [t.get_text() for t in colorbars[0].get_yticklabels()]
    assert any(label.startswith(("uniform", "random")) and f"{chance:.3g}" in label for label in labels), labels
    assert [ax.get_title() for ax in images] == ["layer 0", "layer 3"]


def test_coactivation_diagonal_is_masked(data, tmp_path, figures):
    routing_plots.plot_coactivation(data[0], tmp_path / "c.png", layers=[1])
    shown = figures[0].axes[0].images[0].get_array()
    assert shown.mask.diagonal().all() and not shown.mask[0, 1]


def test_domain_bars_share_the_y_axis_across_layers(data, tmp_path, figures):
    two = dict(data[0], share_LxDxE=data[0]["share_LxDxE"][:, :2], n_tokens_D=data[0]["n_tokens_D"][:2])
    for layer in (0, 3):
        routing_plots.plot_domain_bars(two, layer, tmp_path / f"bars{layer}.png", DOMAINS[:2])
    ylims = {ax.get_ylim() for fig in figures for ax in fig.axes if ax.get_visible()}
    assert len(ylims) == 1 and ylims.pop()[1] >= max(np.nanmax(two["share_LxDxE"]),
                                                     np.nanmax(two["tokennull_share_LxDxE"][:, :2]),
                                                     np.nanmax(two["loadmatched_share_LxE"]))
    lines = {line.get_label().split(" ")[0]: line for line in figures[0].axes[0].get_lines()}
    assert lines["uniform"].get_ydata()[0] == K / E and "uniform K/E" in lines["uniform"].get_label()
    # The token-identity null of every expert, and the load-matched one, are drawn inside the shared y axis.
    np.testing.assert_allclose(lines["token-identity"].get_ydata(), data[0]["tokennull_share_LxDxE"][0, 0])
    assert figures[1].axes[0].get_title().startswith("layer 3 - religion")


def test_maxvio_series_plain_ticks_and_smoothing(data, tmp_path, figures):
    noisy = {layer: (s, v * np.exp(np.random.default_rng(layer).normal(0, 0.3, len(v))))
             for layer, (s, v) in data[1].items()}
    routing_plots.plot_maxvio_series(noisy, tmp_path / "m.png")
    ax = figures[0].axes[0]
    figures[0].canvas.draw()
    assert ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all("10^" not in t and "$" not in t for t in labels), labels
    raw, smooth = ax.get_lines()[:2]  # layer 0: every batch faint, smoothed strong, same colour
    assert raw.get_alpha() < 0.5 and smooth.get_linewidth() > raw.get_linewidth() and raw.get_color() == smooth.get_color()
    assert np.std(np.diff(smooth.get_ydata())) < np.std(np.diff(raw.get_ydata()))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"layer {i}" for i in range(L)]


def test_layer_labels_use_model_layer_ids(data):
    result = dict(data[0], layer_ids_L=np.array([1, 2, 3, 5]))
    assert routing_plots.layer_labels(result) == ["layer 1", "layer 2", "layer 3", "layer 5"]
    assert routing_plots.layer_labels(data[0]) == [f"layer {i}" for i in range(L)]


def test_write_plots_draws_domain_bars_for_every_moe_layer(data, tmp_path, monkeypatch):
    """analysis.routing.outputs.write_plots: one domain_experts_layerL.png per MoE layer, model-layer labels on the
    saturation plot (the drawing itself is stubbed: the tests above cover it)."""
    calls = []
    for name in dir(routing_plots):
        if name.startswith("plot_"):
            monkeypatch.setattr(routing_plots, name, lambda *a, _n=name, **kw: calls.append((_n, a, kw))
                                or next(x for x in a if isinstance(x, pathlib.Path)))
    result = dict(data[0], layer_ids_L=np.array([1, 2, 3, 5]))
    a = collect.Analysis(result, DOMAINS, TOKEN_TEXT, [], [], {"saturation_L": np.full(L, 0.5)}, 1, 1.0)
    paths = outputs.write_plots(a, tmp_path, 0, data[1], final_step=20, compare_step=10)
    bars = [c for c in calls if c[0] == "plot_domain_bars"]
    assert [c[1][1] for c in bars] == [0, 1, 2, 3]
    assert [p.name for p in paths[:4]] == [f"domain_experts_layer{i}.png" for i in (1, 2, 3, 5)]
    (sat,) = [c for c in calls if c[0] == "plot_saturation"]
    assert sat[2]["layer_names"] == ["layer 1", "layer 2", "layer 3", "layer 5"]


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/routing_plots")
    out.mkdir(parents=True, exist_ok=True)
    d = make_data()
    print("\n".join(map(str, write_all(d, out))))
    print(routing_stats.summary_text(d[0], DOMAINS))
