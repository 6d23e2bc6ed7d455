"""What people run: the command line and the programs behind it.

``cli`` and ``commands`` (one module per subcommand), ``view`` (the
step-through player), ``simulate`` and ``workloads``, ``walkthrough`` and
``groups_demo`` (seed 000's example, played), ``contracts`` (CrossHair over
the spec), ``router_mirror``, ``oracle`` (vLLM releases, one matrix; the
matrix itself in ``oracle_matrix``), ``plugin_matrix`` and ``mutants``.
"""
