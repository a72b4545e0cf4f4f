"""What a server may serve and how it says so: the catalog of models from `--model
NAME=PATH` / `--models-dir` (`catalog`), their flags (`add_model_arguments`), Ollama's
keep_alive read as seconds (`parse_keep_alive`) and the /v1/models listing
(`models_list`). The holder that loads, unloads and swaps them is `server.models`.

Ollama's keep_alive (api/types.go `Duration`): a number is seconds, a string a Go
duration ("5m", "1h30m", "300ms"), 0 unloads as soon as the reply ends, a negative
value keeps the model loaded until another request says otherwise.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

log = logging.getLogger(__name__)

__all__ = ["parse_keep_alive", "catalog", "check_allowed", "is_checkpoint", "add_model_arguments",
           "models_list", "checkpoint_tensor_bytes", "FOREVER", "DEFAULT", "DEFAULT_WAIT_S"]

FOREVER = None  # a keep-alive that never expires
DEFAULT = object()  # a request that sends no keep_alive: the server's --idle-unload
DEFAULT_WAIT_S = 300.0

_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
             "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


def parse_keep_alive(value: Any) -> Optional[float]:
    """Seconds a model stays loaded after a request, from Ollama's `keep_alive` (its
    api/types.go `Duration.UnmarshalJSON`): a number is seconds; a string is a Go duration
    (`time.ParseDuration`: "0", or one or more number+unit of ns, us, ms, s, m, h, with an
    optional sign, e.g. "5m", "1h30m", "-1s"); negative (either form) is forever
    (`FOREVER`, None). Raises ValueError naming the value for anything else (a bool, a
    string without units such as "300", an object)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"keep_alive must be a number of seconds or a duration string "
                         f"such as \"5m\", got {value!r}")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            return FOREVER if value == float("-inf") else (FOREVER if value > 0 else 0.0)
        return FOREVER if value < 0 else float(value)
    if not isinstance(value, str):
        raise ValueError(f"keep_alive must be a number of seconds or a duration string "
                         f"such as \"5m\", got {value!r}")
    s = value.strip()
    sign = -1.0 if s.startswith("-") else 1.0
    body = s[1:] if s[:1] in "+-" else s
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _GO_DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _GO_UNITS[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ValueError(f"keep_alive {value!r} is not a duration: a number of seconds or a "
                         "string such as \"5m\", \"1h30m\", \"300ms\" (units ns, us, ms, s, "
                         "m, h), negative to stay loaded")
    return FOREVER if sign < 0 and total > 0 else total


# ------------------------------------------------------------------ the catalog


def is_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a checkpoint: config.json and at least one .safetensors
    file."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def catalog(models: Optional[List[str]], models_dir: Optional[str],
            served_name: Optional[str], default: Callable[[], str]) -> Dict[str, str]:
    """The models a server may load, name -> checkpoint (folder or hub id), in order; the
    first is loaded at start.

    Args:
        models: the `--model` values: `NAME=PATH` entries, or one plain PATH (named
            `served_name` or its folder's name). A value whose part before "=" has no
            "/" is NAME=PATH.
        models_dir: `--models-dir`: each subfolder that `is_checkpoint` is a model named
            by the folder, in name order, after the `--model` ones.
        served_name: `--served-model-name`, the name of a plain --model.
        default: the checkpoint when neither flag names any (the shipped micro model).
    Raises:
        ValueError naming the flag: two plain --model values, an empty NAME or PATH, a
        name given twice, a --models-dir that is not a folder or holds no checkpoint.
    """
    out: Dict[str, str] = {}

    def add(name: str, path: str, where: str) -> None:
        if not name or not path:
            raise ValueError(f"{where}: give NAME=PATH with both parts")
        if name in out:
            raise ValueError(f"{where}: the model name {name!r} is given twice "
                             f"({out[name]} and {path})")
        out[name] = path

    plain = []
    for v in models or []:
        name, sep, path = v.partition("=")
        if sep and "/" not in name:
            add(name.strip(), path.strip(), f"--model {v}")
        else:
            plain.append(v)
    if len(plain) > 1:
        raise ValueError(f"--model: one checkpoint without a name at most (got "
                         f"{', '.join(plain)}); name the others NAME=PATH")
    if models_dir is not None:
        d = Path(models_dir).expanduser()
        if not d.is_dir():
            raise ValueError(f"--models-dir {models_dir}: not a folder")
        found = sorted(p for p in d.iterdir() if p.is_dir() and is_checkpoint(p))
        if not found:
            raise ValueError(f"--models-dir {models_dir}: no checkpoint in it (a subfolder "
                             "with config.json and .safetensors files is one)")
        dir_models = [(p.name, str(p)) for p in found]
    else:
        dir_models = []
    if plain or not (out or dir_models):
        spec = plain[0] if plain else default()
        first = {served_name or Path(spec.rstrip("/")).name or "model": spec}
        first.update(out)
        out = first
    for name, path in dir_models:
        add(name, path, f"--models-dir {models_dir}")
    return out


def check_allowed(models: Dict[str, str], allowed: Optional[List[str]]) -> None:
    """ValueError naming --allow-models for an allowed name not in `models`."""
    unknown = [n for n in allowed or () if n not in models]
    if unknown:
        raise ValueError(f"--allow-models names {', '.join(map(repr, unknown))}, not "
                         f"among the models ({', '.join(map(repr, models))})")


def add_model_arguments(p) -> None:
    """--models-dir, --allow-models, --idle-unload, --model-wait (`kimi-mlx server`;
    --model itself is the command's, repeatable)."""
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every checkpoint in DIR's subfolders, named by folder; one "
                        "is loaded at a time and a request naming another swaps it in")
    p.add_argument("--allow-models", default=None, metavar="NAMES",
                   help="comma-separated model names requests may use (default: all the "
                        "--model / --models-dir ones); others get a 404")
    p.add_argument("--idle-unload", type=float, default=None, metavar="SECONDS",
                   help="free the model's memory (weights, caches, wired limit) after this "
                        "many seconds without a request and load it again on the next one "
                        "(default: stay loaded; Ollama requests' keep_alive overrides it)")
    p.add_argument("--model-wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help="how long a request waits for its model to load (a swap, a reload "
                        f"after an idle unload) before a 503 with Retry-After (default "
                        f"{DEFAULT_WAIT_S:g})")


def models_list(svc) -> List[Dict[str, Any]]:
    """/v1/models' `data`: every model a request may name (OpenAI's Model object: id,
    object, created, owned_by) with `context_length` and, as llama-server's router lists
    them, `status: {"value": loaded | loading | unloading | unloaded}`; the loaded one
    adds `memory_bytes` (MLX active memory now: weights and caches), `weights_bytes`
    (what its load added) and `expires_at` (unix seconds of its idle unload; null: not
    planned). Without a `ModelHolder` (the cluster server): the one model, loaded once
    the server is ready, never unloaded; its memory is on the stages, not measured here
    (`weights_bytes`: the checkpoint's tensor bytes the stages hold, when known)."""
    base = {"object": "model", "created": svc.created, "owned_by": "kimi-mlx"}
    holder = svc.models
    if holder is None:
        out = []
        for m in svc.model_ids[:1]:
            d = {"id": m, **base, "context_length": svc.context,
                 "status": {"value": "loaded" if svc.ready else "loading"},
                 "expires_at": None}
            if getattr(svc, "weights_bytes", None):
                d["weights_bytes"] = svc.weights_bytes
            out.append(d)
        return out
    out = []
    for name in holder.allowed:
        st = holder.status(name)
        d = {"id": name, **base, "context_length": holder.context_of(name, holder.max_kv_size),
             "status": {"value": st["state"]}}
        if "size" in st:
            d.update(memory_bytes=st["size"], weights_bytes=st["weights_bytes"],
                     expires_at=None if st["expires_at"] is None else int(st["expires_at"]))
        out.append(d)
    return out


def checkpoint_tensor_bytes(model_dir) -> int:
    """Bytes of the tensors a checkpoint's loaded model holds, from its shard headers
    (`placement.layer_bytes.model_bytes_from_checkpoint`): what the cluster server
    reports for a model whose weights are on its stages; 0 when it cannot be read."""
    from kimi_mlx.placement.layer_bytes import model_bytes_from_checkpoint

    try:
        return int(model_bytes_from_checkpoint(Path(model_dir)).weight_bytes)
    except (OSError, ValueError, KeyError) as e:
        log.debug("tensor bytes of %s not known: %s", model_dir, e)
        return 0
