"""save_only_model: the JIT save is full (optimizer, scheduler, RNG) and resumes exactly, without DeepSpeed and with
an async periodic save in flight. Real ranks (2 CPU ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jit_helpers import assert_same_losses, ckpt_check, losses, run_to_end
from run_outputs import manifest_of as _manifest

from slurm_jit.train import stop_record

pytestmark = pytest.mark.deepspeed

def test_plain_ddp_save_only_model_jit_save_resumes_exactly(tmp_path: Path) -> None:
    """Item 3 without DeepSpeed: the JIT checkpoint has optimizer, scheduler and RNG files; the resumed run's
    learning rates and losses are the uninterrupted run's (a fresh optimizer or a restarted schedule would not)."""
    args = ["--zero-stage", "0", "--max-steps", "8", "--save-steps", "2", "--save-only-model", "--kill-wait", "0"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_to_end(ref, args) == [0, 0]
    # SIGTERM at the end of step 4, during its model-only periodic save: the stop moves to step 5, full
    assert run_to_end(out, [*args, "--signal-self-at-step", "4"]) == [0, 0]
    jit = out / "checkpoint-5"
    assert _manifest(jit)["contents"] == "full" and _manifest(out / "checkpoint-4")["contents"] == "model_only"
    assert _manifest(jit)["kind"] == "jit"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert (jit / name).is_file(), name
    assert run_to_end(out, [*args, "--resume"]) == [0, 0]
    assert_same_losses(losses(out), losses(ref))
    lrs = [json.loads(line)["lr"] for line in (out / "losses-rank0.jsonl").read_text().splitlines()]
    assert lrs == [json.loads(line)["lr"] for line in (ref / "losses-rank0.jsonl").read_text().splitlines()]


def test_a_stop_during_an_async_model_only_save_writes_a_full_jit_checkpoint(tmp_path: Path) -> None:
    """Issue #42 item 3, ZeRO-2 with async periodic saves: SIGTERM at the end of step 4, while its model-only save is
    in flight (the stop agreed right after its submission): the stop moves to step 5 and writes a full JIT checkpoint
    there, the one ckpt-check names and the resume continues from (the model-only guard read the saved step before
    the async save counted, and the JIT save then returned as 'already saved': the stop named checkpoint-4)."""
    args = ["--max-steps", "8", "--save-steps", "2", "--save-only-model", "--kill-wait", "0", "--async-periodic-saves"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_to_end(ref, args) == [0, 0]
    assert run_to_end(out, [*args, "--signal-self-at-step", "4"]) == [0, 0]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    assert record["step"] == 5 and record["checkpoint"] == str(out / "checkpoint-5"), record
    assert _manifest(out / "checkpoint-4")["contents"] == "model_only"
    assert _manifest(out / "checkpoint-5")["contents"] == "full" and _manifest(out / "checkpoint-5")["kind"] == "jit"
    check = ckpt_check(out)
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == str(out / "checkpoint-5"), check.stdout
    assert run_to_end(out, [*args, "--resume"]) == [0, 0]
    assert_same_losses(losses(out), losses(ref))
