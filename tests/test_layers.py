"""The packages depend one way (docs/ARCHITECTURE.md): every import, at module level or
inside a function, goes from a higher layer to a lower one, so there is no cycle. Read from
the source with ast, so a lazy import cannot hide one."""
from __future__ import annotations

import ast
from pathlib import Path

import specee_cpp

PKG = Path(specee_cpp.__file__).parent
# lowest first; an import may only point to a strictly lower rank (speculative and
# early_exit share one, so neither may import the other; spec_ee, their combination, sits
# above both)
RANK = {"errors": 0, "config": 1, "paths": 1, "records": 1, "text": 1, "mlp": 1, "memory": 1, "models": 2,
        "bindings": 3, "provenance": 4, "engine": 5, "crash_probe": 5, "speculative": 6,
        "early_exit": 6, "spec_ee": 7, "bench": 8, "server": 8, "doctor": 8, "cli": 9,
        "__init__": 10}


def unit(path: Path, root: Path = PKG) -> str:
    """A module's layer: its sub-package, or the top-level module's name."""
    return path.relative_to(root).with_suffix("").parts[0]


def imports(path: Path, root: Path = PKG) -> set[str]:
    """The layers a file imports from."""
    parts = path.relative_to(root).with_suffix("").parts
    package = ["specee_cpp", *parts[:-1]]   # the package a relative import starts from
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[0] != "specee_cpp":
                continue
            if len(target) > 1:
                out.add(target[1])
            else:  # from specee_cpp import x
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names
                       if a.name.startswith("specee_cpp."))
    return out


def edges() -> set[tuple[str, str, str]]:
    return {(unit(f), dst, str(f.relative_to(PKG))) for f in PKG.rglob("*.py")
            for dst in imports(f) if dst != unit(f)}


def test_every_module_has_a_layer():
    units = {unit(f) for f in PKG.rglob("*.py")}
    assert units <= set(RANK), units - set(RANK)


def test_imports_point_down_the_layers():
    up = sorted(f"{where} imports {dst}" for src, dst, where in edges()
                if RANK[dst] >= RANK[src])
    assert not up, up


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself can fail: an engine module importing speculative, lazily, is caught."""
    root = tmp_path / "specee_cpp"
    (root / "engine").mkdir(parents=True)
    fake = root / "engine" / "llm.py"
    fake.write_text("import numpy\n\ndef f():\n    from ..speculative import mode\n"
                    "    from specee_cpp.bench.record import Record\n")
    assert unit(fake, root) == "engine" and imports(fake, root) == {"speculative", "bench"}
    assert all(RANK[dst] >= RANK["engine"] for dst in imports(fake, root))
