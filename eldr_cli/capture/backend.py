"""What a capture backend returns for one request, and model-directory checks shared by backends."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eldr_cli.errors import EldrError


@dataclass
class RequestCapture:
    """Expert picks of one request. L MoE layers, E experts, k top-k, N decode steps."""

    prompt_tokens: int
    prefill_counts: np.ndarray          # int32 [L, E]
    decode_picks: np.ndarray            # int16 [N, L, k], ids sorted ascending per token
    prefill_gate_prob: np.ndarray | None = None   # float32 [L, E], summed over prompt tokens
    prefill_gate_logit: np.ndarray | None = None  # float32 [L, E]

    def decode_counts(self, num_experts: int) -> np.ndarray:
        """int32 [L, E]: decode steps in which layer l picked e."""
        N, L, k = self.decode_picks.shape
        out = np.zeros((L, num_experts), dtype=np.int32)
        if N:
            flat = self.decode_picks.astype(np.int64) + (np.arange(L) * num_experts)[None, :, None]
            out += np.bincount(flat.ravel(), minlength=L * num_experts).reshape(L, num_experts).astype(np.int32)
        return out


def check_checkpoint(model_dir) -> Path:
    """A local Hugging Face checkpoint directory (config.json + weights); EldrError otherwise."""
    p = Path(model_dir)
    if not p.exists():
        raise EldrError(f"model directory {p} does not exist",
                        hint="pass a local checkpoint directory (no downloads); `eldr model tiny` builds one")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise EldrError(f"{p} is not a model checkpoint (no config.json)",
                        hint="pass a directory saved with save_pretrained; `eldr model tiny` builds one")
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EldrError(f"{p}/config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise EldrError(f"{p}/config.json has no model_type: not a transformers checkpoint")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise EldrError(f"{p} has no weight files (*.safetensors or *.bin)")
    return p


def model_fingerprint(model_dir) -> str:
    """Cheap identity of a checkpoint: config.json content + names and sizes of weight files."""
    p = Path(model_dir)
    h = hashlib.sha256((p / "config.json").read_bytes())
    for f in sorted(list(p.glob("*.safetensors")) + list(p.glob("*.bin"))):
        h.update(f"{f.name}\0{f.stat().st_size}\n".encode())
    return h.hexdigest()
