"""The bench suite's one table formatter: the suite's results, the training step's, the compile report's."""

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence], right: bool = False) -> str:
    """Rows of cells (the first: the column names) as text, each column as wide as its widest cell,
    two spaces apart; cells left-aligned (right: right-aligned), with no trailing spaces. A row
    shorter than the first has its last columns empty."""
    if not rows:
        return ""
    cells = [[str(v) for v in row] + [""] * (len(rows[0]) - len(row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(rows[0]))]
    pad = str.rjust if right else str.ljust
    return "\n".join("  ".join(map(pad, row, widths)).rstrip() for row in cells)
