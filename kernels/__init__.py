"""GPU signature-capture kernels (Triton) with torch reference implementations (ELDR §4.4).

See :mod:`eldr_cli.kernels.signature_cache` for the layout, the saturation bound and the dispatch rules.
"""

from .signature_cache import (  # noqa: F401
    INVALID_FILL,
    SignatureCache,
    SignatureCacheError,
    accumulate,
    accumulate_reference,
    begin_forward,
    cell_bound,
    cell_dtype,
    invalidate_blocks,
    reduce,
    reduce_reference,
)
