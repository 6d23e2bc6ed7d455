"""`python -m kvspec` is the same as the `kvspec` command."""

from kvspec._entry import console_main

raise SystemExit(console_main())
