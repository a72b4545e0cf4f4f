"""The package's architecture, as written in pyproject.toml's [tool.importlinter]
contracts, and no import cycle anywhere.

The installed package maps `cluster/`, `prune/` and `metal/` to `kimi_mlx.cluster`,
`kimi_mlx.prune` and `kimi_mlx.metal`; import-linter (grimp) reads one folder per
package, so the test copies the sources into that shape first and lints the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kimi_mlx": "", "cluster": "cluster", "prune": "prune", "metal": "metal"}


def _lay_out(dst: Path) -> Path:
    """Copy every .py file into dst/kimi_mlx as Python sees the installed package."""
    for src, sub in FOLDERS.items():
        for f in (ROOT / src).rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            target = dst / "kimi_mlx" / sub / f.relative_to(ROOT / src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    shutil.copyfile(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return _lay_out(tmp_path_factory.mktemp("layout"))


def test_import_contracts_are_kept(tree):
    out = _lint(tree)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_a_broken_contract_names_the_offending_import(tmp_path):
    # A planted upward import (the model importing the server) must fail the lint,
    # naming both modules: the contracts are not vacuous.
    tree = _lay_out(tmp_path)
    (tree / "kimi_mlx" / "model" / "_planted.py").write_text("import kimi_mlx.server.app\n")
    out = _lint(tree)
    assert out.returncode != 0
    assert "kimi_mlx.model._planted -> kimi_mlx.server.app" in out.stdout


@pytest.mark.parametrize("planted, module, imported", [
    # a pipeline's head reaching into the tensor group: the roles share only cluster.net
    ("head", "kimi_mlx.cluster.head._planted", "kimi_mlx.cluster.tensor.group"),
    # the node daemon importing the head (the head's transport once imported the daemon)
    ("node", "kimi_mlx.cluster.node._planted", "kimi_mlx.cluster.head.transport"),
    # the shared wire layer importing a role above it
    ("net", "kimi_mlx.cluster.net._planted", "kimi_mlx.cluster.node.service"),
])
def test_a_broken_cluster_role_contract_names_the_import(tmp_path, planted, module, imported):
    tree = _lay_out(tmp_path)
    (tree / "kimi_mlx" / "cluster" / planted / "_planted.py").write_text(f"import {imported}\n")
    out = _lint(tree)
    assert out.returncode != 0
    assert f"{module} -> {imported}" in out.stdout


def _cycles(tree: Path):
    """Strongly connected components (size > 1) of the module import graph (grimp,
    imports inside functions included), by Tarjan's algorithm."""
    code = r"""
import sys, grimp
g = grimp.build_graph("kimi_mlx")
sys.setrecursionlimit(100000)
index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in g.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            out.append(sorted(comp))
for m in sorted(g.modules):
    if m not in index:
        visit(m)
print(len(g.modules))
for c in out:
    print(" ".join(c))
"""
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    return int(lines[0]), [l.split() for l in lines[1:]]


def test_no_import_cycles(tree):
    n, cycles = _cycles(tree)
    assert n > 100  # the whole package was seen, cluster/prune/metal included
    assert cycles == [], f"import cycles: {cycles}"


def test_a_planted_cycle_is_found(tmp_path):
    tree = _lay_out(tmp_path)
    (tree / "kimi_mlx" / "text" / "_a.py").write_text("from kimi_mlx.text import _b\n")
    (tree / "kimi_mlx" / "text" / "_b.py").write_text("from kimi_mlx.text import _a\n")
    _, cycles = _cycles(tree)
    assert ["kimi_mlx.text._a", "kimi_mlx.text._b"] in cycles
