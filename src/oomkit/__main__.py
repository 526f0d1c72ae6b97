"""``python -m oomkit`` runs the CLI."""

from oomkit.interfaces.cli import main

raise SystemExit(main())
