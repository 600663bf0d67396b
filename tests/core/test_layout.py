"""The package's rooms and the one direction their imports point.

From the bottom: ``moe`` ops, ``passes`` and ``generated_classes`` (torch only), the core
(``simplefsdp/*.py``), the ``models``, the ``baselines``, the training app ``train``. A module may import its own room and
rooms below it; the core reaches the passes through their package only (the compile hook).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK = {"moe": 0, "passes": 0, "generated_classes": 0, "core": 1, "models": 2, "baselines": 3, "train": 4}


def _room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "passes" or parts[:2] == ["simplefsdp", "passes"]:
        return "passes"
    if len(parts) > 1 and parts[1] in RANK:
        return parts[1]
    return "core"


def _modules():
    for folder, package in (("simplefsdp", "simplefsdp"), ("passes", "simplefsdp.passes")):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, f), os.path.join(REPO, folder))
                    name = ".".join([package, *rel[:-3].split(os.sep)]).removesuffix(".__init__")
                    yield name, os.path.join(root, f)


def _imports(path: str):
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_imports_point_down():
    wrong = []
    for name, path in _modules():
        room = _room(name)
        for target, names in _imports(path):
            if not target.startswith("simplefsdp"):
                continue
            for t in [target] if target != "simplefsdp" else [f"simplefsdp.{n}" for n in names]:
                to = _room(t)
                if room == "passes" and to != "passes":
                    wrong.append(f"{name}: the passes import only torch and each other, not {t}")
                elif room != "passes" and to == "passes" and t != "simplefsdp.passes":
                    wrong.append(f"{name}: only the passes' package is the hook, not {t}")
                elif RANK[to] > RANK[room]:
                    wrong.append(f"{name} ({room}) imports {t} ({to}), a room above it")
    assert not wrong, "\n".join(wrong)


def test_plain_checkout_imports_the_library_only():
    """``import simplefsdp`` with only the checkout and torch on the path: no install, no .pth files."""
    import torch

    path = os.pathsep.join([REPO, os.path.dirname(os.path.dirname(torch.__file__))])
    code = (
        "import sys, simplefsdp\n"
        "print(simplefsdp.passes.__file__)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('simplefsdp'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd="/", env={**os.environ, "PYTHONPATH": path},
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert out[0] == os.path.join(REPO, "passes", "__init__.py")
    loaded = out[1].split()
    assert "simplefsdp.wrap" in loaded and "simplefsdp.passes.fsdp_bucketing" in loaded
    assert not [m for m in loaded if _room(m) in ("models", "baselines", "train")], loaded
