"""The package's version, defined once: ``stageload.__version__`` re-exports it, pyproject.toml
reads it, and the trace writer records it (importing it from here, not from the package
root, keeps the root's import table free of cycles)."""

__version__ = "0.2.0"
