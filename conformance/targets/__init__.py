"""What the harness checks: the built-in adapters, vLLM's releases, and plugins of vLLM's block manager.

``builtin`` adapts the spec and the reference; ``vllm`` drives vLLM's own
pool and manager (installed, or one release's modules loaded from its wheel);
``plugins`` loads third-party block managers as they load in production.
``catalog`` holds kvspec's own `Target` records, which its pyproject.toml
registers as ``kvspec.targets`` entry points.
"""
