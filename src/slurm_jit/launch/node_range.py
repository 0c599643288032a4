"""sbatch's ``--nodes MIN-MAX``: a job that may start (and be requeued) on any node count in a range.

Each start of the job, the first and every requeue, gets MIN to MAX nodes (Slurm gives more while they are free),
so the world size of a requeue chain can change between restarts: the JitTrainer then keeps the global batch by
setting the gradient accumulation (docs/elastic-resume.md). Pure: parsing and the plan's words, no Slurm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# sbatch(1) --nodes: "<minnodes>[-maxnodes]" (newer Slurm also takes a size list "1,4,8" or "1-16:4", which
# would let a job resume on counts the plan never named: refused here).
_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")
MAX_LISTED = 8  # node counts the plan lists one by one; a wider range is said as its ends
HINT = "HINT: a node count (--nodes 2) or sbatch's range MIN-MAX with 1 <= MIN <= MAX (--nodes 1-2)"


@dataclass(frozen=True, kw_only=True)
class NodeRange:
    """The node counts a job may run on: ``min_nodes == max_nodes`` for a fixed count."""

    min_nodes: int  # the fewest nodes a start may get
    max_nodes: int  # the most, asked for first (Slurm gives the largest count it can)

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"--nodes {self.min_nodes}-{self.max_nodes}: MIN must be 1 or more and not above "
                             f"MAX. {HINT}")

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    def sbatch_value(self) -> int | str:
        """The value of ``#SBATCH --nodes=``: an int for a fixed count (scripts stay as they were)."""
        return f"{self.min_nodes}-{self.max_nodes}" if self.elastic else self.max_nodes

    def world_sizes(self, per_node: int) -> list[int]:
        """The world sizes a start may get, fewest first: every one for up to MAX_LISTED node counts, else the
        fewest and the most (a range of a million nodes is not listed)."""
        if self.max_nodes - self.min_nodes >= MAX_LISTED:
            return [self.min_nodes * per_node, self.max_nodes * per_node]
        return [nodes * per_node for nodes in range(self.min_nodes, self.max_nodes + 1)]


def looks_like_range(text: str) -> bool:
    """Whether ``text`` has the shape of a count or MIN-MAX (its values are checked by :func:`parse`)."""
    return _RANGE.fullmatch(text) is not None


def parse(value: object, where: str | None = None) -> NodeRange:
    """A node count (int or digits) or ``"MIN-MAX"``; ValueError (one line, HINT) for anything else: 0, a
    negative or fractional count, MIN > MAX, a size list, a bool. ``where`` names the value in the message
    (default ``--nodes VALUE``)."""
    text = str(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    where = where or f"--nodes {text if text is not None else repr(value)}"
    found = _RANGE.fullmatch(text) if text is not None else None
    if found is None:
        raise ValueError(f"{where}: not a node count or a MIN-MAX range. {HINT}")
    low = int(found.group(1))
    high = int(found.group(2)) if found.group(2) is not None else low
    if low < 1:
        raise ValueError(f"{where}: must be a whole number, 1 or more (a job needs a node). {HINT}")
    if low > high:
        raise ValueError(f"{where}: MIN {low} is above MAX {high}. HINT: --nodes {high}-{low}")
    return NodeRange(min_nodes=low, max_nodes=high)


def plan_line(nodes: NodeRange, per_node: int) -> str | None:
    """The plan's words for a range: the job may come back on fewer nodes, and what the trainer does then; None
    for a fixed count."""
    if not nodes.elastic:
        return None
    sizes = nodes.world_sizes(per_node)
    most = sizes[-1]
    listed = nodes.max_nodes - nodes.min_nodes < MAX_LISTED
    ranks = _either(sizes) if listed else f"{sizes[0]} to {most}"
    uneven = (_either([size for size in sizes if most % size]) if listed
              else f"the counts between {sizes[0]} and {most} that do not divide {most}")
    factor = f" ({most} -> {sizes[0]} ranks: x{most // sizes[0]})" if not most % sizes[0] else ""
    line = (f"--nodes {nodes.min_nodes}-{nodes.max_nodes}: each start (the first and every requeue) gets "
            f"{nodes.min_nodes} to {nodes.max_nodes} nodes, so {ranks} ranks; a requeue may "
            "come back on fewer (or more) nodes than the run before, and the JitTrainer then keeps the global "
            f"batch (per-device batch x accumulation x ranks) by setting the gradient accumulation{factor}")
    if uneven:
        line += (f"; on {uneven} ranks only where the samples per optimizer step divide by ranks x per-device "
                 "batch (else it refuses to resume, naming batches that would)")
    return line + (f"; the signal lead is sized for the fewest, {sizes[0]} ranks, whose optimizer step is the "
                   f"longest (up to {most / sizes[0]:g}x the step on {most}: a timing log of more ranks is scaled, "
                   "a given --step-time taken as theirs)")


def _either(sizes: list[int]) -> str:
    """``1 or 2``, ``4, 8 or 12``."""
    if not sizes:
        return ""
    return " or ".join([", ".join(map(str, sizes[:-1])), str(sizes[-1])] if len(sizes) > 1 else [str(sizes[0])])
