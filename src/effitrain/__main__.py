"""`python -m effitrain` (and `torchrun -m effitrain`) is the CLI."""

from effitrain.cli import main

raise SystemExit(main())
