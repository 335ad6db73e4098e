"""``python -m stageload`` runs the CLI."""

from .cli import entry

entry()
