"""The trace format's names and limits (``docs/trace-format.md``), defined once for the
writers (``meter.tracefile``, ``core.outer``) and the reader (``report.records``).

Standard library only and importing nothing of stageload, so every layer may import it.
The sample keys are ``memory.SAMPLE_KEYS`` (what a reading provides) and the event fields
``core.events.Event``'s; the reader checks itself against both when it is imported.
"""

from __future__ import annotations

#: Version of the trace format written in the start record.
FORMAT_VERSION = 1

#: The ``type`` of each record.
START, SAMPLE, EVENT, MARK, ERROR, END = (
    "start",
    "sample",
    "event",
    "mark",
    "error",
    "end",
)
#: The key of a record's type: the first key of every record a writer encodes.
TYPE_KEY = "type"
#: The key of a record's time: seconds since the start record's ``monotonic``.
T_KEY = "t"


def line_prefix(kind: str) -> bytes:
    """How the line of a record of type ``kind`` starts, as the writers encode it (compact
    JSON, ``type`` first: ``core.outer.encode``): records counted without parsing them."""
    return b'{"%s":"%s"' % (TYPE_KEY.encode(), kind.encode())


#: The longest line read as a record (16 MiB): a start record with a long command is under
#: 1 MiB; a longer "line" is not a trace (``/dev/zero`` has no end of line at all).
MAX_LINE = 16 << 20
#: The largest ``t`` or duration a record may have (about three years, in seconds).
MAX_T = 1e8
#: Sizes are whole bytes from 0 to below 2**60 (1 EiB): a footprint of 1e300 is damage.
MAX_SIZE = 1 << 60
