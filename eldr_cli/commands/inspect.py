"""`eldr inspect DIR`: print and validate any artifact."""

from __future__ import annotations

from pathlib import Path

import typer


def inspect_cmd(
    path: Path = typer.Argument(..., help="Artifact directory (contains manifest.json)."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Re-hash files against the manifest."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Print an artifact's manifest, arrays and tables, and validate it against its JSON Schema."""
    import json

    from eldr_cli.artifacts.store import ARRAYS, Artifact
    from eldr_cli.console import console, table
    from eldr_cli.errors import EldrError

    art = Artifact(path, verify=False)  # inspect reports every difference itself
    problems = art.verify() if verify else []
    if as_json:
        console.print_json(json.dumps(art.manifest))
    else:
        m = art.manifest
        console.print(f"[bold]{m['kind']}[/] artifact v{m['schema_version']}  {path}")
        console.print(f"  created {m['created']} by eldr {m['tool_version']}; content {m['content_hash'][:16]}")
        t = table("name", "value", title="parameters", show_header=False, box=None, numeric_from=2)
        for k, v in m["params"].items():
            t.add_row(k, _short(v))
        console.print(t)
        if m["inputs"]:
            t = table("name", "path", "content hash", title="inputs", numeric_from=3)
            for k, v in m["inputs"].items():
                t.add_row(k, v["path"], v["content_hash"][:16])
            console.print(t)
        if problems:  # a damaged artifact: say what differs before reading any of its data
            raise EldrError(f"{path} fails verification: " + "; ".join(problems[:5]),
                            hint="rebuild it with the stage that wrote it")
        zdir = art.path / ARRAYS
        if zdir.exists():
            t = table("name", "shape", "dtype", title="arrays", numeric_from=3)
            g = art._zgroup()
            for name in sorted(g.array_keys()):
                a = g[name]
                t.add_row(name, str(tuple(a.shape)), str(a.dtype))
            console.print(t)
        tables = sorted(art.path.glob("*.parquet"))
        if tables:
            import polars as pl

            t = table("name", "rows", "columns", title="tables", numeric_from=3)
            for f in tables:
                lf = pl.scan_parquet(f)
                cols = lf.collect_schema().names()
                t.add_row(f.stem, str(lf.select(pl.len()).collect().item()), ", ".join(cols))
            console.print(t)
        figs = sorted(p.name for p in art.path.rglob("*.png"))
        if figs:
            console.print("figures: " + ", ".join(figs))
        t = table("name", "value", title="metrics", show_header=False, box=None, numeric_from=2)
        for k, v in m["metrics"].items():
            t.add_row(k, _short(v))
        console.print(t)
    if problems:
        raise EldrError(f"{path} fails verification: " + "; ".join(problems[:5]))
    if not as_json:
        console.print("[green]valid[/]: manifest matches its schema"
                      + (" and files match their hashes" if verify else ""))


def _short(v, n: int = 120) -> str:
    s = str(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
