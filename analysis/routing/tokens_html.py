"""tokens.html: sample texts with each token coloured by its first-choice expert, one tab per chosen layer.

Self-contained (inline CSS, no JS: tabs are CSS radio buttons). Hovering a token shows its expert at every
layer. Spaces are kept (white-space: pre-wrap), newlines are drawn as a visible mark plus a line break.
"""

import colorsys
import html

_WHITESPACE_MARKS = {"\n": "\u21b5\n", "\t": "\u2192\t", "\r": "\u240d"}


# Sasha Trubetskoy's "20 simple, distinct colours", most distinct first; navy moved ahead of olive (close to
# brown) and the near-white beige last, so 16 experts get 16 clearly different colours.
DISTINCT_20 = ("#e6194b", "#3cb44b", "#ffe119", "#4363d8", "#f58231", "#911eb4", "#46f0f0", "#f032e6",
               "#bcf60c", "#fabebe", "#008080", "#e6beff", "#9a6324", "#800000", "#aaffc3", "#000075",
               "#808000", "#ffd8b1", "#808080", "#fffac8")


def _text_color(r, g, b):
    # WCAG: the text colour with the higher contrast ratio (black wins when luminance > ~0.18).
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    luminance = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return "#000" if (luminance + 0.05) / 0.05 > 1.05 / (luminance + 0.05) else "#fff"


def expert_colors(n_experts):
    """[(background, text colour)] per expert. Up to 20 experts: a hand-picked qualitative palette whose
    colours are easy to tell apart. Beyond 20 no palette stays distinguishable, so experts 20+ get
    golden-ratio hue steps with cycling lightness: every colour differs, but some are close to others; the
    number shown on hover (and in the legend) is the reliable way to tell them apart."""
    colors = []
    for e in range(n_experts):
        if e < len(DISTINCT_20):
            h = DISTINCT_20[e]
            r, g, b = (int(h[i:i + 2], 16) / 255 for i in (1, 3, 5))
        else:
            hue = (e * 0.618033988749895) % 1.0
            r, g, b = colorsys.hls_to_rgb(hue, (0.72, 0.50, 0.35)[e % 3], (0.75, 0.60, 0.85)[(e // 3) % 3])
        colors.append((f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}", _text_color(r, g, b)))
    return colors


def _token_html(text):
    shown = "".join(_WHITESPACE_MARKS.get(ch, ch) for ch in text)
    return html.escape(shown, quote=True) if shown else "\u2205"


def _sample_html(name, tokens, first_LxN, layer, layer_label, n_layers):
    spans = []
    for i, token in enumerate(tokens):
        e = int(first_LxN[layer][i])
        tip = f"{token!r}\n" + "\n".join(f"{layer_label(j)}: expert {int(first_LxN[j][i])}" for j in range(n_layers))
        # &#10; keeps the multi-line tooltip without raw newlines inside the attribute.
        tip_attr = html.escape(tip, quote=True).replace("\n", "&#10;")
        spans.append(f'<span class="t e{e}" title="{tip_attr}">{_token_html(token)}</span>')
    return f'<div class="sample"><div class="name">{html.escape(name)}</div><div class="text">{"".join(spans)}</div></div>'


def render_tokens_html(samples, layers, n_experts, path, layer_names=None, title="Routing: first-choice expert"):
    """Writes tokens.html and returns path.

    samples: [(domain name, [token string] * N, first-choice expert per layer [n_layers][N])]; samples of one
    domain are grouped in one section. layers: indices (into the per-layer lists) that get a tab.
    layer_names: optional label per layer index (default "layer i")."""
    n_layers = len(samples[0][2]) if samples else 0
    label = (lambda j: layer_names[j]) if layer_names is not None else (lambda j: f"layer {j}")
    layers = list(layers)
    colors = expert_colors(n_experts)
    css = [
        "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}",
        ".sample{margin:0.6em 0 1em}.name{font-size:0.8em;color:#666}",
        ".text{font-family:ui-monospace,Menlo,monospace;font-size:14px;line-height:1.9;white-space:pre-wrap;"
        "word-break:break-word}",
        ".t{border-radius:3px;padding:1px 0;margin:0 1px;outline:1px solid rgba(0,0,0,0.12)}",
        ".t:hover{outline:2px solid #000}",
        "input.tab{display:none}label.tab{display:inline-block;padding:4px 12px;margin:0 2px 8px 0;"
        "border:1px solid #aaa;border-radius:4px;cursor:pointer}",
        ".panel{display:none}.legend span{display:inline-block;min-width:2.2em;text-align:center;margin:1px;"
        "font-size:12px;border-radius:3px;padding:1px 2px}",
    ]
    css += [f".e{e}{{background:{bg};color:{fg}}}" for e, (bg, fg) in enumerate(colors)]
    # CSS-only tabs: the checked radio shows its panel and highlights its label.
    css += [f"#tab{i}:checked~.panels .p{i}{{display:block}}#tab{i}:checked~label[for=tab{i}]"
            "{background:#333;color:#fff}" for i in range(len(layers))]
    by_domain = {}
    for name, tokens, first_LxN in samples:
        by_domain.setdefault(name, []).append((tokens, first_LxN))
    body = [f"<h1>{html.escape(title)}</h1>",
            "<p>Each token is coloured by its first-choice expert at the selected layer; hover for all layers."
            " \u21b5 marks a newline."
            + (f" With {n_experts} experts some colours are alike (only the first {len(DISTINCT_20)} are clearly"
               " distinct): hover a token for its expert number." if n_experts > len(DISTINCT_20) else "")
            + "</p>",
            '<div class="legend">Experts: '
            + "".join(f'<span class="e{e}">{e}</span>' for e in range(n_experts)) + "</div><br>"]
    body += [f'<input class="tab" type="radio" name="layer" id="tab{i}"{" checked" if i == 0 else ""}>'
             for i in range(len(layers))]
    body += [f'<label class="tab" for="tab{i}">{html.escape(label(layer))}</label>' for i, layer in enumerate(layers)]
    body.append('<div class="panels">')
    for i, layer in enumerate(layers):
        body.append(f'<div class="panel p{i}">')
        for name, items in by_domain.items():
            body.append(f"<h2>{html.escape(name)} - {html.escape(label(layer))}</h2>")
            body += [_sample_html(f"sample {k} ({len(tokens)} tokens)", tokens, first_LxN, layer, label, n_layers)
                     for k, (tokens, first_LxN) in enumerate(items)]
        body.append("</div>")
    body.append("</div>")
    doc = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
           f"<title>{html.escape(title)}</title><style>{''.join(css)}</style></head>\n<body>\n"
           + "\n".join(body) + "\n</body></html>\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(doc)
    return path
