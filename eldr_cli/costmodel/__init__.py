"""The cost model of one MoE forward step on a machine (ELDR §2, Fig. 2), kind "cost-model": the base model and
its artifact (:mod:`eldr_cli.costmodel.model`) and the GPU roofline (:mod:`eldr_cli.costmodel.roofline`), which
registers itself so that :meth:`CostModel.load` returns one for a roofline artifact. Importing the package imports
both, so that table is complete wherever ``CostModel`` is reachable; the base class knows no subclass (no import
circle, ``tests/test_import_layers.py``)."""

from __future__ import annotations

from eldr_cli.costmodel import roofline as _roofline  # noqa: F401 - registers the roofline's loader
from eldr_cli.costmodel.model import (
    KIND,
    MODEL_BOUND,
    CostModel,
    ScaledCostModel,
    StepTerms,
    check_model,
    model_mismatch,
    register_source,
    step_ms_from_terms,
    write_cost_model,
)

__all__ = ["KIND", "MODEL_BOUND", "CostModel", "ScaledCostModel", "StepTerms", "check_model", "model_mismatch",
           "register_source", "step_ms_from_terms", "write_cost_model"]
