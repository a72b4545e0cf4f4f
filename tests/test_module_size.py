"""Every product module stays under 700 lines (kimi_mlx/, cluster/, metal/, prune/; not the
generated gRPC stubs, nor kimi_mlx/assets/, which ships upstream files verbatim): a module
past that is split by responsibility into modules of its folder, as prune/writer.py
(build_plan.py), micro/train.py (train_modules.py, evaluation.py, publish.py) and
testing/check_real.py (check_kernels.py, check_report.py) were."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 700


def test_no_product_module_reaches_700_lines():
    sizes = {}
    for folder in ("kimi_mlx", "cluster", "metal", "prune"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if "assets" in rel.parts or "_pb2" in path.name:
                continue
            sizes[str(rel)] = len(path.read_text(encoding="utf-8").splitlines())
    assert len(sizes) > 150  # every folder was read
    over = {p: n for p, n in sorted(sizes.items()) if n >= LIMIT}
    assert not over, f"modules of {LIMIT}+ lines (split them by responsibility): {over}"
