"""Content hashes of the fit and placement artifacts on fixed seeds, through the `eldr` CLI.

A refactoring must leave them unchanged: run this before and after and compare the lines
(the manifest's ``content_hash`` covers the arrays and tables, not the figures or timings).

    PYTHONPATH=$PWD .venv/bin/python -m tools.artifact_hashes > /tmp/before.txt
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from eldr_cli.artifacts.store import read_manifest

STEPS = [
    ("trace", ["synth-trace", "--requests", "400", "--layers", "12", "--experts", "32", "--top-k", "4",
               "--decode-steps", "32", "--picks", "--seed", "7"]),
    ("fit", ["fit", "--trace", "{trace}", "--decoders", "4", "--pairs", "3000", "--seed", "1", "--no-figures"]),
    ("vanilla", ["fit", "--trace", "{trace}", "--decoders", "4", "--pairs", "3000", "--seed", "2", "--vanilla",
                 "--no-figures"]),
    ("placement", ["place-experts", "--trace", "{trace}", "--routing", "{fit}", "--ep-size", "4",
                   "--batch-size", "8", "--no-figures"]),
    ("placement-eval", ["place-experts", "evaluate", "--trace", "{trace}", "--routing", "{fit}",
                        "--placement", "{placement}", "--batch-size", "8"]),
]


def artifact_hashes(root: Path) -> dict[str, str]:
    """Run the steps into ``root``; {artifact name: content_hash} (and the fit's sub-artifacts)."""
    paths = {name: str(root / name) for name, _ in STEPS}
    out: dict[str, str] = {}
    for name, args in STEPS:
        argv = [sys.executable, "-m", "eldr_cli", *(a.format(**paths) for a in args), "--out", paths[name]]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        out[name] = read_manifest(paths[name])["content_hash"]
        for sub in ("idf", "layers", "routing"):
            if (Path(paths[name]) / sub / "manifest.json").is_file():
                out[f"{name}/{sub}"] = read_manifest(Path(paths[name]) / sub)["content_hash"]
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        for name, digest in artifact_hashes(Path(d)).items():
            print(f"{name:24s} {digest}")


if __name__ == "__main__":
    main()
