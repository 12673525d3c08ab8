"""`python -m gengate ...` runs the `gengate` command."""

from gengate.cli import main

raise SystemExit(main())
