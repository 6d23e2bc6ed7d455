"""The benchmarks `kvspec bench` runs: one module per implementation, each with `main(argv) -> int`."""

import warnings

# NOTE: a torch built with NumPy support warns at import when NumPy is absent;
# no benchmark converts to NumPy, so the warning is noise in every table.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
