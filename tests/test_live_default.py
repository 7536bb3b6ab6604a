"""eldr-live is the proxy's default decode policy (issue 21; tests of issue 31): a fresh fit writes its
decode-activation model and a proxy given no policy serves with eldr-live; an artifact fitted before eldr-live
(no such model) serves with the paper's eldr and says so once, in a warning that names the refit."""

from __future__ import annotations

import logging

import numpy as np
from _proxy_util import build_routing

from eldr_cli.proxy import build_config, create_app
from eldr_cli.proxy.base import default_policy
from eldr_cli.routing import RoutingModel
from eldr_cli.routing.live import EldrLivePolicy
from eldr_cli.routing.policies import EldrPolicy

DEAD = {"prefill": ["http://127.0.0.1:9"], "decode": [f"http://127.0.0.1:{p}" for p in (10, 11, 12)]}


def _proxy_policy(routing) -> tuple[str, object]:
    app = create_app(build_config(None, routing=str(routing), **DEAD))  # no --policy: the default
    return app.state.policy_name, app.state.router.policy


def test_a_fresh_fit_writes_the_live_model_and_the_proxy_defaults_to_eldr_live(tmp_path, caplog):
    routing = build_routing(tmp_path, decoders=3)
    model = RoutingModel.load(routing)
    assert model.live is not None  # the fit wrote the decode-activation model ...
    protos, act = model.live
    L, E = model.shape
    assert act.shape == (protos.shape[0] + 1, L, E) and protos.shape[0] >= 2
    assert ((act >= 0) & (act < 1)).all() and act.any()  # per-step probabilities, not all zero
    with caplog.at_level(logging.WARNING, logger="eldr.proxy"):
        assert default_policy(model, str(routing)) == "eldr-live"  # ... and it is the default
        name, pol = _proxy_policy(routing)
    assert name == "eldr-live" and isinstance(pol, EldrLivePolicy)
    assert not [r for r in caplog.records if "eldr-live" in r.getMessage()]  # nothing to warn about


def test_an_artifact_fitted_before_eldr_live_serves_with_eldr_and_says_so_once(tmp_path, monkeypatch, caplog):
    import eldr_cli.pipeline.fit as fit

    # the artifact an older eldr wrote: no live_prototypes / live_activation arrays, live_prototypes: None
    monkeypatch.setattr(fit, "_fit_decode_activation", lambda *a, **k: None)
    routing = build_routing(tmp_path, decoders=3)
    monkeypatch.undo()
    model = RoutingModel.load(routing)
    assert model.live is None
    with caplog.at_level(logging.WARNING, logger="eldr.proxy"):
        name, pol = _proxy_policy(routing)
    assert name == "eldr" and isinstance(pol, EldrPolicy)
    said = [r.getMessage() for r in caplog.records if r.name == "eldr.proxy" and r.levelno == logging.WARNING]
    assert len(said) == 1 and "eldr fit" in said[0] and str(routing) in said[0]
    # a routing model without the live arrays gives eldr; with them, eldr-live (the rule itself, no files)
    bare = RoutingModel("count", np.ones((2, 4)), np.arange(2), np.eye(3, 8))
    assert default_policy(bare, "x") == "eldr"
    live = RoutingModel("count", np.ones((2, 4)), np.arange(2), np.eye(3, 8),
                        live=(np.eye(2, 8), np.full((3, 2, 4), 0.25, dtype=np.float32)))
    assert default_policy(live, "x") == "eldr-live"
