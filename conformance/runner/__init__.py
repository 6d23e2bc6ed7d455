"""The runner: one run of the harness, from names to verdicts.

``registry`` turns an implementation's name into a factory (targets register
through the ``kvspec.targets`` entry points, so this layer knows none of
them); ``campaign`` runs one configuration's examples, ``jobs`` shares one
among forked children, ``isolation`` keeps a crash or hang in a child
process, ``minimize`` and ``replaying`` shrink and re-run a trace, ``survey``
measures an implementation's reactions to caller mistakes, ``workers`` runs
a matrix row in a process (or another environment's Python) of its own, and
``run`` is the API the command line and tests call (`run_check`, `replay`,
`make_conformance_test`).
"""
