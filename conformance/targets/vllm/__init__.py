"""vLLM as an implementation under test: light-mode loading and per-release facts.

``lightmode`` runs a release's real ``BlockPool`` from its wheel without
installing vLLM; ``releases`` records, per release, the API shapes and
behaviours an adapter has to speak; ``events`` what each release's KV cache
events carry, and their translation into the spec's; ``venvs`` builds the
virtual environment per release that the request level runs in.
"""
