"""Capture: record the expert picks of a real MoE model (transformers or vLLM backend) or import
public per-request traces, into the trace artifact (``eldr_cli/artifacts/trace.py``)."""
