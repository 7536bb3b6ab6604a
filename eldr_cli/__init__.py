"""eldr: expert-locality-aware decode routing for PD-disaggregated MoE serving."""

__version__ = "0.1.0"
