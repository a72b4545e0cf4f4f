"""What a pruned checkpoint says about itself: saliency JSON, a heat map, a README card.

The heat map (`saliency.png`, matplotlib) has two panels:

* top: MoE layers (rows, first at the top) by expert id (columns); each cell's colour is
  the expert's saliency under the chosen method, divided by its layer's largest (colour
  bar); dropped experts are faded towards grey, experts the calibration never routed to
  are white and protected super experts magenta (legend);
* bottom: each layer's saliency, sorted from most to least salient, with the cut after
  the n_keep-th expert: how sharply saliency falls off where the pruner cut.

With per-domain statistics (calibration data from two or more domains) a third panel
shows each domain's saliency side by side (layers by expert id per domain, each domain's
score divided by its own layer maximum, dropped experts faded as above): which experts
each domain relies on and whether the cut kept them.

The title names the method, the router weight (gate) and how many experts were kept.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from kimi_mlx.prune.observe import GATES, LayerStats
from kimi_mlx.prune.saliency import GATED, Selection

CMAP = "viridis"
FADE = 0.75  # dropped experts: this much of the colour is replaced by grey
GREY = np.array([0.85, 0.85, 0.85])
UNROUTED = np.array([1.0, 1.0, 1.0])
PROTECTED = np.array([0.85, 0.0, 0.75])


def cell_colours(stats: Mapping[int, LayerStats], sel: Selection):
    """(RGB float [layers, E, 3], normalised saliency [layers, E], layer ids) of the map."""
    import matplotlib

    cmap = matplotlib.colormaps[CMAP]
    layers = sorted(sel.kept)
    e = max(stats[l].num_experts for l in layers)
    rgb = np.ones((len(layers), e, 3))
    norm = np.zeros((len(layers), e))
    for r, l in enumerate(layers):
        s = np.asarray(sel.scores[l], np.float64)
        top = s.max() if s.size and s.max() > 0 else 1.0
        v = np.clip(s / top, 0.0, 1.0)
        norm[r, : len(s)] = v
        row = cmap(v)[:, :3]
        dropped = np.ones(len(s), bool)
        dropped[sel.kept[l]] = False
        row[dropped] = (1 - FADE) * row[dropped] + FADE * GREY
        row[(stats[l].count == 0) & dropped] = UNROUTED
        row[sel.protected.get(l, [])] = PROTECTED
        rgb[r, : len(s)] = row
    return rgb, norm, layers


def domain_colours(sel: Selection, layers: List[int], e: int):
    """(RGB float [layers, D * (E + 1) - 1, 3], domain names) of the per-domain panel: each
    domain's normalised score map (dropped experts faded), a white column between."""
    import matplotlib

    cmap = matplotlib.colormaps[CMAP]
    names = list(sel.domain_scores)
    blocks = []
    for d in names:
        rgb = np.ones((len(layers), e, 3))
        for r, l in enumerate(layers):
            v = np.clip(np.asarray(sel.domain_scores[d].get(l, np.zeros(e)), np.float64), 0, 1)
            row = cmap(v)[:, :3]
            dropped = np.ones(len(v), bool)
            dropped[sel.kept[l]] = False
            row[dropped] = (1 - FADE) * row[dropped] + FADE * GREY
            rgb[r, : len(v)] = row
        blocks.append(rgb)
        blocks.append(np.ones((len(layers), 1, 3)))
    return np.concatenate(blocks[:-1], axis=1), names


def _title(sel: Selection, num_experts: int) -> str:
    how = f"{sel.method}" + (f", {sel.gate} gate" if sel.method in GATED else "")
    if sel.method == "random":
        how += f", seed {sel.seed}"
    if sel.balance != "none":
        how += f", domains balanced by {sel.balance}"
    if not sel.uniform:
        return (f"Expert saliency ({how}, spread budget): keep {sum(sel.counts.values())} of "
                f"{num_experts * len(sel.kept)} ({', '.join(map(str, sel.counts.values()))} per layer)")
    return f"Expert saliency ({how}): keep {sel.n_keep} of {num_experts} per layer"


def heat_map_figure(stats: Mapping[int, LayerStats], sel: Selection):
    """A matplotlib Figure of the kept / dropped experts (see the module docstring)."""
    import matplotlib
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rgb, norm, layers = cell_colours(stats, sel)
    n_layers, e = norm.shape
    per_domain = len(sel.domain_scores) >= 2
    h_map = max(2.0, min(8.0, n_layers / 8))
    fig = Figure(figsize=(max(7.0, min(18.0, 4 + e / 40)),
                          4.5 + min(8.0, n_layers / 8) + 3.2 + (h_map + 1.2) * per_domain),
                 dpi=110, layout="constrained")
    if per_domain:
        top, bottom, dom = fig.subplots(3, 1, height_ratios=[h_map, 3.0, h_map])
        drgb, names = domain_colours(sel, layers, e)
        dom.imshow(drgb, aspect="auto", interpolation="nearest",
                   extent=(-0.5, drgb.shape[1] - 0.5, n_layers - 0.5, -0.5))
        dom.set_xticks([k * (e + 1) + (e - 1) / 2 for k in range(len(names))], names)
        dom.set_yticks(range(0, n_layers, max(1, n_layers // 12)),
                       [str(l) for l in layers[::max(1, n_layers // 12)]])
        dom.set_ylabel("MoE layer")
        dom.set_title("per domain (score / layer max, dropped faded)"
                      + (f", combined by {sel.balance}" if sel.balance != "none" else ""))
    else:
        top, bottom = fig.subplots(2, 1, height_ratios=[h_map, 3.0])
    top.imshow(rgb, aspect="auto", interpolation="nearest",
               extent=(-0.5, e - 0.5, n_layers - 0.5, -0.5))
    top.set_xlabel("expert id")
    top.set_ylabel("MoE layer")
    step = max(1, n_layers // 12)
    top.set_yticks(range(0, n_layers, step), [str(l) for l in layers[::step]])
    top.set_title(_title(sel, e))
    fig.colorbar(ScalarMappable(Normalize(0, 1), CMAP), ax=top,
                 label="saliency / layer maximum")
    top.legend(handles=[
        Patch(facecolor=matplotlib_colour(0.8), label="kept (colour = saliency)"),
        Patch(facecolor=(1 - FADE) * np.array(matplotlib_colour(0.8)) + FADE * GREY,
              label="dropped (faded)"),
        Patch(facecolor=UNROUTED, edgecolor="0.5", label="never routed"),
        Patch(facecolor=PROTECTED, label="protected super expert"),
    ], loc="upper center", bbox_to_anchor=(0.5, -0.17 if n_layers > 4 else -0.3),
        ncol=4 if e >= 128 else 2, fontsize="small", frameon=False)

    cmap = matplotlib.colormaps["plasma"]
    for r, l in enumerate(layers):
        curve = np.sort(norm[r, : stats[l].num_experts])[::-1]
        bottom.plot(np.arange(1, len(curve) + 1), curve, color=cmap(r / max(n_layers - 1, 1)),
                    lw=0.8, alpha=0.7)
    bottom.axvline(sel.n_keep + 0.5, color="black", ls="--", lw=1.2,
                   label=f"cut: {sel.n_keep} kept")
    bottom.set_xlim(0.5, e + 0.5)
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("rank within layer (1 = most salient)")
    bottom.set_ylabel("saliency / layer maximum")
    bottom.set_title("each layer's sorted saliency")
    bottom.legend(loc="upper right", fontsize="small")
    bar = fig.colorbar(ScalarMappable(Normalize(layers[0], max(layers[-1], layers[0] + 1)), cmap),
                       ax=bottom, label="MoE layer")
    bar.ax.yaxis.get_major_locator().set_params(integer=True)
    return fig


def matplotlib_colour(v: float):
    import matplotlib

    return matplotlib.colormaps[CMAP](v)[:3]


def saliency_report(stats: Mapping[int, LayerStats], sel: Selection, info: Mapping[str, Any]) -> dict:
    """The JSON report: run info, then per layer kept/dropped ids, scores and raw stats."""
    layers = []
    for l in sorted(sel.kept):
        st = stats[l]
        kept = sel.kept[l]
        kept_set = set(kept)
        layers.append({
            "layer": l,
            "kept": kept,
            "dropped": [j for j in range(st.num_experts) if j not in kept_set],
            "protected": sel.protected.get(l, []),
            "score": [float(x) for x in sel.scores[l]],
            **({"domain_score": {d: [float(x) for x in per.get(l, [])]
                                 for d, per in sel.domain_scores.items()}}
               if sel.domain_scores else {}),
            "reap": {g: st.reap(g).tolist() for g in GATES},
            "reap_sum": {g: st.reap_sum(g).tolist() for g in GATES},
            **{k: v for k, v in st.to_dict().items() if k != "layer"},
        })
    return {
        "method": sel.method,
        "gate": sel.gate if sel.method in GATED else None,
        "experts_kept_per_layer": sel.n_keep if sel.uniform else {str(l): n for l, n in sel.counts.items()},
        "budget": sel.budget,
        "balance": sel.balance,
        "seed": sel.seed,
        **dict(info),
        "super_experts": {str(l): ids for l, ids in sel.protected.items()},
        "layers": layers,
        "legend": {
            "score": "the ranking score of `method` (higher = kept; with a domain balance, "
                     "the combined score)",
            "domain_score": "per calibration domain: the score of `method` over that "
                            "domain's tokens alone, divided by its layer maximum",
            "gate": "router weight g_j of reap / reap-sum: softmax = softmax of the raw router "
                    "logits renormalised over the selected experts (REAP's reference); model = "
                    "the model's renormalised sigmoid gate",
            "reap": "per gate: mean over routed tokens of g_j(x) * ||f_j(x)||_2 (latent-space "
                    "expert output)",
            "reap_sum": "per gate: sum over routed tokens of g_j(x) * ||f_j(x)||_2",
            "count": "tokens routed to the expert",
            "gate_sum": "sum of the model's renormalised gate weights",
            "softmax_gate_sum": "sum of the softmax gate weights",
            "norm_sum": "sum of ||f_j(x)||_2 (EAN)",
            "gate_norm_sum": "sum of g_j(x) * ||f_j(x)||_2, model gate",
            "softmax_gate_norm_sum": "sum of g_j(x) * ||f_j(x)||_2, softmax gate",
            "max_abs": "max |f_j(x)| over elements and tokens",
        },
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def model_card(*, src: str, out_name: str, method: str, n_keep: int, num_experts: int,
               top_k: int, moe_layers: int, calib_desc: str, calib_files: List[str],
               bytes_in: int, bytes_out: int, protected: int, protect: bool, seed: int,
               notes: List[str], copied: Optional[List[str]] = None,
               extra: Optional[str] = None, gate: str = "softmax",
               quantized: Optional[List[str]] = None,
               per_layer: Optional[Dict[int, int]] = None) -> str:
    """README.md for the pruned checkpoint: what, on what data, how big, how to use.

    `quantized`: lines describing trunk / expert quantization (None: none was done).
    `per_layer`: {layer: experts kept} of a `spread` budget (None: n_keep in every layer).
    """
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    files = "\n".join(f"  - `{f}`" for f in calib_files[:20])
    if len(calib_files) > 20:
        files += f"\n  - ... ({len(calib_files) - 20} more)"
    gate_txt = {"softmax": "softmax of the router logits over the selected experts, as REAP's "
                           "reference code", "model": "the model's renormalised sigmoid gate"}
    method_txt = {
        "reap": "REAP (mean router-weighted expert activation norm, arXiv 2510.13999; "
                f"router weight: {gate_txt.get(gate, gate)})",
        "reap-sum": "REAP summed over tokens (router weight: "
                    f"{gate_txt.get(gate, gate)})",
        "frequency": "routing frequency", "ean": "expert activation norm (EAN)",
        "random": f"random (seed {seed}), a baseline",
    }[method]
    lines = [
        f"# {Path(out_name).name}",
        "",
        f"An expert-pruned build of `{src}` made by `kimi-mlx prune` on {when}.",
        "",
        "## What was pruned",
        "",
        (f"- Routed experts: **{n_keep} of {num_experts} kept in each of the {moe_layers} MoE "
         f"layers** ({100 * n_keep / num_experts:.1f}%), chosen by {method_txt}."
         if not per_layer else
         f"- Routed experts: **{sum(per_layer.values())} of {num_experts * moe_layers} kept**, "
         "shared out over the MoE layers by where saliency is spread (`--budget spread`): "
         + ", ".join(f"layer {l}: {n}" for l, n in sorted(per_layer.items()))
         + f"; chosen by {method_txt}. config.json records them in `num_experts_per_layer`."),
        f"- Experts per token unchanged: {min(top_k, n_keep)}. Shared experts, attention, "
        "embeddings and the head are "
        + ("quantized as below." if quantized else "untouched."),
        f"- Kept experts' MXFP4 weights are byte-for-byte the source's, renumbered "
        "0..n-1 in their original order; router rows and `e_score_correction_bias` are the "
        "kept experts' entries.",
        f"- Super-expert protection: "
        + (f"on ({protected} experts kept regardless of score)." if protect else "off."),
        *[f"- {n}" for n in notes],
        *(["", "## Quantization", "", *[f"- {q}" for q in quantized]] if quantized else []),
        "",
        "## Calibration data",
        "",
        f"- {calib_desc}",
        f"- Files:\n{files}",
        "",
        "## Size",
        "",
        f"- Tensors: {_gb(bytes_out)} (source {_gb(bytes_in)}, {100 * bytes_out / bytes_in:.1f}%).",
        "",
        "## Files",
        "",
        "- `saliency.json`: per layer, the kept / dropped / protected expert ids, the ranking "
        "score and the raw calibration statistics (tokens routed, gate and norm sums, peak "
        "activation).",
        "- `saliency.png`: top, MoE layers by expert id, coloured by saliency relative to "
        "the layer's most salient expert (dropped experts faded, never-routed white, "
        "protected super experts magenta); middle, each layer's sorted saliency with the cut; "
        "with calibration data from several domains, bottom, each domain's own saliency side "
        "by side (`domain_score` in saliency.json).",
        *([f"- Copied unchanged from the source: {', '.join(f'`{c}`' for c in copied)}. Any "
           "model card or evaluation among them describes the unpruned model."] if copied else []),
        "",
        "## Use",
        "",
        "```",
        f"kimi-mlx generate --model {out_name} --prompt \"...\"",
        f"python -c \"import mlx_lm; mlx_lm.load('{out_name}')\"",
        "```",
    ]
    if extra:
        lines += ["", extra.rstrip()]
    return "\n".join(lines) + "\n"


def write_report(dest: Path, stats: Mapping[int, LayerStats], sel: Selection,
                 info: Mapping[str, Any], card: str) -> None:
    """Write saliency.json, saliency.png and README.md into `dest`."""
    dest = Path(dest)
    (dest / "saliency.json").write_text(json.dumps(saliency_report(stats, sel, info), indent=1) + "\n")
    heat_map_figure(stats, sel).savefig(dest / "saliency.png")
    (dest / "README.md").write_text(card)
