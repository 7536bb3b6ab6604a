"""State shared between proxy replicas (``--state redis://...`` or ``--workers N``).

- ``shared``: LocalState / RedisState: the other replicas' in-flight counts, live sets and admin changes;
- ``auth``: the state key and the signed envelope every message and heartbeat carries;
- ``peers``: which other replicas are alive (their signed sequence grows; a goodbye ends one for good);
- ``conn``: connection options (URL, TLS, password, key prefix);
- ``counts``: parsing and summing the replicas' per-worker counts;
- ``reserve``: the atomic select-and-reserve of a decode slot (the herd);
- ``redis_server``: a private redis-server for ``--workers N`` and the tests.
"""
