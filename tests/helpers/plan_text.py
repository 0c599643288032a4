"""Reading ``python launch/submit.py``'s plan as a person reads it: a label's value is its line and the lines under
it (launch/plan.py wraps a value to the width; a shell command's lines end in `` \\``); its HINT follows on a line of
its own."""

from __future__ import annotations

from slurm_jit.launch.plan import LABEL  # "  requeue:  ": the labels' column


def value(text: str, label: str, *, hint: bool = False) -> str:
    """The value printed under ``label`` (``"sbatch:"``), its wrapped lines joined as a shell or a reader joins
    them; with ``hint``, then a space and its HINT."""
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith(f"  {label:<{LABEL - 2}}")]
    said, in_hint = lines[at][LABEL:], False
    for line in lines[at + 1:]:
        if not line.startswith(" " * LABEL) or line[LABEL] == " ":
            break
        if line[LABEL:].startswith("HINT: "):
            if not hint or in_hint:
                break
            in_hint = True
        said = said[:-1] + line[LABEL:] if said.endswith(" \\") else f"{said} {line[LABEL:]}"
    return said
