"""`python -m ardiff_server` = `ardiff-serve`."""

from ardiff_server.cli import main

raise SystemExit(main())
