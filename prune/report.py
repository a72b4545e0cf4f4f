"""What a pruned checkpoint says about itself: saliency JSON, a PNG heat map, a README card.

The heat map is written by a small PNG encoder (zlib + struct), so the pruner needs no
plotting library. Rows are MoE layers (top = first), columns are expert ids (left = 0);
each cell is one expert:

* kept: blue, darker = more salient in its layer;
* dropped: grey to orange, more orange = more salient (the near misses);
* never routed during calibration: white;
* protected super expert: magenta.
"""

from __future__ import annotations

import datetime as _dt
import json
import struct
import zlib
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from .observe import LayerStats
from .observe import GATES
from .saliency import GATED, Selection

KEPT_LO, KEPT_HI = np.array([198, 219, 239]), np.array([8, 48, 107])
DROP_LO, DROP_HI = np.array([217, 217, 217]), np.array([241, 105, 19])
UNROUTED = np.array([255, 255, 255])
PROTECTED = np.array([206, 18, 186])


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode an RGB image uint8 [H, W, 3] as PNG (8-bit truecolor, no filter)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w, c = rgb.shape
    if c != 3 or not h or not w:
        raise ValueError(f"expected a non-empty [H, W, 3] image, got {rgb.shape}")
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def heat_map(stats: Mapping[int, LayerStats], sel: Selection) -> np.ndarray:
    """RGB uint8 [layers * ch, E * cw, 3] of kept / dropped experts by layer (see module)."""
    layers = sorted(sel.kept)
    e = max(stats[l].num_experts for l in layers)
    cw = max(1, min(16, 1024 // e))
    ch = max(2, min(16, 512 // len(layers)))
    cells = np.zeros((len(layers), e, 3), np.uint8)
    for r, l in enumerate(layers):
        s = np.asarray(sel.scores[l], np.float64)
        rank = np.argsort(np.argsort(s, kind="stable"), kind="stable") / max(len(s) - 1, 1)
        kept = np.zeros(len(s), bool)
        kept[sel.kept[l]] = True
        t = rank[:, None]
        row = np.where(kept[:, None], KEPT_LO + (KEPT_HI - KEPT_LO) * t,
                       DROP_LO + (DROP_HI - DROP_LO) * t)
        row[(stats[l].count == 0) & ~kept] = UNROUTED
        row[sel.protected.get(l, [])] = PROTECTED
        cells[r, : len(s)] = row.round().astype(np.uint8)
    return np.repeat(np.repeat(cells, ch, axis=0), cw, axis=1)


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
            "reap": {g: st.reap(g).tolist() for g in GATES},
            "reap_sum": {g: st.reap_sum(g).tolist() for g in GATES},
            **{k: v for k, v in st.to_dict().items() if k != "layer"},
        })
    return {
        "method": sel.method,
        "gate": sel.gate if sel.method in GATED else None,
        "experts_kept_per_layer": sel.n_keep,
        "seed": sel.seed,
        **dict(info),
        "super_experts": {str(l): ids for l, ids in sel.protected.items()},
        "layers": layers,
        "legend": {
            "score": "the ranking score of `method` (higher = kept)",
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
               quantized: Optional[List[str]] = None) -> str:
    """README.md for the pruned checkpoint: what, on what data, how big, how to use.

    `quantized`: lines describing trunk / expert quantization (None: none was done).
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
        f"- Routed experts: **{n_keep} of {num_experts} kept in each of the {moe_layers} MoE "
        f"layers** ({100 * n_keep / num_experts:.1f}%), chosen by {method_txt}.",
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
        "- `saliency.png`: rows = MoE layers (top = first), columns = experts; blue = kept "
        "(darker = more salient), grey-to-orange = dropped (more orange = more salient), "
        "white = never routed during calibration, magenta = protected super expert.",
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
    (dest / "saliency.png").write_bytes(png_bytes(heat_map(stats, sel)))
    (dest / "README.md").write_text(card)
