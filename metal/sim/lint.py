"""A portability lint for Metal Shading Language kernel text: what Apple's Metal compiler
refuses but g++ (and so the emulator) accepts.

The emulator compiles kernel bodies as C++20 over metal_sim.h, so C++ that MSL forbids
would pass every emulator test and fail only on a Mac. MSL is C++14 with these removed
(Metal Shading Language Specification, section 1.4.4 "Metal Restrictions" in 2.x / 1.5.4
in 3.x; section 2.4 "Atomic Data Types"; section 4 "Address Spaces"):

| rule                 | flagged                                                          |
|----------------------|------------------------------------------------------------------|
| `double`             | the `double` type, `long double` (no 64-bit floating point)      |
| `recursion`          | a function that calls itself, directly or through others        |
| `function-pointer`   | `(*name)(...)` declarators and calls, `(*)(...)` types           |
| `dynamic-allocation` | `new`, `delete`, `malloc`, `calloc`, `realloc`, `free`, `alloca` |
| `address-space`      | a pointer or reference declaration (parameter, variable, cast)   |
|                      | without `device`, `constant`, `threadgroup` or `thread`          |
| `atomic-type`        | `atomic<T>` / `atomic_T` for T other than int, uint, bool, float |
| `exceptions`         | `throw`, `try`, `catch`, `noexcept`                              |
| `virtual`            | `virtual` functions                                              |
| `derived-class`      | `struct X : Base` / `class X : public Base`                      |
| `goto`               | `goto`                                                           |
| `lambda`             | lambda expressions `[...](...) {...}`                            |
| `storage-class`      | `register`, `thread_local`                                       |
| `rtti`               | `dynamic_cast`, `typeid`                                         |
| `std-library`        | `std::` names, `#include` of anything but `<metal_*>`           |

The lint works on tokens (a small C-like tokenizer: comments, string and character
literals, preprocessor lines and `[[attributes]]` are skipped), so names inside comments
or strings never count, and `a * b` is not a pointer: a `*` or `&` is a declarator only
after a type name (a builtin scalar, vector or matrix type, a `typename` template
parameter, a struct/class/typedef/using name of the same text) that starts a declaration
or a cast. Recursion is found on the call graph of the functions the text defines.

`lint(text, where)` returns `Finding`s with 1-based line numbers of `text`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

__all__ = ["Finding", "Token", "tokenize", "lint", "lint_file", "python_kernel_sources",
           "RULES"]

RULES = ("double", "recursion", "function-pointer", "dynamic-allocation", "address-space",
         "atomic-type", "exceptions", "virtual", "derived-class", "goto", "lambda",
         "storage-class", "rtti", "std-library")


@dataclass(frozen=True)
class Finding:
    """One construct the Metal compiler refuses: `where`:`line`: [`rule`] `message`."""

    rule: str
    line: int
    message: str
    where: str = "<kernel>"

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: [{self.rule}] {self.message}"


@dataclass(frozen=True)
class Token:
    kind: str  # "id", "num", "punct"
    text: str
    line: int


_TOKEN_RE = re.compile(
    r"""(?P<ws>[ \t\r\f\v]+)
      | (?P<nl>\n)
      | (?P<comment>//[^\n]*|/\*.*?\*/)
      | (?P<string>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
      | (?P<id>[A-Za-z_]\w*)
      | (?P<num>\.?\d(?:[\w.]|[eEpP][+-])*)
      | (?P<punct>::|->|<<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||\+\+|--|[-+*/%&|^!=<>]=|[^\s\w])
    """,
    re.S | re.X,
)


def tokenize(text: str) -> Tuple[List[Token], List[Tuple[int, str]]]:
    """(tokens, preprocessor lines as (line, text)). Comments, literals' contents and
    whitespace are dropped (a string literal becomes one "str" token); a preprocessor
    line (first non-blank character `#`, with its backslash continuations) is set aside."""
    tokens: List[Token] = []
    pp: List[Tuple[int, str]] = []
    line = 1
    pos = 0
    at_line_start = True
    n = len(text)
    while pos < n:
        if at_line_start:
            m = re.compile(r"[ \t]*#").match(text, pos)
            if m:
                end = pos
                while True:
                    nl = text.find("\n", end)
                    if nl < 0:
                        nl = n
                    if text[end:nl].rstrip().endswith("\\") and nl < n:
                        end = nl + 1
                        continue
                    break
                directive = text[pos:nl]
                pp.append((line, directive))
                line += directive.count("\n")
                pos = nl
                continue
        m = _TOKEN_RE.match(text, pos)
        if m is None:  # unreachable: the punct branch takes any other character
            pos += 1
            continue
        kind = m.lastgroup
        s = m.group(0)
        if kind == "nl":
            at_line_start = True
            line += 1
        elif kind in ("ws", "comment"):
            line += s.count("\n")
        else:
            at_line_start = False
            if kind == "string":
                tokens.append(Token("str", s[0], line))
            else:
                tokens.append(Token(kind, s, line))
        pos = m.end()
    return _drop_attributes(tokens), pp


def _drop_attributes(tokens: List[Token]) -> List[Token]:
    out: List[Token] = []
    i = 0
    while i < len(tokens):
        if tokens[i].text == "[" and i + 1 < len(tokens) and tokens[i + 1].text == "[":
            depth = 0
            j = i
            while j < len(tokens):
                if tokens[j].text == "[":
                    depth += 1
                elif tokens[j].text == "]":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            i = j + 1
            continue
        out.append(tokens[i])
        i += 1
    return out


_SCALARS = {
    "bool", "char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "half",
    "float", "bfloat", "void", "signed", "unsigned", "size_t", "ptrdiff_t",
    "int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t",
    "uint64_t", "float16_t", "bfloat16_t", "complex64_t", "auto", "double",
}
_VECTOR_RE = re.compile(
    r"^(?:packed_)?(?:bool|char|uchar|short|ushort|int|uint|long|ulong|half|float|bfloat)"
    r"[234](?:x[234])?$|^simdgroup_(?:float|half|bfloat)8x8$|^atomic_\w+$")
_TEMPLATE_TYPES = {"atomic", "vec", "array", "matrix", "simdgroup_matrix"}
ADDRESS_SPACES = {"device", "constant", "threadgroup", "thread", "threadgroup_imageblock",
                  "ray_data", "object_data"}
_QUALIFIERS = ADDRESS_SPACES | {"const", "volatile", "static", "constexpr", "inline",
                                "METAL_FUNC", "typename"}
_DECL_START = {None, "(", ",", ";", "{", "}", "<", ":"}
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "catch", "alignof",
             "decltype", "static_assert", "static_cast", "reinterpret_cast", "const_cast",
             "dynamic_cast", "else", "do", "case", "template"}
ATOMIC_OK = {"int", "uint", "bool", "float", "int32_t", "uint32_t"}


def _declared_types(tokens: Sequence[Token]) -> Set[str]:
    """typename template parameters and struct/class/union/enum/typedef/using names."""
    names: Set[str] = set()
    for i, t in enumerate(tokens[:-1]):
        nxt = tokens[i + 1]
        if t.text in ("typename", "class", "struct", "union", "enum") and nxt.kind == "id":
            names.add(nxt.text)
        if t.text == "using" and nxt.kind == "id" and i + 2 < len(tokens) \
                and tokens[i + 2].text == "=":
            names.add(nxt.text)
    for i, t in enumerate(tokens):  # typedef ... NAME ;
        if t.text == "typedef":
            j = i
            while j < len(tokens) and tokens[j].text != ";":
                j += 1
            if tokens[j - 1].kind == "id":
                names.add(tokens[j - 1].text)
    return names


def _is_type(tok: Token, types: Set[str]) -> bool:
    return tok.kind == "id" and (tok.text in _SCALARS or tok.text in types
                                 or bool(_VECTOR_RE.match(tok.text)))


def _matching_open(tokens: Sequence[Token], close: int, open_: str, close_: str) -> int:
    depth = 0
    for j in range(close, -1, -1):
        if tokens[j].text == close_:
            depth += 1
        elif tokens[j].text == open_:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _type_start(tokens: Sequence[Token], i: int, types: Set[str]) -> int:
    """Index of the type name that the declarator at i (`*` / `&`) follows, or -1."""
    p = i - 1
    while p >= 0 and tokens[p].text in ("*", "&", "const", "volatile") + tuple(ADDRESS_SPACES):
        p -= 1  # T * const *, T device* (qualifiers after the type)
    if p < 0:
        return -1
    if tokens[p].text == ">":
        o = _matching_open(tokens, p, "<", ">")
        if o > 0 and tokens[o - 1].kind == "id" and (
                tokens[o - 1].text in _TEMPLATE_TYPES or tokens[o - 1].text in types):
            return o - 1
        return -1
    return p if _is_type(tokens[p], types) else -1


def _address_spaced_declarator(tokens: Sequence[Token], i: int,
                               types: Set[str]) -> Optional[bool]:
    """For `*`/`&` at i: None if not a declarator; else whether an address space
    qualifies it."""
    start = _type_start(tokens, i, types)
    if start < 0:
        return None
    quals = {t.text for t in tokens[start:i]}
    q = start - 1
    while q >= 0:
        t = tokens[q].text
        if t in _QUALIFIERS:
            quals.add(t)
            q -= 1
        elif t == "::" and q >= 1 and tokens[q - 1].kind == "id":
            q -= 2  # metal::float4
        else:
            break
    before = tokens[q].text if q >= 0 else None
    if before not in _DECL_START and before not in ("return",):
        return None
    if before == "return":
        return None
    return bool(quals & ADDRESS_SPACES)


def _functions(tokens: Sequence[Token]) -> Dict[str, Tuple[int, int, int]]:
    """{name: (line, body start, body end)} of function definitions at brace depth 0."""
    out: Dict[str, Tuple[int, int, int]] = {}
    depth = 0
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.text == "{":
            depth += 1
        elif t.text == "}":
            depth -= 1
        elif depth == 0 and t.kind == "id" and t.text not in _KEYWORDS \
                and i + 1 < len(tokens) and tokens[i + 1].text == "(":
            # name ( ... ) [const|thread|...] {
            close = i + 1
            d = 0
            while close < len(tokens):
                if tokens[close].text == "(":
                    d += 1
                elif tokens[close].text == ")":
                    d -= 1
                    if d == 0:
                        break
                close += 1
            j = close + 1
            while j < len(tokens) and tokens[j].kind == "id" and tokens[j].text in (
                    "const", "thread", "device", "constant", "threadgroup", "noexcept"):
                j += 1
            if j < len(tokens) and tokens[j].text == "{" and (
                    i == 0 or tokens[i - 1].text not in (".", "->", "=")):
                body_end = j
                d = 0
                while body_end < len(tokens):
                    if tokens[body_end].text == "{":
                        d += 1
                    elif tokens[body_end].text == "}":
                        d -= 1
                        if d == 0:
                            break
                    body_end += 1
                out.setdefault(t.text, (t.line, j, body_end))
                i = body_end + 1
                continue
        i += 1
    return out


def _recursion(tokens: Sequence[Token]) -> List[Tuple[int, str]]:
    funcs = _functions(tokens)
    calls: Dict[str, List[Tuple[str, int]]] = {}
    for name, (_, a, b) in funcs.items():
        calls[name] = [(tokens[k].text, tokens[k].line) for k in range(a, b)
                       if tokens[k].kind == "id" and tokens[k].text in funcs
                       and k + 1 < len(tokens) and tokens[k + 1].text in ("(", "<")
                       and tokens[k - 1].text not in (".", "->")]
    found: List[Tuple[int, str]] = []
    cycles: Set[frozenset] = set()
    for name in funcs:
        # a call path from `name` back to `name`?
        stack = [(callee, line, [name, callee]) for callee, line in reversed(calls[name])]
        seen: Set[str] = set()
        while stack:
            callee, line, path = stack.pop()
            if callee == name:
                cycle = frozenset(path)
                if cycle not in cycles:  # a cycle of several functions once, at its first
                    cycles.add(cycle)
                    found.append((line, f"recursive call: {' -> '.join(path)}"))
                break
            if callee in seen:
                continue
            seen.add(callee)
            stack.extend((c, line, path + [c]) for c, _ in reversed(calls.get(callee, [])))
    return found


def lint(text: str, where: str = "<kernel>") -> List[Finding]:
    """Findings for MSL text (a kernel body, a header, a whole `.metal` file), sorted by
    line. An empty list means nothing the lint knows Metal to refuse."""
    tokens, pp = tokenize(text)
    types = _declared_types(tokens)
    out: List[Finding] = []

    def add(rule: str, line: int, msg: str) -> None:
        out.append(Finding(rule, line, msg, where))

    for line, directive in pp:
        m = re.match(r"\s*#\s*include\s*(\S+)", directive)
        if m and not re.fullmatch(r"<metal_\w+>", m.group(1)):
            add("std-library", line, f"#include {m.group(1)}: only Metal's <metal_*> "
                                     "headers exist on the device")
    n = len(tokens)
    for i, t in enumerate(tokens):
        prev = tokens[i - 1] if i > 0 else None
        nxt = tokens[i + 1] if i + 1 < n else None
        x = t.text
        if t.kind == "id":
            if x == "double":
                if prev is not None and prev.text == "long":
                    add("double", t.line, "`long double`: Metal has no 64-bit or wider float")
                else:
                    add("double", t.line, "`double`: Metal has no 64-bit float")
            elif x in ("new", "delete"):
                add("dynamic-allocation", t.line, f"`{x}`: no dynamic allocation in Metal")
            elif x in ("malloc", "calloc", "realloc", "free", "alloca") and nxt is not None \
                    and nxt.text == "(" and (prev is None or prev.text not in (".", "->")):
                add("dynamic-allocation", t.line, f"`{x}()`: no dynamic allocation in Metal")
            elif x in ("throw", "try", "catch", "noexcept"):
                add("exceptions", t.line, f"`{x}`: Metal has no exceptions")
            elif x == "virtual":
                add("virtual", t.line, "`virtual`: Metal has no virtual functions")
            elif x == "goto":
                add("goto", t.line, "`goto`: not in Metal")
            elif x in ("register", "thread_local"):
                add("storage-class", t.line, f"`{x}`: not a Metal storage class")
            elif x in ("dynamic_cast", "typeid"):
                add("rtti", t.line, f"`{x}`: Metal has no run-time type information")
            elif x == "std" and nxt is not None and nxt.text == "::":
                add("std-library", t.line, "`std::`: the C++ standard library is not "
                                           "available in Metal (use metal::)")
            elif x in ("struct", "class") and nxt is not None and nxt.kind == "id" \
                    and i + 2 < n and tokens[i + 2].text == ":":
                add("derived-class", t.line, f"`{x} {nxt.text} : ...`: Metal has no "
                                             "derived classes")
            elif x == "atomic" and nxt is not None and nxt.text == "<":
                close = i + 2
                while close < n and tokens[close].text != ">":
                    close += 1
                arg = " ".join(tk.text for tk in tokens[i + 2:close])
                if arg not in ATOMIC_OK:
                    add("atomic-type", t.line, f"`atomic<{arg}>`: Metal atomics are int, "
                                               "uint, bool and float only")
            elif x.startswith("atomic_") and _VECTOR_RE.match(x) and \
                    x[len("atomic_"):] not in ATOMIC_OK and not x.endswith("_explicit") \
                    and x not in ("atomic_thread_fence",):
                add("atomic-type", t.line, f"`{x}`: Metal atomics are int, uint, bool and "
                                           "float only")
        elif x == "(" and nxt is not None and nxt.text == "*":
            # (*name)(  or  (*)(  : a function pointer declarator, type or call
            j = i + 2
            if j < n and tokens[j].kind == "id":
                j += 1
            if j + 1 < n and tokens[j].text == ")" and tokens[j + 1].text == "(":
                add("function-pointer", t.line, "function pointer: not in Metal kernels")
        elif x == "[" and (prev is None or (prev.kind not in ("id", "num", "str")
                                            and prev.text not in ("]", ")"))):
            close = i
            d = 0
            while close < n:
                if tokens[close].text == "[":
                    d += 1
                elif tokens[close].text == "]":
                    d -= 1
                    if d == 0:
                        break
                close += 1
            if close + 1 < n and tokens[close + 1].text in ("(", "{"):
                add("lambda", t.line, "lambda expression: not in Metal")
        elif x in ("*", "&"):
            spaced = _address_spaced_declarator(tokens, i, types)
            if spaced is False:
                kind = "pointer" if x == "*" else "reference"
                add("address-space", t.line,
                    f"{kind} without an address space (device, constant, threadgroup or "
                    "thread)")
    for line, msg in _recursion(tokens):
        add("recursion", line, msg + ": Metal has no recursion")
    return sorted(out, key=lambda f: (f.line, f.rule))


def lint_file(path: Path) -> List[Finding]:
    """`lint` of a file's text, findings named by the path."""
    path = Path(path)
    return lint(path.read_text(), str(path))


def python_kernel_sources(path: Path) -> List[Tuple[str, int, str]]:
    """Kernel source strings in a Python file: the `source` and `header` arguments
    (keyword, or positional 4th / 5th) of every call to a function named `metal_kernel`
    that are string constants or module-level string constants.

    Returns:
        [(what, first line in the file, text)], what = "<file>:<call line> <argument>".
    """
    path = Path(path)
    tree = ast.parse(path.read_text(), str(path))
    consts: Dict[str, ast.Constant] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    consts[target.id] = node.value
    found: List[Tuple[str, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if fname != "metal_kernel":
            continue
        args: List[Tuple[str, ast.AST]] = []
        for pos, label in ((3, "source"), (4, "header")):
            if len(node.args) > pos:
                args.append((label, node.args[pos]))
        args += [(kw.arg, kw.value) for kw in node.keywords if kw.arg in ("source", "header")]
        for label, value in args:
            if isinstance(value, ast.Name) and value.id in consts:
                value = consts[value.id]
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append((f"{path}:{node.lineno} {label}", value.lineno, value.value))
    return found


def lint_python(path: Path) -> List[Finding]:
    """`lint` of every kernel source string in a Python file, with the file's lines."""
    out: List[Finding] = []
    for what, first, text in python_kernel_sources(path):
        for f in lint(text, what):
            out.append(Finding(f.rule, first + f.line - 1, f.message, what))
    return out


def lint_all(paths: Iterable[Path]) -> List[Finding]:
    """Findings over `.metal` files and the kernel strings of `.py` files."""
    out: List[Finding] = []
    for p in paths:
        p = Path(p)
        out += lint_python(p) if p.suffix == ".py" else lint_file(p)
    return out
