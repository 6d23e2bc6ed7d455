"""`python -m kvspec` is the same as the `kvspec` command."""

from kvspec._entry import main

raise SystemExit(main())
