"""``python -m oomkit`` runs the CLI."""

from oomkit.interfaces.cli import console_main

console_main()
