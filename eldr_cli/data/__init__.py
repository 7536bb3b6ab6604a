"""Prompt sets shipped with eldr (sources and licenses: ``prompts/README.md``).

- ``task.jsonl``: 7,142 prompts in four domains (code, math, medical, legal) from HumanEval, GSM8K,
  PubMedQA and MMLU (MIT);
- ``language.jsonl``: 2,750 prompts, the same MGSM problems in 11 languages (CC BY 4.0).

They are the default for ``eldr capture``, ``eldr bench`` and the demo, so a clone needs no other data.
"""

from __future__ import annotations

from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
PROMPT_SETS = ("task", "language")


def prompts_file(name: str = "task") -> Path:
    """The path of a shipped prompt set (``task`` or ``language``)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    return PROMPTS_DIR / f"{name}.jsonl"
