"""Small MoE checkpoints and calibration files for the pruner's tests and demos."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, Optional

from kimi_mlx.testing.checkpoints import tiny_text_config


def moe_text_config(num_layers: int = 6, num_experts: int = 16, top_k: int = 2,
                    **overrides) -> Dict[str, Any]:
    """`tiny_text_config` with more experts and any number of layers.

    Layer 0 dense, every third layer (1-indexed 3, 6, ...) Gated DSA, the rest KDA.
    """
    full = [i for i in range(1, num_layers + 1) if i % 3 == 0]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    cfg = tiny_text_config(
        num_hidden_layers=num_layers, num_experts=num_experts, num_experts_per_token=top_k,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                            "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                            "full_attn_layers": full, "kda_layers": kda},
        dsa_config={"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8},
    )
    cfg.update(overrides)
    return cfg


def write_code_text(path, n: int = 200, seed: int = 0) -> Path:
    """A deterministic file of small Python functions (calibration text)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        op = rng.choice("+-*")
        lines.append(f"def f{i}(x, y={rng.randint(0, 99)}):\n    return x {op} y * {i}\n")
    path = Path(path)
    path.write_text("\n".join(lines))
    return path


def set_router_bias(model, expert: int, value: float, layers: Optional[list] = None) -> None:
    """Set `e_score_correction_bias[expert]` in the MoE layers of an unquantized model
    (e.g. -100 so the expert is never selected)."""
    import mlx.core as mx

    for layer in model.layers:
        if "block_sparse_moe" not in layer or (layers is not None and layer.idx not in layers):
            continue
        gate = layer.block_sparse_moe.gate
        bias = gate.e_score_correction_bias
        gate.e_score_correction_bias = mx.where(mx.arange(bias.shape[0]) == expert,
                                                mx.array(value, bias.dtype), bias)


def cluster_and_generate(model, workdir, stages: int = 2, prompt: str = "def f(x):",
                         max_tokens: int = 8):
    """Run the same greedy request through `kimi-mlx cluster launch` over `stages` loopback
    stage processes and through `kimi-mlx generate`; return both `CompletedProcess`es.

    The stages serve `model` (linked into `workdir/models`); the stats lines ("Prompt:",
    "Generation:", "Peak") differ between the two and are for the caller to drop.
    """
    import subprocess
    import sys

    from kimi_mlx.cluster.net.auth import init_secret
    from kimi_mlx.testing.cluster import start_stages

    workdir = Path(workdir)
    models = workdir / "models"
    models.mkdir()
    (models / Path(model).name).symlink_to(model)
    secret = init_secret(workdir / "cluster.key")
    procs = start_stages(stages, models, secret, workdir, prefix="stage")
    try:
        flags = ["--model", str(model), "--prompt", prompt, "--max-tokens", str(max_tokens),
                 "--temp", "0", "--ignore-chat-template"]
        nodes = ",".join(p.address for p in procs)
        cli = [sys.executable, "-m", "kimi_mlx.commands.main"]
        launch = subprocess.run(cli + ["cluster", "launch", "--nodes", nodes, "--secret-file",
                                       str(secret)] + flags, capture_output=True, text=True,
                                timeout=180)
        gen = subprocess.run(cli + ["generate"] + flags, capture_output=True, text=True,
                             timeout=180)
    finally:
        for p in procs:
            p.stop()
    return launch, gen


def reply_lines(stdout: str):
    """The printed reply of `generate` / `cluster launch`, without its stats lines."""
    return [l for l in stdout.splitlines() if not l.startswith(("Prompt:", "Generation:", "Peak"))]
