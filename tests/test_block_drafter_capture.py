"""The hidden states a block drafter reads are those its config names: what the
speculative loop (`speculative.block_loop.block_generate_step`) hands the drafter for the
prompt (`BlockDrafter.add_context`) equals, layer by layer, the outputs of the layers
`target_layer_ids` names in an independent forward pass: mlx-lm's own `kimi_k3` model
loaded from micro's files, each decoder layer's output recorded as mlx-lm's forward
runs. Checked for the shipped micro-dspark drafter (all six layers) and a drafter of
layers [1, 4], where a capture shifted by one layer (another layer's output, a layer's
input) would still run: the matching layer is within the float tolerance, the layer
beside it far outside."""

import copy
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.generation.request import default_model
from kimi_mlx.speculative.block_drafter import BlockDrafter, load_block_drafter, read_block_config
from kimi_mlx.speculative.block_loop import BlockDraft, block_generate_step
from kimi_mlx.testing.checkpoints import model_tolerance, rel_err

MICRO = Path(default_model())
SHIPPED = MICRO.parent / "micro-dspark"
PROMPT = [(11 * i + 5) % 240 + 12 for i in range(41)]  # < micro's index_topk (64): dense


@pytest.fixture(scope="module")
def micro():
    return load_model(MICRO, verbose=False)[0]


class _Recording:
    """An mlx-lm decoder layer that records what it returns."""

    def __init__(self, layer, outputs):
        self.layer, self.outputs = layer, outputs
        self.is_linear = layer.is_linear

    def __call__(self, x, mask=None, cache=None, blocks=None):
        h, blocks = self.layer(x, mask=mask, cache=cache, blocks=blocks)
        self.outputs.append(h)
        return h, blocks


@pytest.fixture(scope="module")
def layer_outputs():
    """Every decoder layer's output [1, L, d] on PROMPT[:-1] (the positions the loop's
    prefill hands the drafter), from mlx-lm's kimi_k3 forward on micro's files."""
    from mlx_lm.models import kimi_k3

    config = json.loads((MICRO / "config.json").read_text())
    files = {}
    for f in sorted(MICRO.glob("*.safetensors")):
        files.update(mx.load(str(f)))
    kcfg = copy.deepcopy(config)
    kcfg["model_type"] = "kimi_k3"
    ref = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(kcfg))
    text = ref.sanitize({k: v for k, v in files.items()
                         if k.startswith("language_model.") and ".indexer." not in k})
    nn.quantize(ref, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: f"{p}.scales" in text)
    ref.load_weights(list(text.items()), strict=True)
    # float32 arithmetic, as ours runs micro (bfloat16 weights widen exactly): so that
    # both sides round alike and the layer outputs agree within `model_tolerance`
    ref.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype == mx.bfloat16 else p,
                        ref.parameters()))
    inner = ref.language_model.model
    outputs = []
    inner.layers = [_Recording(layer, outputs) for layer in inner.layers]
    mx.eval(ref(mx.array(PROMPT[:-1])[None]))
    assert len(outputs) == len(inner.layers)
    return outputs


def drafter_of_layers(ids, tmp_path, micro):
    """A drafter folder like the shipped one but reading layers `ids` (random weights)."""
    config = json.loads((SHIPPED / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = list(ids)
    mx.random.seed(0)
    d = BlockDrafter(read_block_config(config))
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {f"model.{k}": v for k, v in tree_flatten(d.parameters())})
    return tmp_path


def captured_context(micro, drafter, monkeypatch):
    """What the loop hands the drafter for the prompt: the first `add_context` call's
    hiddens [1, L - 1, n * d]."""
    seen = []
    add = type(drafter).add_context

    def recording(self, hidden, cache):
        seen.append(hidden)
        return add(self, hidden, cache)

    monkeypatch.setattr(type(drafter), "add_context", recording)
    for _ in zip(range(2), block_generate_step(PROMPT, micro, BlockDraft(drafter),
                                               num_draft_tokens=2, max_tokens=2)):
        pass
    return seen[0]


@pytest.mark.parametrize("which", ["shipped", "layers 1 and 4"])
def test_captured_hidden_states_are_the_configured_layers_outputs(
        which, micro, layer_outputs, tmp_path, monkeypatch):
    folder = SHIPPED if which == "shipped" else drafter_of_layers([1, 4], tmp_path / "d", micro)
    ids = json.loads((folder / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    drafter = load_block_drafter(folder, target=micro)
    got = captured_context(micro, drafter, monkeypatch)
    d = micro.args.hidden_size
    assert got.shape == (1, len(PROMPT) - 1, len(ids) * d)
    tol = model_tolerance(micro.args, len(PROMPT))
    n = len(layer_outputs)
    for j, layer in enumerate(ids):
        part = got[..., j * d:(j + 1) * d]
        err = rel_err(part, layer_outputs[layer])
        assert err <= tol, (which, layer, err, tol)
        for other in (layer - 1, layer + 1):  # a shift by one is seen
            if 0 <= other < n:
                assert rel_err(part, layer_outputs[other]) > 100 * tol, (which, layer, other)
        if layer == 0:  # ... and so is the layer's input (the embedding)
            emb = micro.language_model.model.embed_tokens(mx.array(PROMPT[:-1])[None])
            assert rel_err(part, emb) > 100 * tol
