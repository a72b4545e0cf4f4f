"""The one speculation factory: `DraftSettings` -> `Speculation`, for every front end
(generate, chat, `kimi-mlx server`, `cluster launch` and `cluster server` in both
modes). Where a kind of draft cannot run, it is refused here, by name, with the reason.
"""

from __future__ import annotations

from typing import Optional

from kimi_mlx.sampling import InputError, Sampling
from kimi_mlx.speculative.auto_k import draft_policy
from kimi_mlx.speculative.loop import Speculation, load_draft
from kimi_mlx.speculative.settings import DraftSettings

__all__ = ["block_drafter_path", "build_speculation", "check_draft_target", "ONE_PROCESS", "PIPELINE", "TENSOR"]

# what runs the target's forward passes, as the factory is told
ONE_PROCESS, PIPELINE, TENSOR = "one process", "pipeline", "tensor group"

_MTP_NEEDS = ("--draft mtp: the MTP draft runs in one process only (kimi-mlx generate, "
              "chat or server): it drafts from the target's last hidden state, which {where} "
              "does not return (its last stage or rank sends logits only); use "
              "--draft-model or --draft ngram there")


def block_drafter_path(spec: Optional[str]):
    """The local folder of `--draft-model spec` when it holds a DFlash / DSpark block
    drafter (its config.json has a `dflash_config`), else None. Reads no weights and
    downloads nothing (a hub id not yet local is not recognised here)."""
    import json
    from pathlib import Path

    from kimi_mlx.speculative.block_drafter import is_block_drafter

    if not spec:
        return None
    cfg = Path(spec) / "config.json"
    try:
        return Path(spec) if is_block_drafter(json.loads(cfg.read_text())) else None
    except (OSError, ValueError):
        return None


def check_draft_target(settings: Optional[DraftSettings], where: str) -> None:
    """InputError when `settings` asks for a draft that cannot run on `where`
    (ONE_PROCESS, PIPELINE or TENSOR), naming the flag and the reason:
    `--draft mtp` needs the target's last hidden state, which only one process has. A
    block drafter (`--draft-model` on a DFlash / DSpark folder) runs everywhere: it reads
    the target's hidden states at `target_layer_ids`, which one process captures itself,
    a tensor group's rank 0 from its own pass (`tensor.step.GroupTarget.forward_capture`)
    and a pipeline's stages send to the head (`head.speculative.PipelineTarget.
    forward_capture`). Call it before anything loads, so a wrong combination fails fast."""
    if settings is not None and settings.kind == "mtp" and where != ONE_PROCESS:
        raise InputError(_MTP_NEEDS.format(where=f"a {where}"))


def build_speculation(settings: Optional[DraftSettings], *, where: str, target_wrapper=None,
                      target_name: str = "", model=None,
                      sampling: Optional[Sampling] = None) -> Optional[Speculation]:
    """The `Speculation` for `settings` (None without one).

    Args:
        settings: what the command asked for. where: ONE_PROCESS, PIPELINE or TENSOR
            (`check_draft_target`). A block drafter on TENSOR or PIPELINE (without
            `model`: the head holds no layers, rank 0 a vocab-split head) binds to the
            target's embedding and lm_head read from `target_name`
            (`block_drafter.load_target_embed_head`). target_wrapper / target_name: the target's
            tokenizer (mlx-lm TokenizerWrapper) and checkpoint, which a draft model's
            tokenizer is checked against (`loop.load_draft`). model: the loaded target
            (one process), which `--draft mtp` binds its layers to. sampling: the
            settings front ends without per-request sampling (generate, chat) draw with.
    Raises:
        InputError: a draft `where` cannot run. CheckpointError (ValueError): `--draft
        mtp` on a checkpoint without MTP layers; a block drafter (DFlash / DSpark
        folder) made for another target (`block_drafter.check_target`). TokenizerMismatch: a draft model with
        another tokenizer. What loading a checkpoint raises.
    """
    if settings is None:
        return None
    check_draft_target(settings, where)
    if settings.kind == "ngram":
        from kimi_mlx.speculative.ngram import NgramDraft

        draft = NgramDraft(settings.ngram_max, settings.ngram_min)
    elif settings.kind == "mtp":
        from kimi_mlx.checkpoint.hub import resolve
        from kimi_mlx.speculative.mtp import load_mtp

        if model is None:
            raise InputError("--draft mtp needs the loaded target model")
        draft = load_mtp(resolve(target_name), model, depths=1)
    elif block_drafter_path(settings.model) is not None:
        from kimi_mlx.speculative.block_drafter import load_block_drafter
        from kimi_mlx.speculative.block_loop import BlockDraft

        path = block_drafter_path(settings.model)
        if model is not None:
            drafter = load_block_drafter(path, model)
        elif where in (TENSOR, PIPELINE):
            # rank 0's lm_head is split by vocabulary (its logits need a collective), and
            # a pipeline's head holds no layers: the drafter gets the target's embedding
            # and head of its own
            from kimi_mlx.checkpoint.hub import resolve
            from kimi_mlx.speculative.block_drafter import check_target, load_target_embed_head

            args, embed, head = load_target_embed_head(resolve(target_name))
            drafter = load_block_drafter(path)
            check_target(drafter.config, args, str(path))
            drafter.bind(embed, head)
        else:
            raise InputError(f"--draft-model {settings.model}: a block drafter needs the "
                             "loaded target model")
        draft = BlockDraft(drafter)
    else:
        draft = load_draft(settings.model, target_wrapper, target_name)
    k = settings.num_draft_tokens
    # "auto[:N]": one AutoK for the Speculation's life, so a server's requests keep
    # refining the same acceptance and step-time figures
    return Speculation(draft, draft_policy(k) if isinstance(k, str) else k,
                       sampling or Sampling())
