"""Small MoE checkpoints built or trained on this machine (`eldr model tiny`): the models tests, the demo
and the benchmarks capture expert picks from. Not the routing model (that is :mod:`eldr_cli.routing`)."""
