"""The lock-step core: what one step of a conformance campaign is.

The operation table (``operations``, ``branches``, ``error_contract``), the
adapter protocols (``adapter``), results and verdicts (``results``), traces
(``trace``), the lock-step call that runs the spec beside an implementation
and compares everything (``lockstep``), the Hypothesis machines that choose
the steps (``machine``, ``strategies``), coverage, the reactions an
implementation declares to caller mistakes, KV cache events, and the stories
a failure is told in (``report``). It knows nothing of how a run is
organised (``runner``), what is checked (``targets``) or who runs it
(``tools``).
"""
