"""Finding the MoE routers of a transformers model and recording their top-k picks.

Routers are found by structure, not by layer names: a module with an ``experts`` child and a
sibling child that has an integer ``top_k`` and a 2-D ``weight`` of shape [E, hidden] is an MoE
block, the sibling its router. In transformers 5 every supported family's router returns
``(router_logits [T, E], router_scores [T, k], router_indices [T, k])``; the indices are exactly
the experts the block then runs (the experts module receives them unchanged), so recording them
is exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from eldr_cli.errors import EldrError

# model_type -> display name. Others are accepted when their routers are found by structure.
SUPPORTED_FAMILIES = {
    "qwen3_moe": "Qwen3-MoE",
    "qwen2_moe": "Qwen2-MoE",
    "olmoe": "OLMoE",
    "mixtral": "Mixtral",
    "gpt_oss": "GPT-OSS",
    "deepseek_v3": "DeepSeek-V3",
}
_MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class RouterSite:
    layer_id: int          # decoder layer index in the model
    name: str              # module path, e.g. model.layers.3.mlp.gate
    module: Any            # the torch.nn.Module of the router
    num_experts: int
    top_k: int
    score: str             # "softmax" or "sigmoid": how gate probabilities are formed from logits


def supported_list() -> str:
    return ", ".join(f"{v} ({k})" for k, v in SUPPORTED_FAMILIES.items())


def looks_moe(config) -> bool:
    cfgs = [config] + [getattr(config, a) for a in ("text_config",) if getattr(config, a, None) is not None]
    return any(isinstance(getattr(c, k, None), int) and getattr(c, k) > 1 for c in cfgs for k in _MOE_CONFIG_KEYS)


def find_routers(model) -> list[RouterSite]:
    """All MoE routers of ``model`` in layer order; EldrError when there are none."""
    sites: list[RouterSite] = []
    for name, mod in model.named_modules():
        children = dict(mod.named_children())
        if "experts" not in children:
            continue
        for cname, child in children.items():
            if cname == "experts":
                continue
            w = getattr(child, "weight", None)
            k = getattr(child, "top_k", None)
            if not isinstance(k, int) or w is None or getattr(w, "ndim", 0) != 2:
                continue
            m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
            if m is None:
                continue
            score = "sigmoid" if hasattr(child, "e_score_correction_bias") else "softmax"
            sites.append(RouterSite(int(m.group(1)), f"{name}.{cname}" if name else cname, child,
                                    int(w.shape[0]), k, score))
    mt = getattr(getattr(model, "config", None), "model_type", "?")
    if not sites:
        if looks_moe(model.config):
            raise EldrError(f"no MoE routers found in this {mt!r} model: unsupported MoE architecture",
                            hint=f"supported families: {supported_list()}")
        raise EldrError(f"the model ({mt!r}) is not a mixture-of-experts model (no MoE routers found)",
                        hint=f"capture needs an MoE checkpoint; supported families: {supported_list()}")
    sites.sort(key=lambda s: s.layer_id)
    if len({s.layer_id for s in sites}) != len(sites):
        raise EldrError(f"found several routers per layer in {mt!r} ({[s.name for s in sites][:4]}...): "
                        "unsupported layout", hint=f"supported families: {supported_list()}")
    if len({(s.num_experts, s.top_k) for s in sites}) != 1:
        raise EldrError("MoE layers differ in expert count or top-k; eldr traces need one [L, E] shape")
    return sites


class RouterRecorder:
    """Forward hooks on every router; after a forward, ``indices[l]`` is [T, k] and ``logits[l]`` [T, E]."""

    def __init__(self, sites: list[RouterSite]):
        self.sites = sites
        self.indices: list = [None] * len(sites)
        self.logits: list = [None] * len(sites)
        self.keep_logits = False
        self._handles: list[Any] = []

    def _make_hook(self, i: int):
        def hook(_mod, _inp, out):
            if not (isinstance(out, tuple) and len(out) == 3):
                raise EldrError(f"router {self.sites[i].name} returned {type(out).__name__}, expected "
                                "(logits, scores, indices): unsupported transformers version or family",
                                hint=f"supported families: {supported_list()}")
            self.indices[i] = out[2]
            if self.keep_logits:
                self.logits[i] = out[0]
        return hook

    def __enter__(self) -> "RouterRecorder":
        self._handles = [s.module.register_forward_hook(self._make_hook(i)) for i, s in enumerate(self.sites)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
