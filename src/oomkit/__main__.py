"""``python -m oomkit`` runs the CLI."""

from oomkit.cli import main

raise SystemExit(main())
