"""The import layers docs/architecture.md draws (issue 36, item 6): no import from a lower layer to a higher
one and no import circle in ``eldr_cli``. Imports are read with ``ast`` from every module, at module level,
inside functions and under ``TYPE_CHECKING`` alike (a type from above is a dependency on above)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
MARK = "<!-- import layers:"

# edges left in a circle on purpose; each must still exist and still close a circle (a stale entry fails, so the
# list stays true)
KNOWN: dict[tuple[str, str], str] = {}  # none today (the last, CostModel.load -> roofline, became a registration)


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file for every .py under ``root/eldr_cli`` (through the kernels link too)."""
    out = {}
    for d, _, files in os.walk(root / "eldr_cli", followlinks=True):
        for f in files:
            if f.endswith(".py"):
                parts = list(Path(d, f).relative_to(root).with_suffix("").parts)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = Path(d, f)
    return out


def imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The ``eldr_cli`` modules ``name`` imports anywhere in its file -> the first line that does."""
    found: dict[str, int] = {}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pkg import sub` imports the module pkg.sub; `from mod import name` the module mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import eldr_cli.x.y` where y is a name: its module
                t = t.rpartition(".")[0]
            if t.startswith("eldr_cli") and t != name:
                found.setdefault(t, node.lineno)
    return found


def graph(root: Path) -> dict[str, dict[str, int]]:
    mods = modules(root)
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def package(module: str) -> str:
    """The top-level package (or module) of ``eldr_cli`` a module belongs to; ``eldr_cli`` for its __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "eldr_cli"


def read_layers(text: str) -> dict[str, int]:
    """Package -> layer (0 = the bottom) from the block after the marker: one line per layer, top first,
    ``name pkg pkg ...``."""
    block = text[text.index(MARK):]
    body = re.search(r"```text\n(.*?)```", block, re.S)
    assert body, f"no ```text block after {MARK!r} in {DOC}"
    lines = [ln.split() for ln in body.group(1).splitlines() if ln.strip()]
    layers: dict[str, int] = {}
    for i, (_, *pkgs) in enumerate(reversed(lines)):
        for p in pkgs:
            assert p not in layers, f"{p} is on two lines of the layer block"
            layers[p] = i
    return layers


def upward(g: dict[str, dict[str, int]], layers: dict[str, int]) -> list[tuple[str, str, int]]:
    """Every import from a lower layer to a higher one: (importer, imported, line)."""
    return sorted((a, b, line) for a, bs in g.items() for b, line in bs.items()
                  if layers[package(b)] > layers[package(a)])


def circles(g: dict[str, dict[str, int]], allowed: set[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), ``allowed`` edges left out."""
    edges = {a: [b for b in bs if (a, b) not in allowed and b in g] for a, bs in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the longest import chain (tens)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


G = graph(ROOT)
LAYERS = read_layers(DOC.read_text())


def test_every_package_is_on_one_line_of_the_drawing():
    have = {package(m) for m in G}
    assert not have - set(LAYERS), f"packages on no line of the layer block in {DOC.name}: {sorted(have - set(LAYERS))}"
    assert not set(LAYERS) - have, f"lines name packages that do not exist: {sorted(set(LAYERS) - have)}"


def test_no_import_goes_up_a_layer():
    bad = [f"{a} (line {line}) imports {b}: {package(a)} is below {package(b)}" for a, b, line in upward(G, LAYERS)]
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_no_import_circles_but_the_named_ones():
    stale = [e for e in KNOWN if e[1] not in G.get(e[0], {})]
    assert not stale, f"known circle edges that no longer exist (remove them from KNOWN): {stale}"
    assert circles(G, set(KNOWN)) == []
    groups = circles(G)  # each named edge still closes a circle (KNOWN is no blanket for edges that do not)
    loose = [e for e in KNOWN if not any(e[0] in g and e[1] in g for g in groups)]
    assert not loose, f"known circle edges no longer in a circle (remove them from KNOWN): {loose}"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_check_fails_on_a_new_upward_import_and_a_new_circle(tmp_path):
    """A synthetic tree: costmodel (low) reaching into proxy (high) from inside a function, under
    TYPE_CHECKING and through a relative import; two costmodel modules importing each other in functions."""
    _write(tmp_path, {
        "eldr_cli/__init__.py": "",
        "eldr_cli/errors.py": "class EldrError(Exception): ...\n",
        "eldr_cli/costmodel/__init__.py": "from eldr_cli.errors import EldrError\n",
        "eldr_cli/costmodel/lazy.py": "def f():\n    from eldr_cli.proxy.app import App\n    return App\n",
        "eldr_cli/costmodel/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from ..proxy import app\n",
        "eldr_cli/costmodel/a.py": "def f():\n    from eldr_cli.costmodel import b\n",
        "eldr_cli/costmodel/b.py": "def g():\n    import eldr_cli.costmodel.a\n",
        "eldr_cli/proxy/__init__.py": "",
        "eldr_cli/proxy/app.py": "from eldr_cli.costmodel import EldrError\nclass App: ...\n",
    })
    layers = read_layers(f"{MARK} -->\n```text\nserving proxy\nmodels costmodel\nbase eldr_cli errors\n```\n")
    g = graph(tmp_path)
    assert upward(g, layers) == [("eldr_cli.costmodel.lazy", "eldr_cli.proxy.app", 2),
                                 ("eldr_cli.costmodel.typed", "eldr_cli.proxy.app", 3)]
    assert circles(g) == [["eldr_cli.costmodel.a", "eldr_cli.costmodel.b"]]
    assert circles(g, {("eldr_cli.costmodel.b", "eldr_cli.costmodel.a")}) == []
    # the same tree without the two bad imports passes
    _write(tmp_path, {"eldr_cli/costmodel/lazy.py": "def f():\n    return None\n",
                      "eldr_cli/costmodel/typed.py": "", "eldr_cli/costmodel/b.py": ""})
    g = graph(tmp_path)
    assert upward(g, layers) == [] and circles(g) == []
