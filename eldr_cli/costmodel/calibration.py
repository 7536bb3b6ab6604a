"""The roofline's constants measured on GPUs, shipped as package data (``eldr_cli/data/gpu/``).

``calibration.json`` holds, per device preset with a measurement: the achieved fraction of nominal HBM
bandwidth for expert-weight reads and for KV reads, the achieved fraction of peak tensor FLOP/s, the fixed
cost of one MoE layer per measured shape (model, TP, dtype) and of one decode-attention layer. They were
fitted (``tools/fit_gpu_calibration.py``: least maximal relative error over every row with batch >= 8) to
the tables beside it, copied unchanged from the measurements' source (``SOURCE``). A device without a
measurement gets no calibration here and the roofline says so (see :func:`calibration_for`;
the roofline's constants for a device, measured or not: :func:`eldr_cli.costmodel.roofline.calibrated`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
SOURCE = ("MEASURED 2026-11-26 on one NVIDIA H100 80GB HBM3 and one NVIDIA H200, torch 2.11.0+cu130, CUDA-event "
          "medians of CUDA-graph replays (eldr shared/data/gpu: gpu_check3.py, gpu_check4.py, gpu_check5.py); "
          "H200 decode attention MEASURED 2026-11-27 by make gpu-check")
# measured table -> the (model, TP, dtype) shapes of its rows: moe rows are (shape key, batch, active, ms)
MOE_TABLES = {"H100-SXM": ("h100_moe_layer_graph.json", "h100_maverick_tp8_rank.json"),
              "H200": ("h200_moe_layer_graph.json",)}
ATTENTION_TABLES = {"H100-SXM": "h100_decode_attention.json", "H200": "h200_decode_attention.json"}
MIN_BATCH = 8  # rows below it are launch/latency-bound and not used (nor claimed)


def shape_key(model: str, tp: int, dtype: str) -> str:
    return f"{model} TP{tp} {dtype}"


@dataclass(frozen=True)
class Calibration:
    device: str
    gpu: str
    weight_efficiency: float      # achieved / nominal HBM bandwidth, expert and dense weight reads
    kv_efficiency: float          # achieved / nominal HBM bandwidth, decode attention's KV reads
    compute_efficiency: float     # achieved / peak dense tensor FLOP/s
    attn_fixed_us: float          # per decoder layer per step (decode attention's fixed cost)
    moe_fixed_us: dict[str, float] = field(hash=False)  # per MoE layer per step, by shape_key
    moe_fixed_default_us: float = 0.0                   # the median of the measured shapes' (unmeasured shape)
    notes: str = ""
    source: str = SOURCE

    def moe_fixed(self, model: str, tp: int, dtype: str) -> tuple[float, str]:
        """(fixed us per MoE layer, how it was obtained) for a deployment shape."""
        key = shape_key(model, tp, dtype)
        if key in self.moe_fixed_us:
            return self.moe_fixed_us[key], f"measured for {key}"
        return self.moe_fixed_default_us, (f"{key} not measured: the median of the measured shapes "
                                           f"({', '.join(self.moe_fixed_us)})")


@lru_cache(maxsize=1)
def _doc() -> dict:
    return json.loads((DATA / "calibration.json").read_text())


def calibration_for(device: str) -> Calibration | None:
    """The shipped calibration of a device preset, or None when none was measured."""
    d = _doc()["devices"].get(device)
    if d is None:
        return None
    return Calibration(device=device, **d)


def measured_devices() -> list[str]:
    return list(_doc()["devices"])


def moe_rows(device: str) -> list[tuple[str, int, int, float]]:
    """Every measured MoE-layer row of a device with batch >= MIN_BATCH: (shape key, batch, active experts,
    ms), CUDA-graph replays of the grouped GEMM."""
    out = []
    for name in MOE_TABLES.get(device, ()):
        doc = json.loads((DATA / name).read_text())
        if isinstance(doc, list):  # one GPU holding whole experts (TP1), bf16
            out += [(shape_key(r["model"], 1, "bf16"), r["batch"], r["active"], r["graph_ms"]) for r in doc]
        else:  # one TP8 rank of Llama-4-Maverick, bf16 and fp8
            out += [(shape_key("Llama-4-Maverick", 8, dt), r["batch"], r["active"], r[f"{dt}_graph_ms"])
                    for r in doc["rows"] for dt in ("bf16", "fp8")]
    return [r for r in out if r[1] >= MIN_BATCH]


def attention_rows(device: str) -> list[tuple[int, int, int, float]]:
    """Measured decode-attention rows with batch >= MIN_BATCH: (batch, context, KV bytes read, ms);
    Qwen3-30B-A3B heads (32 query, 4 KV, dim 128, bf16), one layer, CUDA graph."""
    name = ATTENTION_TABLES.get(device)
    if name is None:
        return []
    rows = json.loads((DATA / name).read_text())["rows"]
    return [(r["batch"], r["context"], r["kv_bytes"], r["graph_ms"]) for r in rows if r["batch"] >= MIN_BATCH]
