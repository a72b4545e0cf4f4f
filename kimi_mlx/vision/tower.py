"""K3.1's image encoder in MLX: the MoonViT3d vision tower and the patchmergerv2 projector.

Forward for a request's images (K31_SPEC.md section 7; images only, t = 1), with
L = sum of h * w over the images, D = vt_hidden_size, H heads of hd = qkv_size / H:

1. patch embedding: each patch (3, p, p) channel-first -> `proj` [D, 3, p, p] applied as
   one matmul (a Conv2d with kernel = stride = p over a single patch is exactly that).
2. position embedding `pos_emb` [64, 64, D] ("divided_fixed"): as is for a 64 x 64
   grid, otherwise resized to (h, w) with align_corners=False interpolation, row-major.
   The mode is `vision_config.pos_emb_interpolation_mode`: bilinear when absent (the
   published config says bilinear; two ports, SGLang's and one llama.cpp variant, use
   bicubic, which is also implemented here: PyTorch's, a = -0.75, border-clamped taps).
   The resize is a separable linear map, out = R_h pos R_w^T.
3. 2D RoPE on q and k, shared by all blocks and heads: hd/4 frequencies
   f_j = theta^(-4j/hd); token (row y, column x) gets hd/2 angles interleaved
   [x f_0, y f_0, x f_1, y f_1, ...] (width first, as the released code does; its
   docstring says height first), rotating adjacent pairs (2i, 2i+1) in float32.
4. `vt_num_hidden_layers` pre-norm blocks: h += wo(attn(rope(q), rope(k), v)) with wqkv
   viewed as (L, 3, H, hd), scale hd^-1/2, non-causal and block-diagonal across images
   (each image attends only to itself: the projections run on all L tokens at once, the
   attention per image); then h += fc1(gelu_tanh(fc0(norm1(h)))). Norms are RMSNorm with
   eps 2^-7 (`config.TOWER_NORM_EPS`). A final RMSNorm.
5. sd2_tpool merge: per image (h, w, D) -> (h/2 * w/2, 4, D), sub-index 2 ki + kj
   (top-left, top-right, bottom-left, bottom-right).
6. projector: (N, 4D) -> proj.0 Linear -> GELU (erf) -> proj.2 Linear -> post_norm
   RMSNorm(text hidden, eps projector_ln_eps). No pre-norm.

Module paths equal the checkpoint's tensor names (`vision_tower.patch_embed.proj.weight`,
`vision_tower.encoder.blocks.N.wqkv.weight`, `mm_projector.proj.0.weight`, ...), and the
patch projection keeps the file's [D, 3, p, p] layout, so loading maps no names.
Math sources: Moonshot's released K3 `modeling_kimi_k3.py`; checked against mlx-vlm
0.7.10's `kimi_k3` (tests/test_vision.py).
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kimi_mlx.vision.config import TOWER_NORM_EPS, VisionArgs

__all__ = ["VisionModel", "VisionTower", "Projector", "interpolation_matrix", "rope_angles",
           "image_token_count"]

Grid = Tuple[int, int]  # (h, w) in patches
SCORE_BUDGET = 2**27  # attention scores per query block (512 MB in float32)


def image_token_count(grid: Grid, args: VisionArgs) -> int:
    """Tokens an image of `grid` (h, w patches) becomes: h * w / (kh * kw)."""
    return grid[0] * grid[1] // args.merge_size


# ------------------------------------------------------------------ position embedding


def _cubic(t: np.ndarray, a: float = -0.75) -> np.ndarray:
    # Keys' cubic convolution kernel as PyTorch's upsample_bicubic2d uses it.
    t = np.abs(t)
    return np.where(t <= 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                    np.where(t < 2, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0))


def interpolation_matrix(n_in: int, n_out: int, mode: str) -> np.ndarray:
    """R [n_out, n_in] (float64) with out = R @ x: 1-D resize with align_corners=False.

    bilinear: source s = (i + 0.5) n_in / n_out - 0.5 clamped below at 0, the two
    neighbours floor(s), floor(s) + 1 (clamped to n_in - 1), weights 1 - frac, frac.
    bicubic: the four taps floor(s) - 1 .. floor(s) + 2 (clamped to the border) with
    Keys' kernel, a = -0.75, s not clamped (PyTorch's upsample_bicubic2d).
    n_in == n_out gives the identity in both modes.
    """
    if n_in == n_out:
        return np.eye(n_in)
    R = np.zeros((n_out, n_in))
    scale = n_in / n_out
    for i in range(n_out):
        s = (i + 0.5) * scale - 0.5
        if mode == "bilinear":
            s = max(s, 0.0)
            i0 = min(int(math.floor(s)), n_in - 1)
            i1 = min(i0 + 1, n_in - 1)
            f = s - i0
            R[i, i0] += 1 - f
            R[i, i1] += f
        elif mode == "bicubic":
            i0 = int(math.floor(s))
            f = s - i0
            for k in range(-1, 3):
                R[i, min(max(i0 + k, 0), n_in - 1)] += _cubic(np.array(f - k))
        else:
            raise ValueError(f"pos_emb_interpolation_mode {mode!r}: expected bilinear or bicubic")
    return R


class PosEmb(nn.Module):
    """`patch_embed.pos_emb`: weight [H0, W0, D], resized per image to its grid."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.mode = args.pos_emb_interpolation_mode
        self.weight = mx.zeros((args.init_pos_emb_height, args.init_pos_emb_width, args.vt_hidden_size))

    def for_grid(self, h: int, w: int) -> mx.array:
        """[h * w, D] row-major position embeddings of an h x w grid."""
        H0, W0, D = self.weight.shape
        if (h, w) == (H0, W0):
            return self.weight.reshape(h * w, D)
        rh = mx.array(interpolation_matrix(H0, h, self.mode).astype(np.float32))
        rw = mx.array(interpolation_matrix(W0, w, self.mode).astype(np.float32))
        p = self.weight.astype(mx.float32)
        p = mx.einsum("hH,HWD->hWD", rh, p)
        p = mx.einsum("wW,hWD->hwD", rw, p)
        return p.reshape(h * w, D)


class PatchEmbed(nn.Module):
    """`patch_embed`: `proj` (weight [D, 3, p, p], the file's Conv2d layout) + `pos_emb`."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        p, D = args.patch_size, args.vt_hidden_size
        self.proj = nn.Module()
        self.proj.weight = mx.zeros((D, 3, p, p))
        if args.patch_embed_proj_bias:
            self.proj.bias = mx.zeros((D,))
        self.pos_emb = PosEmb(args)

    def __call__(self, patches: mx.array, grids: Sequence[Grid]) -> mx.array:
        """patches [L, 3, p, p] (channel-first, images concatenated) -> [L, D]."""
        w = self.proj.weight
        x = patches.reshape(patches.shape[0], -1).astype(w.dtype) @ w.reshape(w.shape[0], -1).T
        if "bias" in self.proj:
            x = x + self.proj.bias
        pos = mx.concatenate([self.pos_emb.for_grid(h, w_) for h, w_ in grids])
        return x + pos.astype(x.dtype)


# ------------------------------------------------------------------ 2D RoPE


def rope_angles(head_dim: int, h: int, w: int, theta: float = 10000.0) -> mx.array:
    """[h * w, head_dim / 2] float32 angles: token (y, x) row-major gets
    [x f_0, y f_0, x f_1, y f_1, ...] with f_j = theta^(-4j / head_dim)."""
    f = theta ** (-np.arange(0, head_dim, 4, dtype=np.float64)[: head_dim // 4] / head_dim)
    y, x = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
    ang = np.stack([x.reshape(-1, 1) * f, y.reshape(-1, 1) * f], axis=-1)  # [L, hd/4, 2]
    return mx.array(ang.reshape(h * w, head_dim // 2).astype(np.float32))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate adjacent pairs (2i, 2i+1) of x [L, H, hd] by angles (cos, sin [L, hd/2]),
    in float32; returns x's dtype."""
    L, H, hd = x.shape
    xf = x.astype(mx.float32).reshape(L, H, hd // 2, 2)
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = mx.stack([a * c - b * s, a * s + b * c], axis=-1)
    return out.reshape(L, H, hd).astype(x.dtype)


# ------------------------------------------------------------------ blocks


class MLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.fc0 = nn.Linear(args.vt_hidden_size, args.vt_intermediate_size, bias=args.linear_bias)
        self.fc1 = nn.Linear(args.vt_intermediate_size, args.vt_hidden_size, bias=args.linear_bias)

    def __call__(self, x):
        return self.fc1(nn.gelu_approx(self.fc0(x)))  # gelu_pytorch_tanh


class Block(nn.Module):
    """`encoder.blocks.N`: pre-norm attention (block-diagonal over images) + MLP."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        D = args.vt_hidden_size
        self.heads, self.head_dim = args.vt_num_attention_heads, args.head_dim
        self.norm0 = nn.RMSNorm(D, eps=TOWER_NORM_EPS)
        self.norm1 = nn.RMSNorm(D, eps=TOWER_NORM_EPS)
        self.wqkv = nn.Linear(D, 3 * args.qkv_size, bias=args.attn_bias)
        self.wo = nn.Linear(args.qkv_size, D, bias=args.attn_bias)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, spans: Sequence[Tuple[int, int]]):
        """x [L, D]; cos/sin [L, hd/2]; spans: (start, length) of each image in x."""
        L = x.shape[0]
        qkv = self.wqkv(self.norm0(x)).reshape(L, 3, self.heads, self.head_dim)
        q = apply_rope(qkv[:, 0], cos, sin)
        k = apply_rope(qkv[:, 1], cos, sin)
        v = qkv[:, 2]
        outs = []
        for start, n in spans:  # block-diagonal: an image attends to itself only
            sl = slice(start, start + n)
            qi, ki, vi = (t[sl].transpose(1, 0, 2)[None] for t in (q, k, v))
            # Queries in blocks so that a score matrix, where the backend materialises
            # one (the CPU), stays near SCORE_BUDGET elements: a 16641-token image has
            # 66564 patches, 12 x 66564^2 scores (212 GB in float32) if done at once.
            step = max(1, SCORE_BUDGET // (self.heads * n))
            o = mx.concatenate([
                mx.fast.scaled_dot_product_attention(qi[:, :, j:j + step], ki, vi,
                                                     scale=self.head_dim**-0.5)
                for j in range(0, n, step)], axis=2) if step < n else \
                mx.fast.scaled_dot_product_attention(qi, ki, vi, scale=self.head_dim**-0.5)
            outs.append(o[0].transpose(1, 0, 2).reshape(n, -1))
        x = x + self.wo(mx.concatenate(outs) if len(outs) > 1 else outs[0])
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.blocks = [Block(args) for _ in range(args.vt_num_hidden_layers)]
        self.final_layernorm = nn.RMSNorm(args.vt_hidden_size, eps=TOWER_NORM_EPS)


class VisionTower(nn.Module):
    """`vision_tower`: patches of a request's images -> merged features [N, kh*kw, D]."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.encoder = Encoder(args)

    def __call__(self, patches: mx.array, grids: Sequence[Grid]) -> mx.array:
        """patches [L, 3, p, p] float32 (`preprocess`, images concatenated in order),
        grids [(h, w)] per image with L = sum h * w -> [sum h*w / (kh*kw), kh*kw, D].

        Raises ValueError when L does not match the grids or a grid side is not a
        multiple of the merge kernel."""
        a = self.args
        kh, kw = a.merge_kernel_size
        total = sum(h * w for h, w in grids)
        if patches.ndim != 4 or patches.shape[0] != total or tuple(patches.shape[1:]) != (3, a.patch_size, a.patch_size):
            raise ValueError(f"vision tower: patches {tuple(patches.shape)} do not match grids "
                             f"{list(grids)} ({total} patches of (3, {a.patch_size}, {a.patch_size}))")
        for h, w in grids:
            if h % kh or w % kw:
                raise ValueError(f"vision tower: grid {h}x{w} is not a multiple of the merge "
                                 f"kernel {kh}x{kw}")
        x = self.patch_embed(patches, grids)
        angles = mx.concatenate([rope_angles(a.head_dim, h, w, a.rope_theta) for h, w in grids])
        cos, sin = mx.cos(angles), mx.sin(angles)
        spans, at = [], 0
        for h, w in grids:
            spans.append((at, h * w))
            at += h * w
        for block in self.encoder.blocks:
            x = block(x, cos, sin, spans)
        x = self.encoder.final_layernorm(x)
        merged = []
        for (start, n), (h, w) in zip(spans, grids):
            xi = x[start:start + n].reshape(h // kh, kh, w // kw, kw, -1)
            merged.append(xi.transpose(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1))
        return mx.concatenate(merged) if len(merged) > 1 else merged[0]


class Projector(nn.Module):
    """`mm_projector` (patchmergerv2): [N, kh*kw, D] -> [N, text hidden]."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        m = args.merged_size
        self.proj = [nn.Linear(m, m, bias=False), nn.GELU(), nn.Linear(m, args.text_hidden_size, bias=False)]
        self.post_norm = nn.RMSNorm(args.text_hidden_size, eps=args.projector_ln_eps)

    def __call__(self, x: mx.array) -> mx.array:
        h = x.reshape(x.shape[0], -1)
        for layer in self.proj:
            h = layer(h)
        return self.post_norm(h)


class VisionModel(nn.Module):
    """The tower and the projector under their checkpoint names (`vision_tower`,
    `mm_projector`). `VisionModel(args)(patches, grids)` -> [N tokens, text hidden], the
    rows that replace the `<|media_pad|>` embeddings, images in order."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.vision_tower = VisionTower(args)
        self.mm_projector = Projector(args)

    def __call__(self, patches: mx.array, grids: Sequence[Grid]) -> mx.array:
        return self.mm_projector(self.vision_tower(patches, grids))

    @property
    def dtype(self):
        return self.vision_tower.patch_embed.proj.weight.dtype


def vision_tensor_names(args: VisionArgs) -> List[str]:
    """Checkpoint names of every vision tensor a config implies (for error messages and
    the builders)."""
    from mlx.utils import tree_flatten

    return [k for k, _ in tree_flatten(VisionModel(args).parameters())]
