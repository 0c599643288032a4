"""An explicit resume path that is missing, incomplete or corrupt is refused in one line with a HINT, before any
step. Crafted directories, no ranks.
"""

from __future__ import annotations

from pathlib import Path

import ckpt_factory

from slurm_jit.checkpoint import protocol
from slurm_jit.train.refusals import resume_refusal


def test_an_explicit_resume_path_that_is_missing_incomplete_or_corrupt_is_refused(tmp_path: Path) -> None:
    # resume_from_checkpoint=PATH was checked for world size, model-only and tag only: a path that does not exist
    # reached upstream's traceback, and an interrupted or damaged checkpoint was loaded as it was.
    whole = ckpt_factory.checkpoint(tmp_path, 2)
    assert resume_refusal(whole, world_size=1) is None
    interrupted = ckpt_factory.checkpoint(tmp_path, 4, manifest=False)
    protocol.write_sentinel(interrupted, 4, "jit")  # SIGKILL mid-save: the sentinel is still there
    damaged = ckpt_factory.checkpoint(tmp_path, 6)
    with open(damaged / "optimizer.pt", "ab") as handle:
        handle.write(b"\0")
    renamed = tmp_path / "my-checkpoint"
    interrupted.rename(renamed)
    for path, why in ((tmp_path / "checkpoint-99", "no such checkpoint"), (renamed, protocol.SENTINEL_NAME),
                      (damaged, "corrupt"), (tmp_path / "checkpoint-2" / "trainer_state.json", "no such")):
        refusal = resume_refusal(path, world_size=1)
        assert refusal is not None and why in refusal and "HINT:" in refusal and "\n" not in refusal, refusal
    renamed.rename(interrupted)
    refusal = resume_refusal(interrupted, world_size=1)
    assert refusal is not None and "incomplete" in refusal, refusal
