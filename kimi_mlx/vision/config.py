"""K3.1 vision settings: `vision_config` (the MoonViT3d tower and the patchmergerv2
projector) and the image processor's `media_proc_cfg`, under the release's own key names
(K31_SPEC.md sections 1 and 7).

Values the tower cannot run are refused by key (`VisionConfigError`), never ignored:
another model_type, merge or projector type, a video-only position embedding, an
interpolation mode other than bilinear / bicubic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

# RMSNorm eps of the tower's norms: the release computes in bf16 with
# eps = torch.finfo(dtype).eps = 2^-7 (mlx-vlm uses the same constant; one llama.cpp
# port uses 1e-5). The projector's post_norm has its own key (`projector_ln_eps`).
TOWER_NORM_EPS = 2.0**-7

INTERPOLATION_MODES = ("bilinear", "bicubic")


class VisionConfigError(ValueError):
    """A vision_config / preprocessor setting we cannot run; the message names the key."""


@dataclass
class VisionArgs:
    """Tower and projector hyper-parameters (`vision_config` keys; defaults = K3.1)."""

    model_type: str = "moonvit3d"
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    qkv_hidden_size: Optional[int] = 1536
    activation_func: str = "gelu_pytorch_tanh"
    norm_type: str = "rmsnorm"
    mlp_type: str = "mlp2"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    merge_kernel_size: Tuple[int, int] = (2, 2)
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    rope_theta: float = 10000.0

    @property
    def qkv_size(self) -> int:
        return self.qkv_hidden_size or self.vt_hidden_size

    @property
    def head_dim(self) -> int:
        return self.qkv_size // self.vt_num_attention_heads

    @property
    def merge_size(self) -> int:
        kh, kw = self.merge_kernel_size
        return kh * kw

    @property
    def merged_size(self) -> int:
        """Width of one merged token into the projector: mm_hidden_size * kh * kw."""
        return self.mm_hidden_size * self.merge_size

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "config.json") -> "VisionArgs":
        """From a full config.json dict (its `vision_config`; `text_hidden_size` falls back
        to `text_config.hidden_size`).

        Raises:
            VisionConfigError: no vision_config, or a value this tower cannot run (names
                `where` and the key).
        """
        vc = config.get("vision_config")
        if not isinstance(vc, Mapping):
            raise VisionConfigError(f"{where}: no vision_config (this checkpoint has no vision tower)")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in vc.items() if k in known}
        text = config.get("text_config", config)
        if "text_hidden_size" not in kw and "hidden_size" in text:
            kw["text_hidden_size"] = text["hidden_size"]
        if "merge_kernel_size" in kw:
            m = kw["merge_kernel_size"]
            kw["merge_kernel_size"] = (m, m) if isinstance(m, int) else tuple(m)
        if kw.get("pos_emb_interpolation_mode") is None:
            kw.pop("pos_emb_interpolation_mode", None)  # absent -> bilinear
        args = cls(**kw)
        args.check(where)
        return args

    def check(self, where: str = "config.json") -> None:
        """VisionConfigError naming the first vision_config key we cannot run."""
        def bad(key, expected):
            raise VisionConfigError(
                f"{where}: vision_config.{key} = {getattr(self, key)!r}, expected {expected}")

        # model_type is not checked: the published K3 config.json leaves it out (its
        # transformers dump says ""), mlx-vlm names it moonvit3d; the keys below decide.
        if self.norm_type != "rmsnorm":
            bad("norm_type", "'rmsnorm'")
        if self.mlp_type != "mlp2":
            bad("mlp_type", "'mlp2'")
        if self.pos_emb_interpolation_mode not in INTERPOLATION_MODES:
            bad("pos_emb_interpolation_mode", " or ".join(map(repr, INTERPOLATION_MODES)))
        if self.pos_emb_type != "divided_fixed":
            bad("pos_emb_type", "'divided_fixed'")
        if self.merge_type != "sd2_tpool":
            bad("merge_type", "'sd2_tpool'")
        if self.mm_projector_type != "patchmergerv2":
            bad("mm_projector_type", "'patchmergerv2'")
        if self.activation_func not in ("gelu_pytorch_tanh", "gelu_tanh"):
            bad("activation_func", "'gelu_pytorch_tanh'")
        if self.projector_hidden_act != "gelu":
            bad("projector_hidden_act", "'gelu'")
        if self.qkv_size % self.vt_num_attention_heads or self.head_dim % 4:
            bad("qkv_hidden_size", f"a multiple of 4 * vt_num_attention_heads "
                                   f"({4 * self.vt_num_attention_heads}) for the 2D RoPE")
        if self.mm_hidden_size != self.vt_hidden_size:
            bad("mm_hidden_size", f"vt_hidden_size ({self.vt_hidden_size})")
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) < 1:
            bad("merge_kernel_size", "two positive ints")


@dataclass
class MediaProcArgs:
    """The image processor's `media_proc_cfg` (preprocessor_config.json; defaults = K3.1).

    `transparent_bg_config` / `transparent_bg_fill_stage`: images with alpha are
    composited onto this background after the resize (K31_SPEC.md section 7).
    """

    patch_size: int = 14
    merge_kernel_size: Tuple[int, int] = (2, 2)
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: Tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: Tuple[float, float, float] = (0.5, 0.5, 0.5)
    transparent_bg_config: dict = field(default_factory=lambda: {
        "pattern": "chessboard", "chessboard_square_size": 8,
        "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
        "chessboard_gray_value": 180})
    transparent_bg_fill_stage: str = "after_resize"

    @classmethod
    def from_dir(cls, model_dir) -> "MediaProcArgs":
        """`media_proc_cfg` of `<model_dir>/preprocessor_config.json`, the defaults where
        the file or a key is absent. VisionConfigError for a file that is not JSON."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise VisionConfigError(f"{path}: not readable JSON ({e})") from None
        cfg = data.get("media_proc_cfg", data) if isinstance(data, dict) else {}
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in cfg.items() if k in known}
        if "merge_kernel_size" in kw:
            m = kw["merge_kernel_size"]
            kw["merge_kernel_size"] = (m, m) if isinstance(m, int) else tuple(m)
        for k in ("image_mean", "image_std"):
            if k in kw:
                kw[k] = tuple(float(v) for v in kw[k])
        return cls(**kw)

    @property
    def factor(self) -> int:
        """Side multiple of a processed image: patch_size * merge kernel (28)."""
        return self.patch_size * self.merge_kernel_size[0]
