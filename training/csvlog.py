"""Per-epoch / per-rollout training logs as CSV, appended row by row (a crash keeps every row
written so far; a resumed run appends to the same file)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def append_row(path: Path, row: dict[str, Any], fields: Sequence[str] | None = None) -> None:
    """Append ``row`` to the CSV at ``path``, writing the header first when the file is new.

    ``fields``: the column order (default: the row's keys); missing values are left empty."""
    new = not path.exists()
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields or row), restval="")
        if new:
            writer.writeheader()
        writer.writerow(row)
