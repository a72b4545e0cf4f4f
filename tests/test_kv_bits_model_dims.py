"""`--kv-bits 8` on a model whose cache vectors no supported group divides is refused when
the format is set (at load), naming the config key, not by the first prefill.

Before, `Model.set_kv_quant` checked only the flag pair, so on such a model `kimi-mlx
generate --kv-bits 8` died in a traceback mid-prefill and `kimi-mlx server --kv-bits 8`
started and then answered every request with a 500. The reference for "cannot be
quantized" is MLX itself: `mx.quantize` refuses a 16-value vector at every group size
`--kv-group-size` offers.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kimi_mlx.commands.generate import main as generate_main
from kimi_mlx.model.cache import KV_GROUP_SIZES
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.model.model import Model
from kimi_mlx.testing.checkpoints import build_checkpoint, tiny_text_config


def _mlx_can_quantize(dim: int) -> bool:
    """Whether MLX quantizes a `dim`-value vector to 8 bits at some offered group size
    (the cache takes a whole vector shorter than the group as one group)."""
    for g in KV_GROUP_SIZES:
        try:
            mx.eval(mx.quantize(mx.ones((1, dim)), group_size=min(g, dim), bits=8))
            return True
        except ValueError:
            continue
    return False


def test_a_16_value_indexer_key_is_refused_when_the_format_is_set_naming_the_key():
    args = ModelArgs.from_dict(tiny_text_config())
    assert args.index_head_dim == 16 and not _mlx_can_quantize(16)
    model = Model(args)
    with pytest.raises(ValueError, match="index_head_dim is 16"):
        model.set_kv_quant(8, 128)
    assert model.kv_bits is None  # left in the model dtype, which still runs
    model.set_kv_quant(None)


@pytest.mark.parametrize("group", KV_GROUP_SIZES)
def test_dims_mlx_quantizes_are_accepted_at_every_group(group):
    cfg = tiny_text_config(kv_lora_rank=64)
    cfg["dsa_config"]["index_head_dim"] = 32  # micro's shapes
    args = ModelArgs.from_dict(cfg)
    assert (args.index_head_dim, args.kv_lora_rank) == (32, 64)
    assert _mlx_can_quantize(32) and _mlx_can_quantize(64)
    model = Model(args)
    model.set_kv_quant(8, group)
    assert (model.kv_bits, model.kv_group_size) == (8, group)


def test_generate_names_the_key_instead_of_a_traceback(tmp_path, capsys):
    ckpt = build_checkpoint(tmp_path / "tiny", seed=0, n_shards=1)
    rc = generate_main(["--model", str(ckpt), "--kv-bits", "8", "--ignore-chat-template",
                        "--prompt", "hi", "--max-tokens", "2", "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "index_head_dim is 16" in err and "Traceback" not in err
