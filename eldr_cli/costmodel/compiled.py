"""torch.compile for timing that does not silently stop compiling.

Dynamo keeps its compiled graphs per code object and, past ``torch._dynamo.config.recompile_limit`` (8)
recompiles of one function, runs it uncompiled from then on, with a warning only. A benchmark that times a
layer at 20-30 shapes through one compiled function therefore times its later points uncompiled (issue 37:
gpu-check's Llama-4-Maverick layer, timed after the Qwen3 layer had used up the limit, read 138 us of fixed
cost where a fresh compiled run reads 80). Here every timed shape gets its own compiled graph: dynamo's cache
is reset before each one (its CUDA graph, captured right after, keeps its kernels), the graph must be whole
(``fullgraph=True``: a graph break is an error, not a silent split), a hit of the recompile limit raises
(``fail_on_recompile_limit_hit``), and the call must have made a new graph; else one EldrError.
"""

from __future__ import annotations

from contextlib import contextmanager

from eldr_cli.errors import EldrError

HINT = "run with --no-compile (the layer's ops as they are, labelled not compiled)"


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (its counters survive ``torch._dynamo.reset``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextmanager
def one_graph_per_shape(fn, what: str):
    """Yields ``fn`` compiled afresh (dynamo cache reset, ``dynamic=False``, ``fullgraph=True``, recompile-limit
    hits raised); on leaving, checks that calling it compiled a graph. Any fallback: EldrError naming ``what``."""
    import torch
    import torch._dynamo
    from torch._dynamo import exc

    torch._dynamo.reset()
    before = graphs_compiled()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield torch.compile(fn, dynamic=False, fullgraph=True)
    except (exc.TorchDynamoException, exc.FailOnRecompileLimitHit) as e:
        raise EldrError(f"torch.compile could not compile {what} whole ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:300] if str(e) else ''}); nothing was timed uncompiled in "
                        "its place", hint=HINT) from None
    if graphs_compiled() <= before:
        raise EldrError(f"torch.compile fell back to running {what} uncompiled (dynamo compiled no graph for it); "
                        "its timing would not be of a compiled layer", hint=HINT)


def shape_key(args) -> tuple:
    """What dynamo specialises a call on with ``dynamic=False``: each tensor's shape and dtype, each list's or
    tuple's length and items, other values as they are."""
    import torch

    if isinstance(args, torch.Tensor):
        return ("T", tuple(args.shape), str(args.dtype))
    if isinstance(args, (list, tuple)):
        return (type(args).__name__, tuple(shape_key(a) for a in args))
    return ("V", args)


class PerShape:
    """``fn`` compiled once per distinct :func:`shape_key` of its arguments, points of one shape in a row
    sharing the graph: ``build(run)`` gets the compiled function (and warms it up, captures it in a CUDA graph,
    ...). A shape seen just before reuses its graph with recompiles made errors; a guard that still fails (it
    specialises on more than shapes) gets a fresh graph. ``compiles`` counts the graphs made."""

    def __init__(self, fn):
        self.fn, self.key, self.run, self.compiles = fn, None, None, 0

    def call(self, args, build, what: str):
        import torch
        from torch._dynamo import exc

        key = shape_key(args)
        if key == self.key and self.run is not None:
            try:
                with torch._dynamo.config.patch(error_on_recompile=True):
                    return build(self.run)
            except exc.RecompileError:
                pass
        with one_graph_per_shape(self.fn, what) as run:
            made = build(run)
        self.key, self.run, self.compiles = key, run, self.compiles + 1
        return made
