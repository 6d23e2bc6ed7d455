"""A plugin checked from the overlay's documentation alone: `kvspec check --impl overlay:vllm@X+<this module>:apply`."""

from pathlib import Path


def apply(overlay):
    overlay.add_package("tailfree", Path(__file__).parent)  # the plugin's own package, from its folder
    overlay.import_plugin("tailfree.patch")  # importing it replaces vLLM's free_blocks, as in production
