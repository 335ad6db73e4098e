"""Show text that came from users or files (labels, commands, stage names) on a terminal.

A ``--label`` or a queued command may hold a newline or an ESC: printed raw it breaks a
table, and one user's command would write terminal escapes into another user's
``stageload queue``. Standard library only, so every layer may import it.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with each character that is not printable written as repr writes it
    (``\\n``, ``\\x1b``, and ``\\u202e`` for a bidi override that would reorder the line),
    and a backslash doubled (``\\\\``); other printable characters come back unchanged.

    Each output comes from one text only: with the backslash left as it was, a label
    typed as ``run\\nA`` (a backslash, then ``n``) and one holding a newline printed the
    same."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join("\\\\" if c == "\\" else c if c.isprintable() else repr(c)[1:-1] for c in text)
