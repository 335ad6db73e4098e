"""Presentation of memory traces: ``trace`` reads and summarises them per stage, ``tables``
formats the per-stage comparison, ``plot`` draws it (matplotlib, imported only there)."""
