"""Every logger of the package goes through the redaction filter.

A module that creates its logger with ``logging.getLogger`` instead of
:func:`reliable_beat.redaction.get_logger` logs URLs, tokens and headers in clear (issue 13).
"""

from __future__ import annotations

import re
from pathlib import Path

import reliable_beat

PACKAGE = Path(reliable_beat.__file__).parent
ALLOWED = {PACKAGE / "redaction.py"}


def test_no_module_creates_an_unredacted_logger() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in ALLOWED:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\blogging\.getLogger\(", line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "use reliable_beat.redaction.get_logger:\n" + "\n".join(offenders)
