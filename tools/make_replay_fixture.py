"""Write the GENERATED replay fixture `make gpu-check` runs as Llama-4-Maverick's MoE layers on a GPU.

A synthetic trace of Maverick's MoE shape (24 MoE layers, 128 experts, top-1; 400 requests of 32 decode steps,
seed 0; GENERATED, not a captured model's routing), a routing artifact fitted on it (K decoders) and, for each
policy at each batch size, the closed-loop replay record of `eldr bench replay` (which request decodes which
step on which decoder). Saved as one compressed .npz of numpy arrays, because a GPU machine's bare python3 has
neither polars nor zarr to read artifacts. `tests/test_gpu_check_cpu.py` rebuilds it and checks it is this file.

    python -m tools.make_replay_fixture [--out tests/data/replay_maverick_generated.npz]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "replay_maverick_generated.npz"
POLICIES = ("round-robin", "random", "jsq", "p2c", "domain", "eldr")
BATCHES = (64,)
K = 2


class Recorder:
    """The ``measure`` hook of run_replay that keeps each (policy, batch size) record instead of timing it."""

    def __init__(self):
        self.recs: list[dict] = []

    def __call__(self, trace, rec):
        self.recs.append(rec)

    def facts(self) -> dict:
        return {}


def build(work: Path) -> dict[str, np.ndarray]:
    """The fixture's arrays (see the module docstring), built in ``work``."""
    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.main import run
    from eldr_cli.pipeline.replay import run_replay

    t, f = work / "trace", work / "fit"
    assert run(["synth-trace", "--out", str(t), "--requests", "400", "--layers", "24", "--experts", "128",
                "--top-k", "1", "--decode-steps", "32", "--picks", "--seed", "0"]) == 0
    assert run(["fit", "--trace", str(t), "--decoders", str(K), "--out", str(f), "--no-figures"]) == 0
    rec = Recorder()
    res = run_replay(t, routing=f, policies=list(POLICIES), batch_sizes=BATCHES, split="all", seed=0, measure=rec)
    tr = read_trace(t, with_picks=True)
    assert tr.decode_picks is not None and tr.decode_offsets is not None
    out: dict[str, np.ndarray] = {"decode_picks": np.asarray(tr.decode_picks, dtype=np.int16),
                                  "decode_offsets": np.asarray(tr.decode_offsets, dtype=np.int64),
                                  "prompt_tokens": np.asarray(tr.prompt_tokens, dtype=np.int32),
                                  "num_layers": np.asarray(tr.num_layers), "num_experts": np.asarray(tr.num_experts),
                                  "top_k": np.asarray(tr.top_k), "n_decoders": np.asarray(K)}
    names = []
    for r, record in zip(res["results"], rec.recs, strict=True):
        name = f"{r['policy']}@{r['batch_size']}"
        names.append(name)
        for k in ("step", "decoder", "request", "request_step"):
            out[f"{name}:{k}"] = np.asarray(record[k], dtype=np.int32)
        out[f"{name}:drained_step"] = np.asarray(record["drained_step"], dtype=np.int64)
    out["policies"] = np.asarray(names)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(FIXTURE))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        arrays = build(Path(d))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)  # type: ignore[arg-type]
    print(f"-> {args.out} ({Path(args.out).stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
