"""The code's own map resolves: every backticked dotted name and repository path in the
product's comments and strings, README.md, cluster/net/stage.proto and the Makefile names
something that exists.

What is checked (the rules, chosen so that a hit is a stale name, not a variable):

- Sources: every comment and string literal of the product's Python files (kimi_mlx/,
  cluster/, metal/, prune/; not kimi_mlx/assets/, which ships upstream files verbatim, nor
  the generated *_pb2*.py stubs), README.md, cluster/net/stage.proto, the Makefile and
  every cluster/ or kimi_mlx/ README.md. Only text between single backticks is read.
- A *repository path* is a backticked token that ends in .py/.proto/.metal/.h/.hpp or whose
  first folder is a product or test folder (kimi_mlx/, cluster/, metal/, prune/, tests/, a
  subpackage folder such as server/ or net/), or is `Makefile`. It resolves if it exists
  (globs allowed) relative to the repository root, to one of the package roots (kimi_mlx/,
  cluster/, metal/, prune/: the package layout names them kimi_mlx.cluster etc.), or to the
  folder of the file that names it. Bare file names (`loader.py`, `configuration_kimi.py`)
  and paths whose first folder is not ours name upstream files (mlx, vLLM, the release)
  and are not read; nor are absolute or ~ paths, URLs and patterns with placeholders.
- A *dotted name* is a backticked `a.b[.c...]` of identifiers (an optional trailing `()`
  is dropped). It is read only when its first part is one of ours: `kimi_mlx`; a package
  alias (`cluster.` = kimi_mlx.cluster., `metal.`, `prune.`, and every subpackage's short
  name: `server.`, `speculative.`, `net.`, `tensor.`, ...); the short name of any product
  module (`engine_base.BaseEngine`, `wire.PROTOCOL_VERSION`); a class defined at the top
  of a product module (`Speculation.step`); or a stage.proto message (`Event.hidden`, a
  field of the generated class). `mlx_lm.` names resolve against the
  installed mlx-lm. Anything else (`self.x`, `args.port`, `np.float32`, tensor keys such as
  `model.layers.N`) is not a code reference and is not read. A read name resolves when some
  candidate module imports and the rest of the name is found on it by getattr, or as a
  class attribute declared by annotation (dataclass / pydantic fields) or assigned as
  `self.<name>` in the class's source. Where a short name is ambiguous (three `engine`
  modules), one candidate resolving is enough. A variable named after its module
  (`sampling.logits_processors()` for a Sampling) resolves when one of that module's own
  classes has the attribute. The few backticked variables and API fields left over are
  listed in NOT_CODE, each with why.
"""
from __future__ import annotations

import ast
import glob
import importlib
import inspect
import io
import os
import re
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder on disk -> dotted package (pyproject's package-dir)
PACKAGES = {"kimi_mlx": "kimi_mlx", "cluster": "kimi_mlx.cluster", "metal": "kimi_mlx.metal",
            "prune": "kimi_mlx.prune"}
SKIP_DIRS = {"assets", "__pycache__", "web"}
FILE_EXTS = {"py", "proto", "metal", "h", "hpp"}
# a dotted token whose last part is one of these is a file name, not a Python name
NOT_NAME_EXTS = FILE_EXTS | {"json", "jsonl", "safetensors", "md", "txt", "toml", "yaml", "yml",
                             "npz", "npy", "bin", "html", "js", "css", "sh", "log", "png", "jpg",
                             "jpeg", "tiktoken", "model", "gguf", "csv", "pth", "cfg", "ini",
                             "index", "lock", "pid", "sock", "tmp", "mlpackage", "so", "dylib",
                             "gz", "tar", "zip", "pt", "onnx", "svg", "webp", "gif", "local",
                             "crt", "key", "pem"}
# Backticked names that read as ours but are variables or API fields, each with why.
NOT_CODE = {
    "text.format": "the Responses API request field (text: {format: ...})",
    "text.embed": "an attribute path on a model object (model.text.embed), not kimi_mlx.text",
    "settings.max_images": "a field of the ImageSettings argument named settings",
    "settings.max_pixels": "a field of the ImageSettings argument named settings",
    "thinking.budget_tokens": "the Anthropic Messages request field (thinking: {budget_tokens})",
    "chat.completions.parse": "the openai SDK's method (client.chat.completions.parse)",
    "draft.make_cache()": "a method of the draft model argument, not kimi_mlx.micro.draft",
}
BACKTICK = re.compile(r"`([^`\n]+)`")
PLAIN = re.compile(r"(?<![\w./-])(?:(?:kimi_mlx|cluster|prune|metal)(?:\.[A-Za-z_]\w*){2,}"
                   r"|(?:kimi_mlx|cluster|prune|metal|tests)/[\w/.*-]+\.(?:py|proto|metal))(?![\w/-])")
DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _product_py_files():
    for folder in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(ROOT / folder):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for f in sorted(filenames):
                if f.endswith(".py") and "_pb2" not in f:
                    yield Path(dirpath) / f


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def _layout():
    """(short name -> modules, top-level class name -> modules)."""
    by_leaf: dict[str, set[str]] = {}
    by_def: dict[str, set[str]] = {}
    for path in _product_py_files():
        mod = _module_name(path)
        by_leaf.setdefault(mod.rsplit(".", 1)[-1], set()).add(mod)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                by_def.setdefault(node.name, set()).add(mod)
    # package aliases: cluster -> kimi_mlx.cluster, net -> kimi_mlx.cluster.net, ...
    for folder, pkg in PACKAGES.items():
        by_leaf.setdefault(folder, set()).add(pkg)
    return by_leaf, by_def


def _texts():
    """(file, line, text) of every comment/string in product Python and the prose files."""
    for path in _product_py_files():
        src = path.read_text(encoding="utf-8")
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING) or \
                    tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
                yield path, tok.start[0], tok.string
    prose = [ROOT / "README.md", ROOT / "Makefile", ROOT / "cluster/net/stage.proto"]
    prose += sorted(ROOT.glob("cluster/**/README.md")) + sorted(ROOT.glob("kimi_mlx/**/README.md"))
    for path in prose:
        if path.exists():
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                yield path, n, line


def references():
    """Every (file, line, token) backticked in the map's sources, and the plain-text ones
    that can only be ours: `kimi_mlx.`/`cluster.`/`prune.`/`metal.` names of 3+ parts and
    paths under a product folder ending in a source extension."""
    for path, line, text in _texts():
        for m in BACKTICK.finditer(text):
            yield path, line + text[:m.start()].count("\n"), m.group(1).strip()
        plain = BACKTICK.sub(" ", text)
        for m in PLAIN.finditer(plain):
            yield path, line + plain[:m.start()].count("\n"), m.group(0).rstrip(".")


def _is_path(tok: str) -> bool:
    if tok == "Makefile":
        return True
    if " " in tok or "/" not in tok or re.search(r"[<>{}$:=,;~]", tok):
        return False
    return tok.split("/", 1)[0] in _folders()


@lru_cache(maxsize=None)
def _folders():
    """The first folders that make a backticked token a repository path."""
    folders = {"kimi_mlx", "cluster", "metal", "prune", "tests"}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).iterdir():
            if p.is_dir() and p.name not in SKIP_DIRS and p.name != "__pycache__":
                folders.add(p.name)
    return folders


def path_resolves(tok: str, where: Path) -> bool:
    tok = tok.rstrip("/")
    bases = [ROOT, *(ROOT / f for f in PACKAGES), where.parent]
    return any(glob.glob(str(base / tok)) for base in bases)


def _candidates(name: str):
    """The full dotted names `name` may stand for, or None when it is not one of ours."""
    first = name.split(".", 1)[0]
    rest = name[len(first):]
    if first in ("kimi_mlx", "mlx_lm"):
        return [name]
    by_leaf, by_def = _layout()
    cands = {m + rest for m in by_leaf.get(first, ())}
    cands |= {f"{m}.{name}" for m in by_def.get(first, ())}
    if first in _stage_messages():
        cands.add(f"kimi_mlx.cluster.net.stage_pb2.{name}")
    return sorted(cands) or None


@lru_cache(maxsize=None)
def _stage_messages():
    from kimi_mlx.cluster.net import stage_pb2
    return frozenset(stage_pb2.DESCRIPTOR.message_types_by_name)


def _instance_resolves(full: str) -> bool:
    """`module.attr` where `module` is a variable named after its module: `attr` on one of
    the module's own classes (`sampling.logits_processors()` for a `Sampling`)."""
    mod, _, attr = full.rpartition(".")
    try:
        module = importlib.import_module(mod)
    except ImportError:
        return False
    classes = [c for c in vars(module).values()
               if inspect.isclass(c) and c.__module__ == module.__name__]
    return any(hasattr(c, attr) or _class_has(c, attr) for c in classes)


def _class_has(cls, attr: str) -> bool:
    for klass in inspect.getmro(cls):
        if attr in getattr(klass, "__annotations__", {}) or attr in getattr(klass, "model_fields", {}):
            return True
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\s*(?::[^=\n]+)?=", src):
            return True
    return False


@lru_cache(maxsize=None)
def name_resolves(full: str) -> bool:
    parts = full.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif hasattr(obj, "DESCRIPTOR") and attr in getattr(obj.DESCRIPTOR, "fields_by_name", {}):
                obj = None  # a field of a stage.proto message
            elif inspect.isclass(obj) and _class_has(obj, attr):
                obj = None  # an instance attribute: nothing further to walk
            elif inspect.ismodule(obj) and attr in getattr(obj, "__annotations__", {}):
                obj = None
            else:
                return False
            if obj is None:
                return attr == parts[-1]
        return True
    return False


def unresolved():
    bad = []
    for path, line, tok in references():
        where = f"{path.relative_to(ROOT)}:{line}"
        if _is_path(tok):
            if not path_resolves(tok, path):
                bad.append(f"{where}: path `{tok}`")
            continue
        if tok in NOT_CODE:
            continue
        name = tok[:-2] if tok.endswith("()") else tok
        if not DOTTED.match(name) or name.rsplit(".", 1)[-1].lower() in NOT_NAME_EXTS:
            continue
        cands = _candidates(name)
        if cands is not None and not any(name_resolves(c) or _instance_resolves(c) for c in cands):
            bad.append(f"{where}: name `{tok}`")
    return bad


def test_rules_tell_stale_from_live():
    """The resolver itself: live names and paths resolve, moved or invented ones do not."""
    here = ROOT / "cluster" / "head" / "engine.py"
    assert path_resolves("kimi_mlx/checkpoint/loader.py", here)
    assert path_resolves("net/wire.py", here)  # relative to the cluster package root
    assert path_resolves("tests/test_map.py", here)
    assert not path_resolves("cluster/compute.py", here)
    assert not path_resolves("kimi_mlx/prune/writer.py", here)
    for live in ("cluster.net.wire.PROTOCOL_VERSION", "wire.PROTOCOL_VERSION",
                 "engine_base.BaseEngine", "kimi_mlx.speculative.loop.Speculation",
                 "mlx_lm.generate"):
        assert any(name_resolves(c) for c in _candidates(live)), live
    for stale in ("cluster.api.ClusterEngine", "cluster.layer_bytes", "speculative.Speculation",
                  "kimi_mlx.cluster.wire.PROTOCOL_VERSION", "cluster.prompt_cache"):
        assert not any(name_resolves(c) for c in _candidates(stale)), stale
    assert _candidates("self.engine") is None and _candidates("np.float32") is None


def test_every_named_module_and_path_exists():
    bad = unresolved()
    assert not bad, f"{len(bad)} names/paths in the code's map do not resolve:\n" + "\n".join(bad)


def test_server_package_lists_every_module():
    """kimi_mlx/server/__init__.py's module list is complete: every module of the folder
    and nothing that is not there."""
    folder = ROOT / "kimi_mlx" / "server"
    listed = set(re.findall(r"(\w+)\.py", (folder / "__init__.py").read_text(encoding="utf-8")))
    have = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert listed == have, f"not listed: {sorted(have - listed)}; gone: {sorted(listed - have)}"


def test_cluster_process_table_names_every_role_module():
    """cluster/__init__.py's process table places every module of head/, node/ and tensor/
    in some process (its names are resolved by test_every_named_module_and_path_exists)."""
    doc = (ROOT / "cluster" / "__init__.py").read_text(encoding="utf-8")
    missing = [f"{role}.{p.stem}" for role in ("head", "node", "tensor")
               for p in (ROOT / "cluster" / role).glob("*.py")
               if p.stem != "__init__" and f"`{role}.{p.stem}" not in doc]
    assert not missing, f"modules in no process of cluster/__init__.py's table: {missing}"


def test_no_references_to_a_tracker_outside_the_repository():
    """Product code and docs say what the code does and why, not "issue N" of a tracker
    that is not in the repository; upstream trackers named with their project
    ("mlx-lm issue #1446", "ml-explore/mlx#4373") are fine."""
    pattern = re.compile(r"(?<![\w/-])(?<!mlx-lm )(?<!mlx )issues?\s*#?\d+", re.IGNORECASE)
    bad = [f"{path.relative_to(ROOT)}:{line}: {text.strip()[:80]}"
           for path, line, text in _texts() for _ in pattern.finditer(text)]
    assert not bad, "\n".join(bad)


if __name__ == "__main__":  # a listing for the sweep
    for row in unresolved():
        print(row)
