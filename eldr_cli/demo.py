"""`make demo`: the whole pipeline on an embedded default.

Until capture, the emulated cluster and bench exist, the demo fits a GENERATED trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="eldr-demo")
    ap.add_argument("--out", default="artifacts/demo")
    args = ap.parse_args(argv)
    out = Path(args.out)
    from eldr_cli.main import run

    steps = [
        ["synth-trace", "--out", str(out / "trace"), "--requests", "1000", "--layers", "24", "--experts", "64",
         "--top-k", "4"],
        ["fit", "--trace", str(out / "trace"), "--decoders", "8", "--out", str(out / "fit")],
        ["inspect", str(out / "fit" / "routing")],
    ]
    for s in steps:
        print("$ eldr " + " ".join(s), flush=True)
        rc = run(s)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
