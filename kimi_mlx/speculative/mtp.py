"""A checkpoint's own multi-token-prediction (MTP) layers as a speculative draft (`--draft mtp`).

DeepSeek-V3-style MTP (DeepSeek-V3 technical report, section 2.2; vLLM
`model_executor/models/deepseek_mtp.py`, which K31_SPEC.md source S7's
`kimi_k3/.../mtp.py` follows): a checkpoint whose text config sets
`num_nextn_predict_layers` = D > 0 ships layers N..N+D-1 (N = `num_hidden_layers`) under
the official names `language_model.model.layers.{N+i}.*`:

| tensor (under `layers.{N+i}.`)                     | shape            | role                          |
|----------------------------------------------------|------------------|-------------------------------|
| `enorm.weight` / `hnorm.weight`                    | [d]              | RMSNorm of embedding / hidden |
| `eh_proj.weight`                                   | [d, 2d]          | reads concat(enorm(e), hnorm(h)) |
| `input_layernorm`, `self_attn.*`, `post_attention_layernorm`, `block_sparse_moe.*` (MXFP4 experts) or `mlp.*` | as a trunk layer | one decoder layer |
| `shared_head.norm.weight`                          | [d]              | the MTP's own final norm      |
| `shared_head.head.weight`, `embed_tokens.weight` (optional) | [V, d]  | copies of lm_head / embedding; the trunk's are used when absent |

Forward of depth 1 at position i (predicts token i + 2):

    x   = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])     # embedding first: vLLM's order
    y   = x + attn(input_layernorm(x));  y = y + ffn(post_attention_layernorm(y))
    out = head(shared_head.norm(y))

Conventions (the record for K3.1 is silent; each is one place to change):
- h_i is the target's hidden state after its final norm, the vector its lm_head reads
  (`finish`: output AttnRes mix + `norm`): vLLM's and SGLang's DeepSeek models hand the
  MTP their model output, which is post-norm.
- The decoder layer is built by our `DecoderLayer` at index N+i, so its attention kind
  follows the config's layer lists (a full-attention Gated DSA layer when N+i is in no
  list, as DeepSeek's MTP block is full attention) and its FFN follows `is_moe`; it is a
  plain pre-norm residual block (DeepSeek's `mtp_block`), without AttnRes: a lone layer
  has no banked blocks to mix. AttnRes tensors in an MTP layer are refused by name.
- Chained drafts (k > 1) reuse depth 1 on its own output: draft j + 1 reads the MTP's
  output hidden y (before `shared_head.norm`) and draft j, as vLLM's MTP proposer does.
  Deeper MTP layers (D > 1) load with `depths` but only depth 1 drafts: a depth-d layer
  would need the depth-(d-1) hiddens of every accepted position kept up to date.
- vLLM zeroes the embedding at MTP position 0; we do not: that position pairs h_0 with
  t_1 like any other in the DeepSeek-V3 report's MTP objective (and position 0 of a K3.1
  chat prompt is a fixed special token either way).

Speculative loop (`mtp_generate_step`, mlx-lm's (token, logprobs, from_draft) triples):
the target's verify pass over [y, d1..dk] returns its hidden states with its logits; the
acceptance rule is `kimi_mlx.speculative.loop`'s (greedy: longest prefix equal to the target's
argmax; sampling: `accept_drafts`, Leviathan et al. 2023); the target's caches are put back
with `kimi_mlx.speculative.rollback`. The MTP's cache keeps only pairs (h_j, t_{j+1}) made of target
hiddens and emitted tokens: it is restored to its state after the step's first MTP call
(which fed the last step's accepted pairs), and the pairs of the tokens accepted in this
step are fed at the next step's first call.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from kimi_mlx.model.attn_res import Banks
from kimi_mlx.model.cache import DSACache
from kimi_mlx.model.config import ModelArgs, read_config, text_config
from kimi_mlx.model.model import DecoderLayer
from kimi_mlx.speculative.rollback import begin_verify, end_verify, restore, rollback, snapshot
from kimi_mlx.speculative.auto_k import draft_policy
from kimi_mlx.checkpoint.shards import CheckpointError, weight_map
from kimi_mlx.sampling import DEFAULT_MAX_TOKENS
from kimi_mlx.speculative.loop import OwnLoop, Sampling, SpecStats, draw_draft, emit_accepted, judge_verify
from kimi_mlx.model.tensor_map import PREFIX, canonical, layer_of

__all__ = ["CONFIG_KEY", "MTP", "MTPLayer", "load_mtp", "mtp_generate_step", "target_forward"]

CONFIG_KEY = "num_nextn_predict_layers"
OWN_HEAD, OWN_EMBED = "shared_head.head.weight", "embed_tokens.weight"


class SharedHead(nn.Module):
    """`shared_head`: the MTP's final RMSNorm, and its own lm_head copy when it has one."""

    def __init__(self, args: ModelArgs, own_head: bool):
        super().__init__()
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if own_head:
            self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """One MTP depth: a `DecoderLayer` (no AttnRes) plus enorm, hnorm, eh_proj, shared_head.

    Call: (hidden [B, L, d], tokens [B, L] int, cache, embed, head) -> (y [B, L, d] before
    `shared_head.norm`, logits [B, L, vocab]); embed / head are the trunk's (or this
    layer's own copies).
    """

    def __init__(self, args: ModelArgs, idx: int, own_head: bool = False, own_embed: bool = False):
        super().__init__(replace(args, attn_res_block_size=None), idx)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(args, own_head)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, d)

    def forward(self, hidden: mx.array, tokens: mx.array, cache, embed, head):
        if "embed_tokens" in self:
            embed = self.embed_tokens
        if "head" in self.shared_head:
            head = self.shared_head.head
        e = embed(tokens).astype(hidden.dtype)
        x = self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(hidden)], axis=-1))
        y, _ = DecoderLayer.__call__(self, x, None, cache)
        return y, head(self.shared_head.norm(y))

    def make_cache(self):
        return ArraysCache(size=2) if self.is_kda else DSACache()


class _Trunk:
    """The target's embedding and output head, held outside the parameter tree (a plain
    object, so `MTP.parameters()` lists the MTP's own tensors only)."""

    def __init__(self, embed, head):
        self.embed, self.head = embed, head


class _Layers(nn.Module):
    def __init__(self, n: int, layers: List[MTPLayer]):
        super().__init__()
        self.layers = [None] * n + layers  # `layers.N+i` keeps the checkpoint's index


class _Language(nn.Module):
    def __init__(self, n: int, layers: List[MTPLayer]):
        super().__init__()
        self.model = _Layers(n, layers)


class MTP(nn.Module, OwnLoop):
    """The MTP layers of a checkpoint, as a draft for `kimi_mlx.speculative.loop`'s front ends.

    Module paths equal the checkpoint names (`language_model.model.layers.{N+i}...`).
    `bind(target)` gives it the target's embedding and head; `make_cache()` is
    [depth-1 layer cache, pending-hidden cache] (see `mtp_generate_step`);
    `generate_step` is the loop `generation.streaming.stream_speculative` runs for this draft.
    """

    prefills_itself = True  # the prompt's pairs need the target's hiddens (OwnLoop)

    def __init__(self, args: ModelArgs, depths: int, own: Sequence[Tuple[bool, bool]] = ()):
        super().__init__()
        n = args.num_hidden_layers
        own = list(own) or [(False, False)] * depths
        self.args = args
        self.language_model = _Language(
            n, [MTPLayer(args, n + i, *own[i]) for i in range(depths)])
        self._trunk = None

    @property
    def mtp_layers(self) -> List[MTPLayer]:
        return self.language_model.model.layers[self.args.num_hidden_layers:]

    def bind(self, target) -> "MTP":
        """Use `target`'s (our `Model`, last stage) embedding and lm_head; returns self."""
        lm = target.language_model
        embed = lm.model.embed_tokens
        self._trunk = _Trunk(embed, lm.logits)
        return self

    def make_cache(self) -> List[Any]:
        """[depth-1 layer cache (DSACache, or ArraysCache for a KDA layer), ArraysCache(2)
        holding the pending target hiddens [1, m, d] and their m - 1 known next tokens]."""
        return [self.mtp_layers[0].make_cache(), ArraysCache(size=2)]

    def step(self, hidden: mx.array, tokens: mx.array, cache) -> Tuple[mx.array, mx.array]:
        """Depth 1 over pairs (hidden [1, L, d], tokens [1, L]): (y [1, L, d], logits
        [1, L, vocab]); row i predicts the token two after the one `hidden[i]` is of.

        Raises RuntimeError before `bind`."""
        if self._trunk is None:
            raise RuntimeError("MTP.step before MTP.bind(target)")
        return self.mtp_layers[0].forward(hidden, tokens, cache, self._trunk.embed,
                                          self._trunk.head)

    @staticmethod
    def generate_step(prompt, model, draft_model, **kwargs):
        return mtp_generate_step(prompt, model, draft_model, **kwargs)


# ------------------------------------------------------------------------------ loading


def mtp_depth(config: dict, source: str = "config.json") -> int:
    """`num_nextn_predict_layers` of a config (0 when absent)."""
    return int(text_config(config, source).get(CONFIG_KEY) or 0)


def load_mtp(path, target=None, depths: Optional[int] = None, lazy: bool = False) -> MTP:
    """Load MTP layers N..N+depths-1 of a checkpoint folder (default: all D of them).

    Tensors go through the trunk's mapping (`tensor_map.sanitize_weights`: MXFP4 experts
    stacked bit for bit into `mxfp4` switch layers, A_log trimmed) and are checked like a
    trunk load (every parameter present with its shape and dtype class, nothing extra).

    Args:
        path: checkpoint folder.
        target: our `Model` of the same checkpoint (last stage) to `bind` to, or None.
        depths: how many MTP layers to load (1..D); default D.
        lazy: leave tensors unevaluated.
    Returns:
        the `MTP` module.
    Raises:
        CheckpointError: the config has no MTP layers (names the checkpoint and
            `num_nextn_predict_layers`), depths outside 1..D, or a missing, extra or
            misshapen MTP tensor (named, with its shard).
    """
    from kimi_mlx.checkpoint.loader import fill_module, read_tensors

    model_dir = Path(path)
    config = read_config(model_dir)
    cfg_path = model_dir / "config.json"
    args = ModelArgs.from_config(config, str(cfg_path))
    D = mtp_depth(config, str(cfg_path))
    if D <= 0:
        raise CheckpointError(
            f"{model_dir}: checkpoint has no MTP layers ({cfg_path}: text config key "
            f"{CONFIG_KEY} is {D if CONFIG_KEY in text_config(config) else 'absent'}, "
            "needs to be > 0); use --draft-model for a separate draft")
    depths = D if depths is None else depths
    if not 1 <= depths <= D:
        raise CheckpointError(f"{model_dir}: depths {depths} outside 1..{D} ({CONFIG_KEY})")
    n = args.num_hidden_layers
    wm = weight_map(model_dir)
    wanted = {name: shard for name, shard in wm.items()
              if n <= (layer_of(name) if layer_of(name) is not None else -1) < n + depths}
    if not wanted:
        raise CheckpointError(
            f"{model_dir}: {CONFIG_KEY} is {D} but the index lists no tensor "
            f"{PREFIX}model.layers.{n}.*")
    own = [(f"{PREFIX}model.layers.{n + i}.{OWN_HEAD}" in map(canonical, wanted),
            f"{PREFIX}model.layers.{n + i}.{OWN_EMBED}" in map(canonical, wanted))
           for i in range(depths)]
    weights, where = read_tensors(model_dir, wanted)
    # Seen as a model of N + depths layers, the MTP layers are ordinary layers [N, N+depths).
    ext = replace(args, num_hidden_layers=n + depths)
    mtp = fill_module(MTP(args, depths, own), weights, ext, n, n + depths, where, model_dir)
    if not lazy:
        mx.eval(mtp.parameters())
    if target is not None:
        mtp.bind(target)
    return mtp


# ------------------------------------------------------------------------------- target


def target_forward(model, tokens: mx.array, cache) -> Tuple[mx.array, mx.array]:
    """Our `Model` (whole, one process) on tokens [B, L]: (hidden [B, L, d] after the final
    norm, the vector the lm_head reads; logits [B, L, vocab]), the same ops as
    `Model.__call__`."""
    text = model.text
    h, banks = text.run_layers(text.embed(tokens), Banks(model.args.rms_norm_eps), cache)
    h = text.finish(h, banks)
    return h, model.language_model.logits(h)


# --------------------------------------------------------------------------------- loop


class _Pending:
    """Pairs (target hidden h_j, next token t_{j+1}) not yet fed to the MTP: hidden
    [1, m, d] (or None) and m tokens; the last token is the one the target has not seen."""

    def __init__(self, hidden: Optional[mx.array], tokens: List[int]):
        self.hidden, self.tokens = hidden, tokens

    def add(self, hidden: mx.array, tokens: List[int]) -> None:
        self.hidden = hidden if self.hidden is None else mx.concatenate([self.hidden, hidden], 1)
        self.tokens = self.tokens + tokens

    def __len__(self) -> int:
        return len(self.tokens)


def _feed(mtp: MTP, cache, pend: _Pending, keep: int, step: int) -> None:
    """Feed all but the last `keep` pending pairs to the MTP's cache, `step` at a time."""
    m = len(pend) - keep
    for s in range(0, m, step):
        e = min(s + step, m)
        y, _ = mtp.step(pend.hidden[:, s:e], mx.array(pend.tokens[s:e])[None], cache)
        mx.eval(y, [c.state for c in [cache]])
    if m > 0:
        pend.hidden, pend.tokens = pend.hidden[:, m:], pend.tokens[m:]


class _Step:
    """One verify step's record, enough to settle it: the target's verify handle, the MTP
    cache before / after the step's first call, the verify hiddens [1, k+1, d], the
    tokens emitted so far, and the pending pairs as they were before the first call."""

    def __init__(self, verify, before, after, hidden: mx.array, fed):
        self.verify, self.before, self.after, self.hidden, self.fed = verify, before, after, hidden, fed
        self.emitted: List[int] = []


def _prefill(model, mtp: MTP, prompt: List[int], tcache, mcache, pend: _Pending, step: int) -> None:
    """Run all prompt tokens but the last through the target, `step` at a time; each
    chunk's hiddens become pending pairs with the prompt's next tokens, and all but the
    last pair are fed to the MTP."""
    body = prompt[:-1]
    for s in range(0, len(body), step):
        chunk = body[s : s + step]
        h, _ = target_forward(model, mx.array(chunk)[None], tcache)
        pend.add(h, prompt[s + 1 : s + 1 + len(chunk)])
        _feed(mtp, mcache, pend, 1, step)
        mx.eval(pend.hidden, [c.state for c in tcache])


def _draft(mtp: MTP, mcache, pend: _Pending, k: int, sampling: Sampling, step: int):
    """Draw k drafts from the MTP: the first call feeds every pending pair (the last
    step's accepted tokens) and drafts from the last; drafts 2..k chain on the MTP's own
    output. Returns (drafts [k] uint32, their draft logprobs q, cache snapshot before the
    first call, snapshot after it). k = 0 draws nothing and snapshots nothing."""
    if not k:
        return mx.array([], mx.uint32), [], None, None
    q_lps: List[mx.array] = []
    drafts: List[mx.array] = []
    before = snapshot([mcache])
    _feed(mtp, mcache, pend, min(len(pend), step), step)  # long runs first, `step` at a time
    g, logits = mtp.step(pend.hidden, mx.array(pend.tokens)[None], mcache)
    pend.hidden, pend.tokens = None, []
    after = snapshot([mcache])
    for i in range(k):
        d = draw_draft(logits[0, -1], sampling, q_lps)
        drafts.append(d)
        if i + 1 < k:
            g, logits = mtp.step(g[:, -1:], d.reshape(1, 1), mcache)
    return mx.stack(drafts).astype(mx.uint32), q_lps, before, after


def _settle(st: _Step, tcache, mcache, pend: _Pending) -> Optional[int]:
    """Put the caches where m = len(st.emitted) emitted tokens leave them: the target
    keeps y and the first m - 1 emitted tokens; the MTP the pairs its first call fed;
    pending: the m hiddens of those tokens with the m emitted ones as their next tokens.
    Returns the new y (the last emitted token), or None when nothing was emitted (then
    the pairs the first call fed are pending again)."""
    m = len(st.emitted)
    rollback(tcache, st.verify, m)
    end_verify(tcache)
    if m == 0:
        if st.before is not None:
            restore([mcache], st.before)
            pend.hidden, pend.tokens = st.fed
        return None
    if st.after is not None:
        restore([mcache], st.after)
    pend.add(st.hidden[:, :m], st.emitted[:m])
    return st.emitted[m - 1]


def _save_pending(pcache, pend: _Pending) -> None:
    """Leave in the pending cache what a next call needs: the pending hiddens and their
    known next tokens (the last one, y, is the token the target has not seen: the next
    prompt replaces it)."""
    if pend.hidden is not None and len(pend):
        pcache.cache = [pend.hidden, mx.array(pend.tokens[:-1], mx.int32)]
    else:
        pcache.cache = [None, None]


def mtp_generate_step(
    prompt,
    model,
    mtp: MTP,
    *,
    num_draft_tokens: int = 1,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling: Optional[Sampling] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 512,
    stats: Optional[SpecStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Speculative decoding with the MTP as draft; yields (token, logprobs [V], from_draft)
    like `speculative.loop.speculative_generate_step` (same arguments, same acceptance rule).

    Each step: draft k tokens (`_draft`), verify [y, d1..dk] in one target pass
    (`target_forward`, `judge_verify`), emit the accepted tokens and the target's own,
    then settle the caches to what was emitted (`_settle`).

    Args:
        prompt: token ids (list or 1-D mx.array), at least one.
        model: our `Model` (one process); mtp: its bound `MTP`.
        num_draft_tokens: k, drafts per verify step (>= 1): draft 1 from the target's last
            hidden, drafts 2..k chained on the MTP's own output; or "auto" / an `AutoK`
            (`kimi_mlx.speculative.auto_k`).
        prompt_cache: the target's caches followed by `mtp.make_cache()`, used and updated
            in place (new ones when None). When generation ends (or the generator is
            closed), the target holds every token but the last one yielded (as
            `speculative_generate_step` leaves it), the MTP's layer cache the pairs up to
            the last verify step, and its pending cache the target hiddens of that step's
            tokens with their known next tokens: a next call on the same caches (a chat's
            next turn) pairs the last hidden with its prompt's first token.
        Others: see `speculative.loop.speculative_generate_step`.
    Raises:
        ValueError: an empty prompt, num_draft_tokens < 1, or an MTP not bound.
    """
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty")
    policy = draft_policy(num_draft_tokens)
    if mtp._trunk is None:
        raise ValueError("the MTP draft is not bound to a target (MTP.bind)")
    sampling = sampling or Sampling()
    stats = stats if stats is not None else SpecStats()
    if prompt_cache is None:
        prompt_cache = model.make_cache() + mtp.make_cache()
    n_layers = len(model.layers)
    tcache = prompt_cache[:n_layers]
    mcache, pcache = prompt_cache[n_layers:]
    step_size = max(1, prefill_step_size)

    # Pending pairs: from the last call (hiddens and their known next tokens), then the
    # prompt: token j of the prompt follows the hidden before it.
    pend = _Pending(pcache[0], list(pcache[1].tolist()) if pcache[1] is not None else [])
    if pend.hidden is not None:
        pend.tokens.append(prompt[0])
    pcache.cache = [None, None]
    _prefill(model, mtp, prompt, tcache, mcache, pend, step_size)

    y = prompt[-1]
    ntoks = 0
    st: Optional[_Step] = None
    try:
        while max_tokens < 0 or ntoks < max_tokens:
            left = policy.max_k if max_tokens < 0 else max_tokens - ntoks - 1
            k = policy.choose(left) if len(pend) else 0
            fed = (pend.hidden, pend.tokens)
            d_arr, q_lps, before, after = _draft(mtp, mcache, pend, k, sampling, step_size)

            verify = begin_verify(tcache)
            x = mx.concatenate([mx.array([y], mx.uint32), d_arr])
            hid, logits = target_forward(model, x[None], tcache)
            logits = logits[0].astype(mx.float32)  # [k+1, V]
            n, token, d_list, logprobs = judge_verify(logits, d_arr, q_lps, sampling, stats,
                                                      also=(hid,))
            policy.record(k, n)

            st = _Step(verify, before, after, hid, fed)
            yield from emit_accepted(n, token, d_list, logprobs, st.emitted, stats,
                                     max_tokens - ntoks if max_tokens >= 0 else -1)
            ntoks += len(st.emitted)
            last = _settle(st, tcache, mcache, pend)
            y = y if last is None else last
            st = None
    finally:
        if st is not None:
            _settle(st, tcache, mcache, pend)
        end_verify(tcache)  # also after an error inside a verify step
        _save_pending(pcache, pend)
