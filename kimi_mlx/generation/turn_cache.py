"""Which tokens a prompt cache holds after mlx-lm generated from it, and an exact undo.

A multi-turn front end (``kimi-mlx chat``, the server's prompt cache) keeps the model's
cache between requests and must know exactly which token ids it holds: the next request
may reuse it only if its ids start with those, and it must feed the rest, each token once.

The rule, read from mlx-lm 0.32 ``generate.py``:

* ``generate_step`` feeds every token it yields into the cache *before* yielding it (it
  computes the next token ahead). ``stream_generate`` stops on an EOS token or at
  ``max_tokens`` after that token was yielded to it, so the cache holds the whole prompt
  plus every generated token, the EOS or last one included.
* ``speculative_generate_step`` rewinds the main model's cache to the accepted draft
  tokens; the token the main model itself sampled last in a round (``from_draft`` False)
  is only fed at the next round. So when a speculative run ends on such a token, that
  one token is not in the cache.

KDA state cannot be trimmed, so undoing a turn (Ctrl-C while replying) uses
:func:`checkpoint` / :func:`rollback`: KDA layers keep references to their (immutable)
state arrays, KV-type layers their offset. Nothing is copied.
"""

from __future__ import annotations

from typing import Any, List, Sequence


def tokens_in_cache(prompt: Sequence[int], generated: Sequence[int], *,
                    speculative: bool = False, last_from_draft: bool = False) -> List[int]:
    """Token ids a prompt cache holds after a generation from it.

    Args:
        prompt: every prompt id the cache has seen, i.e. the ids it held before plus the
            ids passed to ``stream_generate`` (a reused prefix counts).
        generated: ``response.token`` of every ``GenerationResponse`` that
            ``stream_generate`` yielded, in order, the final one (EOS or last) included.
            A turn stopped early (the caller stopped iterating) lists what it received.
        speculative: the generation used a draft model (``speculative_generate_step``).
        last_from_draft: ``from_draft`` of the last response (speculative runs only).

    Returns:
        ``list(prompt) + list(generated)``, less the last generated token when a
        speculative run ended on a token the main model sampled (see the module notes).
    """
    ids = list(prompt) + list(generated)
    if speculative and generated and not last_from_draft:
        ids.pop()
    return ids


def checkpoint(cache: Sequence[Any]) -> list:
    """A mark to :func:`rollback` ``cache`` (a list of mlx-lm caches) to its present state.

    ``ArraysCache``-like layers (``.cache`` list, e.g. KDA conv + recurrent state) keep
    references to their arrays (mlx arrays are never changed in place by our model: new
    state replaces the list entry); trimmable KV-type layers keep their ``offset``.
    Raises ``TypeError`` naming the layer for a cache of any other kind.
    """
    marks = []
    for i, c in enumerate(cache):
        if isinstance(getattr(c, "cache", None), list):
            marks.append(("arrays", list(c.cache)))
        elif hasattr(c, "offset") and getattr(c, "is_trimmable", lambda: False)():
            marks.append(("offset", c.offset))
        else:
            raise TypeError(f"cache layer {i} ({type(c).__name__}) can be neither referenced nor trimmed")
    return marks


def rollback(cache: Sequence[Any], marks: list) -> None:
    """Put ``cache`` back to the state :func:`checkpoint` recorded in ``marks``.

    Raises ``ValueError`` if ``marks`` was taken from a cache with another layer count,
    or a KV layer now holds fewer tokens than at the checkpoint.
    """
    if len(marks) != len(cache):
        raise ValueError(f"checkpoint of {len(marks)} layers for a cache of {len(cache)}")
    for i, (c, (kind, value)) in enumerate(zip(cache, marks)):
        if kind == "arrays":
            c.cache = list(value)
        else:
            if c.offset < value:
                raise ValueError(f"cache layer {i} holds {c.offset} tokens, fewer than the "
                                 f"checkpoint's {value}")
            c.trim(c.offset - value)
