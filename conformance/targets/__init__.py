"""What the harness checks: the built-in adapters, vLLM's releases, and plugins of vLLM's block manager.

``builtin`` adapts the spec and the reference; ``vllm`` drives vLLM's own
pool and manager (installed, or one release's modules loaded from its wheel);
``plugins`` loads third-party block managers as they load in production.
``catalog`` holds kvspec's own `Target` records, which its pyproject.toml
registers as ``kvspec.targets`` entry points. ``loader`` (a package's
modules run from files under a private name, with placeholders) and
``archives`` (a distribution's files fetched once with pip and cached) are
what light mode and the plugins' overlay both load with.
"""
