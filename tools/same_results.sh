#!/usr/bin/env bash
# Same inputs, two checkouts: compare artifact content hashes of fit, place, simulate and replay.
# usage: same_results.sh OLD_TREE NEW_TREE   (SAME_DIR: where the two runs go, default /tmp)
set -euo pipefail
D=${SAME_DIR:-/tmp}
run() {  # tree outdir
  local T=$1 O=$2; rm -rf "$O"; mkdir -p "$O"
  ( cd "$T" && export PYTHONPATH=$T
    E=".venv/bin/eldr"
    $E synth-trace --out "$O/trace" --requests 300 --layers 8 --experts 32 --top-k 2 --seed 3 --picks >/dev/null
    $E fit --trace "$O/trace" --decoders 4 --out "$O/fit" --pairs 3000 --seed 0 >/dev/null
    $E place-experts --trace "$O/trace" --routing "$O/fit" --ep-size 4 --out "$O/place" >/dev/null
    .venv/bin/python - "$O" <<'PY'
import sys, json
from pathlib import Path
from eldr_cli.costmodel import CostModel
from eldr_cli.costmodel import write_cost_model
o = Path(sys.argv[1])
write_cost_model(o / "cost", CostModel(a_ms=0.2, b_ms=0.5, c_ms=0.05, source="given"))
from eldr_cli.pipeline.simulate import run_simulate
run_simulate(o / "sim", trace=o / "trace", cost_model=o / "cost", routing=o / "fit", split="all",
             routers=["round-robin", "jsq", "p2c", "eldr", "domain", "oracle"], rates=[30.0], n_prefill=1,
             n_decode=4, duration_s=6, warmup_s=1, max_tokens=16, seed=2)
PY
    $E bench replay --trace "$O/trace" --routing "$O/fit" --out "$O/replay" --split all >/dev/null 2>&1 || echo "replay cli differs" )
}
run "$1" "$D/same-old"; run "$2" "$D/same-new"
for f in requests.parquet steps.parquet; do  # the sim's summary carries its wall time: compare its tables
  a=$(sha256sum $D/same-old/sim/$f | cut -c1-16); b=$(sha256sum $D/same-new/sim/$f | cut -c1-16)
  echo "sim/$f old=$a new=$b $([ "$a" = "$b" ] && echo SAME || echo DIFFERENT)"
done
for a in trace fit/idf fit/layers fit/routing place replay; do
  h1=$(python3 -c "import json;print(json.load(open('$D/same-old/$a/manifest.json')).get('content_hash'))" 2>/dev/null || echo none)
  h2=$(python3 -c "import json;print(json.load(open('$D/same-new/$a/manifest.json')).get('content_hash'))" 2>/dev/null || echo none)
  echo "$a old=$h1 new=$h2 $([ "$h1" = "$h2" ] && echo SAME || echo DIFFERENT)"
done
