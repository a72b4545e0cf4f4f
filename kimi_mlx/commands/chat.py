"""`kimi-mlx chat`: a multi-turn REPL that keeps `reasoning_content` between turns.

Each assistant reply is stored with its reasoning and re-encoded with it (K3.1 preserved
thinking). The KV/KDA cache is reused across turns when the new conversation's tokens
start with the tokens already processed; otherwise the conversation is prefilled afresh
(KDA state cannot be rewound). Which ids the cache holds after a reply is
`turn_cache.tokens_in_cache`'s rule. Commands: /help, /reset, /effort low|high|max, /exit
(or Ctrl-D); Ctrl-C stops a reply and discards that turn, the cache rolled back to before it.
`/image PATH` attaches an image to the next message (checkpoints with vision weights; the
vision tower loads on the first image).

`--conversation FILE` keeps the messages in FILE (JSON, rewritten atomically after each
turn; images by their path) and resumes them at the next start; `--prompt-cache-dir DIR`
keeps the conversation's cache snapshot on disk after each turn (`server.disk_cache`, the
folder the one-process server uses for the same checkpoint), so a resumed conversation,
or any conversation starting with the same tokens, continues from it instead of
prefilling again.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import List

from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.kv_args import add_kv_arguments, apply_kv_quant, kv_quant
from kimi_mlx.generation.generate import use_color
from kimi_mlx.generation.request import (EFFORTS, InputError, add_draft_arguments, add_model_arguments,
                                         add_mtp_argument, add_quiet_argument, check_model_arguments,
                                         draft_settings, micro_note, resolve_model_arg,
                                         sampling_from_args, serving_context, token_budget)
from kimi_mlx.speculative.factory import ONE_PROCESS, build_speculation


def add_arguments(p) -> None:
    p.epilog = f"In the chat: {COMMANDS}."
    add_model_arguments(p)
    from kimi_mlx.placement.wired import add_allow_paging_argument

    add_allow_paging_argument(p)
    add_kv_arguments(p)
    p.add_argument("--system-prompt", default=None, help="system message")
    p.add_argument("--conversation", default=None, metavar="FILE",
                   help="keep the conversation in this JSON file: resumed from it when it "
                        "exists, saved after each turn")
    from kimi_mlx.server.serving import add_disk_cache_arguments

    add_disk_cache_arguments(p)
    add_draft_arguments(p, mtp=True)
    add_mtp_argument(p)
    add_quiet_argument(p)


COMMANDS = "/help, /reset, /effort low|high|max, /image PATH, /exit (or Ctrl-D); Ctrl-C stops a reply"
HELP = """commands:
  /help                  this list
  /reset                 forget the conversation (keeps --system-prompt)
  /effort low|high|max   thinking effort for the next replies
  /image PATH            attach an image (PNG, JPEG, WebP, GIF) to your next message
  /exit, /quit, Ctrl-D   leave
  Ctrl-C                 stop a reply (the turn is discarded); at the prompt, a fresh line
start a message with a space to send a leading '/'"""


class Conversation:
    """Messages plus the token prefix already in the cache."""

    def __init__(self, system=None):
        self.system = system
        self.reset()

    def reset(self):
        self.messages: List[dict] = (
            [{"role": "system", "content": self.system}] if self.system else []
        )
        self.cache = None
        # Exactly the ids `cache` holds (turn_cache.tokens_in_cache); [] without a cache.
        self.processed: List[int] = []
        self.reused_tokens = 0  # tokens of the last prompt served from the cache
        self.disk_tokens = 0  # of which read back from the prompt cache's disk tier


def chat_turn(model, wrapper, tok, conv: Conversation, text: str, effort: str, sampler,
              max_tokens: int, context: int, reuse_cache: bool = True, on_text=None,
              speculation=None, images=(), vision=None, disk_cache=None) -> dict:
    """One user turn: encode the whole conversation (with earlier reasoning), generate,
    store the reply with its `reasoning_content`; returns parse_reply's dict.
    With `speculation` (`speculative.loop.Speculation`) the reply is decoded speculatively and
    the conversation's cache holds the target's caches followed by the draft's.

    Afterwards `conv.processed` is exactly the ids in `conv.cache`. The cache is reused
    when the new prompt extends those ids, else the conversation is prefilled afresh.
    A KeyboardInterrupt while replying (Ctrl-C), or any other exception, puts `conv`
    back as it was before the turn (messages, cache rolled back, processed) and is
    re-raised.

    `images` (preprocessed, `vision.preprocess.ProcessedImage`) go before `text` in the
    user message; `vision` (`generation.images.Vision`) runs the tower for the images
    whose pads are in the part of the prompt not already in the cache.

    `disk_cache` (a `server.prompt_cache.PromptCache` over a disk tier, no speculation):
    a turn that cannot extend the cache in memory starts from the longest prefix found
    there, and each finished turn's cache is stored in it (written in the background).

    Raises InputError when the conversation no longer fits in `context` tokens.
    """
    from mlx_lm.generate import stream_generate

    from kimi_mlx.text.chat_format import encode_chat
    from kimi_mlx.text.reply_parse import ReplyStream
    from kimi_mlx.generation.turn_cache import checkpoint, tokens_in_cache

    n_messages = len(conv.messages)
    content = text
    if images:
        if speculation is not None:
            raise InputError("images do not work with speculative decoding yet")
        content = [{"type": "image", "media": im} for im in images] + [{"type": "text", "text": text}]
    conv.messages.append({"role": "user", "content": content})
    ids = encode_chat(tok, conv.messages, reasoning_effort=effort)
    if len(ids) >= context:
        del conv.messages[n_messages:]
        raise InputError(f"the conversation is {len(ids)} tokens, over the context of "
                         f"{context}; use /reset")
    before = (conv.cache, conv.processed, conv.reused_tokens)
    n, from_disk = len(conv.processed), False
    if not reuse_cache or conv.cache is None or ids[:n] != conv.processed or n >= len(ids):
        conv.cache, n = model.make_cache(), 0  # the old cache object stays untouched
        if speculation is not None:
            from mlx_lm.models.cache import make_prompt_cache

            conv.cache += make_prompt_cache(speculation.draft)
        elif disk_cache is not None and reuse_cache:
            key = _cache_key(tok, conv.messages, ids)
            if key is not None:
                found, m = disk_cache.fetch(key)
                if found is not None:
                    conv.cache, n, from_disk = found, m, True
    try:
        embeddings = _new_embeddings(model, tok, vision, conv.messages, ids, n)
        if embeddings is False:  # an image straddles the cached prefix: prefill afresh
            conv.cache, n = model.make_cache(), 0
            embeddings = _new_embeddings(model, tok, vision, conv.messages, ids, 0)
    except BaseException:  # e.g. a tower that fails to load: the turn never happened
        conv.cache, conv.processed, conv.reused_tokens = before
        del conv.messages[n_messages:]
        raise
    mark = checkpoint(conv.cache) if n else None
    conv.reused_tokens, conv.disk_tokens = n, (n if from_disk else 0)
    stream = ReplyStream()
    generated: List[int] = []
    finish = None
    budget = token_budget(len(ids), max_tokens, context)
    if disk_cache is not None and speculation is None and embeddings is None:
        try:  # the history through this message: what the next turn's prompt starts with
            n = _prefill_to_message_end(model, tok, conv, ids, n, effort, disk_cache)
        except BaseException:
            _undo_turn(conv, mark, before, n_messages)
            raise
    if speculation is None:
        extra = {} if embeddings is None else {"input_embeddings": embeddings}
        responses = stream_generate(model, wrapper, ids[n:], sampler=sampler,
                                    prompt_cache=conv.cache, max_tokens=budget, **extra)
    else:
        from kimi_mlx.generation.streaming import stream_speculative

        responses = stream_speculative(model, speculation, wrapper, ids[n:],
                                       max_tokens=budget, prompt_cache=conv.cache)
    try:
        for r in responses:
            generated.append(r.token)
            finish = r.finish_reason
            for event in stream.feed(r.text):
                on_text and on_text(*event)
        for event in stream.finish():
            on_text and on_text(*event)
    except BaseException:  # Ctrl-C (or any failure) mid-reply: undo the whole turn
        responses.close()  # first, so no generator clean-up touches the cache after the undo
        _undo_turn(conv, mark, before, n_messages)
        raise
    if speculation is None:
        conv.processed = tokens_in_cache(ids, generated)
    else:  # stream_speculative leaves the last yielded token unfed (target and draft)
        conv.processed = ids + generated[:-1]
    if finish == "length" and len(ids) + len(generated) >= context:
        print(f"\n[reply cut at the context of {context} tokens; /reset to start over]",
              file=sys.stderr)
    reply = stream.result()
    conv.messages.append({"role": "assistant", "content": reply["content"],
                          "reasoning_content": reply["reasoning_content"]})
    if disk_cache is not None and speculation is None:
        key = _cache_key(tok, conv.messages[:-1], conv.processed)
        if key is not None:
            disk_cache.store(key, conv.cache)
    return reply


def _undo_turn(conv: Conversation, mark, before, n_messages: int) -> None:
    """Put `conv` back as it was before a failed or interrupted turn: the cache rolled back
    to `mark` (`turn_cache.checkpoint`; None: the cache was new), (cache, processed,
    reused_tokens) = `before`, and the turn's messages (past `n_messages`) dropped."""
    from kimi_mlx.generation.turn_cache import rollback

    if mark is not None:
        rollback(conv.cache, mark)
    conv.cache, conv.processed, conv.reused_tokens = before
    del conv.messages[n_messages:]


def _prefill_to_message_end(model, tok, conv, ids, n, effort, disk_cache) -> int:
    """Prefill ids[n:e] into `conv.cache`, e the end of the conversation's last message
    (before the assistant header), and store that snapshot in `disk_cache`: the next
    turn re-renders this turn's reply, so its prompt shares this prefix even when not
    the generated tokens. Returns the new number of ids in the cache (n when e is not
    past n)."""
    import mlx.core as mx

    from kimi_mlx.text.chat_format import encode_chat

    e = len(encode_chat(tok, conv.messages, reasoning_effort=effort, add_generation_prompt=False))
    if not n < e < len(ids):
        return n
    step = 2048
    for i in range(n, e, step):
        model(mx.array([ids[i:min(i + step, e)]]), cache=conv.cache)
        mx.eval([c.state for c in conv.cache])
    disk_cache.store(list(ids[:e]), conv.cache)
    return e


def _cache_key(tok, messages, ids):
    """The prompt-cache key of `ids` (`server.images.cache_key`: image pads with their
    images' digests; the ids themselves without images); None when the pads do not match
    the images (nothing is cached then)."""
    from kimi_mlx.generation.images import media_pad_id
    from kimi_mlx.server.images import cache_key
    from kimi_mlx.text.chat_format import media_in_order

    media = media_in_order(messages)
    if not media:
        return list(ids)
    try:
        return cache_key(ids, media, media_pad_id(tok))
    except ValueError:
        return None


def save_conversation(path, conv: Conversation) -> None:
    """`conv`'s messages to `path` as JSON ({"messages": [...]}, images as {"type":
    "image", "path": their source}), written atomically (temporary file, fsync, rename)."""
    import json
    import os
    from pathlib import Path

    def part(p):
        if isinstance(p, dict) and p.get("type") == "image":
            return {"type": "image", "path": p["media"].source}
        return p

    msgs = [dict(m, content=[part(p) for p in m["content"]]) if isinstance(m.get("content"), list)
            else m for m in conv.messages]
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump({"messages": msgs}, f, ensure_ascii=False, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_conversation(path, conv: Conversation, load_image) -> int:
    """Messages of a `save_conversation` file into `conv` (replacing its own); images
    re-read with `load_image(path)` (called only when there are images). Returns the
    number of messages; InputError naming the file for one that is not such a file."""
    import json

    try:
        with open(path) as f:
            msgs = json.load(f)["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise ValueError("'messages' is not a list of messages")
        for m in msgs:
            if isinstance(m.get("content"), list):
                m["content"] = [{"type": "image", "media": load_image(p["path"])}
                                if isinstance(p, dict) and p.get("type") == "image" else p
                                for p in m["content"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"--conversation {path}: not a conversation file ({e})") from None
    conv.messages = msgs
    return len(msgs)


def _new_embeddings(model, tok, vision, messages, ids, n):
    """Input embeddings of ids[n:] with their images' rows, None when no image is in the
    conversation, False when an image's pads straddle position n."""
    from kimi_mlx.generation.images import media_pad_id
    from kimi_mlx.text.chat_format import media_in_order

    media = media_in_order(messages)
    if not media:
        return None
    import mlx.core as mx

    pad = media_pad_id(tok)
    skip = ids[:n].count(pad)
    new, seen = [], 0
    for im in media:
        if seen >= skip:
            new.append(im)
        elif seen + im.num_tokens > skip:
            return False
        seen += im.num_tokens
    if not new:
        return model.text.embed(mx.array(ids[n:]))
    if vision is None:
        raise InputError("this conversation has images but no vision tower was given")
    return model.embed_with_media(mx.array(ids[n:]), vision.features(new), pad)


def run(args) -> int:
    import mlx.core as mx

    try:
        check_model_arguments(args)
        drafts = draft_settings(args)
        spec = resolve_model_arg(args.model)
        from kimi_mlx.checkpoint.hub import resolve
        from kimi_mlx.placement.wired import allow_paging, model_plan, wire

        kv = kv_quant(args)  # a bad --kv-group-size before the load
        wire(lambda: model_plan(resolve(spec), "kimi-mlx chat", args.max_kv_size,
                                kv_bits=kv[0], kv_group_size=kv[1], drafts=drafts),
             allow_paging(args.allow_paging))
        model, wrapper, tok, _ = load_for_generation(spec, progress=not args.quiet)
        apply_kv_quant(model, args)
        speculation = build_speculation(drafts, where=ONE_PROCESS, target_wrapper=wrapper,
                                        target_name=spec, model=model,
                                        sampling=sampling_from_args(args))
    except (InputError, FileNotFoundError, ValueError) as e:
        print(f"kimi-mlx chat: error: {e}", file=sys.stderr)
        return 2
    if args.seed is not None:
        mx.random.seed(args.seed)
    # seeded once above, for the whole chat (as mlx_lm.chat): the sampler draws from the
    # global stream
    sampler = replace(sampling_from_args(args), seed=None).sampler()
    conv = Conversation(args.system_prompt)
    disk_cache = None
    if args.prompt_cache_dir and speculation is None:
        from pathlib import Path

        from kimi_mlx.checkpoint.hub import resolve
        from kimi_mlx.server.disk_cache import DiskSnapshotStore
        from kimi_mlx.server.prompt_cache import PromptCache
        from kimi_mlx.server.serving import check_disk_cache_arguments, model_cache_fingerprint

        try:
            check_disk_cache_arguments(args)
            disk = DiskSnapshotStore(args.prompt_cache_dir, args.prompt_cache_disk_bytes,
                                     model_cache_fingerprint(Path(resolve(spec)), model))
            disk_cache = PromptCache(0, every=0, disk=disk)
        except (InputError, OSError, RuntimeError) as e:
            print(f"kimi-mlx chat: prompt cache on disk off: {e}", file=sys.stderr)
    elif args.prompt_cache_dir:
        print("kimi-mlx chat: --prompt-cache-dir is not used with a draft", file=sys.stderr)
    try:
        return _repl(args, spec, model, wrapper, tok, speculation, sampler, conv, disk_cache)
    finally:
        if disk_cache is not None:
            disk_cache.disk.close()  # the last turn's snapshot reaches the disk


def _repl(args, spec, model, wrapper, tok, speculation, sampler, conv, disk_cache) -> int:
    vision = None

    def load_image(path):
        nonlocal vision
        if vision is None:
            from kimi_mlx.checkpoint.hub import resolve
            from kimi_mlx.generation.images import Vision

            found = Vision(resolve(spec, vision=True))
            if not found.available:
                raise InputError(f"{found.model_dir}: this checkpoint has no vision "
                                 "weights, so it cannot take images")
            vision = found
        return vision.load_image(path)

    if args.conversation:
        from pathlib import Path

        if Path(args.conversation).exists():
            try:
                n = load_conversation(args.conversation, conv, load_image)
            except (InputError, FileNotFoundError) as e:
                print(f"kimi-mlx chat: error: {e}", file=sys.stderr)
                return 2
            print(f"[resumed {n} messages from {args.conversation}]", file=sys.stderr)
    effort = args.reasoning_effort
    context = serving_context(model.args.max_position_embeddings, args.max_kv_size)[0]
    dim = use_color()

    def show(channel, text):
        print(f"\033[2m{text}\033[0m" if channel == "reasoning" and dim else text, end="",
              flush=True)

    note = micro_note(spec)
    if note:
        print(note, file=sys.stderr)
    pending = []
    print(f"kimi-mlx chat: {COMMANDS}", file=sys.stderr)
    while True:
        try:
            line = input(">> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as a shell does
            print()
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if line.startswith("/"):
            name, _, value = cmd.partition(" ")
            value = value.strip()
            if name in ("/exit", "/quit"):
                return 0
            if name == "/help":
                print(HELP, file=sys.stderr)
            elif name == "/reset":
                conv.reset()
                pending.clear()
                if args.conversation:
                    save_conversation(args.conversation, conv)
                print("[conversation reset]", file=sys.stderr)
            elif name == "/effort" and value in EFFORTS:
                effort = value
                print(f"[thinking effort: {effort}]", file=sys.stderr)
            elif name == "/effort":
                print(f"/effort takes one of {', '.join(EFFORTS)} (now {effort})", file=sys.stderr)
            elif name == "/image":
                try:
                    if speculation is not None:
                        raise InputError("images do not work with speculative decoding yet")
                    if not value:
                        raise InputError("/image takes a file path")
                    im = load_image(value)
                except (InputError, FileNotFoundError) as e:
                    print(e, file=sys.stderr)
                    continue
                pending.append(im)
                print(f"[image {value}: {im.width}x{im.height}, {im.num_tokens} tokens; sent with "
                      "your next message]", file=sys.stderr)
            else:
                print(f"unknown command {name} ({COMMANDS}; start a message with a space to "
                      "send a leading '/')", file=sys.stderr)
            continue
        try:
            chat_turn(model, wrapper, tok, conv, line, effort, sampler, args.max_tokens,
                      context, on_text=show, speculation=speculation, images=pending,
                      vision=vision, disk_cache=disk_cache)
            pending = []
            if conv.disk_tokens:
                print(f"\n[{conv.disk_tokens} prompt tokens from the cache on disk]",
                      file=sys.stderr, end="")
            if args.conversation:
                save_conversation(args.conversation, conv)
        except InputError as e:
            print(e, file=sys.stderr)
        except KeyboardInterrupt:  # Ctrl-C while replying: chat_turn undid this turn
            print("\n[interrupted: reply discarded]", file=sys.stderr)
            continue
        print()
