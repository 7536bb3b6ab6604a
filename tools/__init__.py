"""Developer scripts (not part of the installed package): `python -m tools.<name>`."""
