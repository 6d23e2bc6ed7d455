"""`python -m kvspec` is the same as the `kvspec` command."""

from kvspec.conformance.tools.cli import main

raise SystemExit(main())
