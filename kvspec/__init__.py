"""kvspec: a formally checked model of vLLM's prefix-caching block manager.

The work lives in the subpackages: `kvspec.spec` (the executable
specification), `kvspec.reference` (the efficient model), `kvspec.conformance`
(the harness and the CLI), `kvspec.gpu_impl` (the torch implementation).
"""

__version__ = "0.1.0"
