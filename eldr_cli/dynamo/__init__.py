"""eldr as the decode router inside NVIDIA Dynamo (``pip install 'eldr[dynamo]'``, docs/dynamo.md).

Dynamo's frontend runs a request's prefill, then hands the prefill's result (``prefill_result`` with its
``disaggregated_params.kv_transfer_params``, where eldr's vLLM plugin put ``eldr_signature``) to the worker
registered as the model's decode tier. :mod:`eldr_cli.dynamo.component` registers there, and
:class:`eldr_cli.dynamo.router.InstanceRouter` chooses one of the real decode instances with eldr's
:class:`eldr_cli.routing.DecodeRouter`; the component then sends the request to it with ``Client.direct``.

Only :mod:`eldr_cli.dynamo.component` and :mod:`eldr_cli.testing.dynamo_workers` import Dynamo (``dynamo.*``
from ``ai-dynamo-runtime``); nothing else in eldr imports this package.
"""
