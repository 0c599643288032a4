"""Attacks on the JitTrainer and its checkpoint protocol, as a hostile, careful user would make them.

Each test holds a defect found that way (it failed before the fix). Fast ones craft directories with
``ckpt_factory`` and kill child processes for real; the trainer ones run the tiny demo training on 2 CPU ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import ckpt_factory
import pytest
from jit_helpers import (
    STOP_DEADLINE_S,
    assert_same_losses,
    ckpt_check,
    losses,
    run_logged,
    run_to_end,
    start_demo,
    wait_for,
)

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record
from slurm_jit.train.refusals import resume_refusal
from slurm_jit.train.signals import SignalLatch
from slurm_jit.train.trainer import JitConfig


def test_model_only_checkpoint_is_never_picked_for_resume(tmp_path: Path) -> None:
    # save_only_model: a periodic model-only save written after the last full one. It was `complete`, picked by
    # ckpt-check and by resume, then refused at resume: a crash loop on every requeue.
    full = ckpt_factory.checkpoint(tmp_path, 4, created=1_700_000_000.0, contents="full")
    model_only = ckpt_factory.checkpoint(tmp_path, 6, created=1_700_000_100.0, model_only=True,
                                         contents="model_only")
    resolution = protocol.find_resumable(tmp_path)
    assert resolution.checkpoint is not None and resolution.checkpoint.path == full
    assert [c.status for c in resolution.passed_over] == [protocol.Status.MODEL_ONLY]
    check = ckpt_check(tmp_path)
    assert check.returncode == 0 and check.stdout.splitlines()[-1] == str(full), check.stdout + check.stderr
    assert "model-only" in check.stdout
    # --quarantine sets aside what is broken; a model-only checkpoint is whole: it stays
    assert ckpt_check(tmp_path, "--quarantine").returncode == 0
    assert model_only.is_dir()


KILL_MID_DELETE = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from slurm_jit.checkpoint import protocol

    real_unlink = os.unlink

    def unlink_then_die(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        if os.fspath(path).endswith(protocol.MANIFEST_NAME):  # the manifest gone, the data still there
            os.kill(os.getpid(), signal.SIGKILL)

    os.unlink = unlink_then_die
    protocol.delete_checkpoint(Path(sys.argv[1]))
""")


def test_kill_during_rotation_never_leaves_a_resume_point(tmp_path: Path) -> None:
    # Rotation deleted checkpoint-2 in place. SIGKILL after its manifest was removed left the rest: `unverified`
    # and whole, and the removal had just set its directory mtime, so it was the newest: resume picked it over
    # checkpoint-4, the one just written.
    old = ckpt_factory.checkpoint(tmp_path, 2, world=1)
    new = ckpt_factory.checkpoint(tmp_path, 4, world=1)
    child = subprocess.run([sys.executable, "-c", KILL_MID_DELETE, str(old)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGKILL, child.stderr
    resolution = protocol.find_resumable(tmp_path)
    assert resolution.checkpoint is not None and resolution.checkpoint.path == new, resolution
    check = ckpt_check(tmp_path)
    assert check.stdout.splitlines()[-1] == str(new), check.stdout
    assert not old.exists()
    leftovers = list(tmp_path.glob(f"{protocol.DELETING_PREFIX}*"))
    assert len(leftovers) == 1
    protocol.remove_deletion_leftovers(tmp_path)  # the next rotation finishes the deletion
    assert not list(tmp_path.glob(f"{protocol.DELETING_PREFIX}*"))
    assert json.loads((new / protocol.MANIFEST_NAME).read_text())["step"] == 4


@pytest.mark.parametrize("kwargs", [
    {"kill_wait_s": 1e300},  # accepted, then time.sleep overflowed on the stop path: no JIT checkpoint
    {"kill_wait_s": float("inf")}, {"kill_wait_s": "3"}, {"kill_wait_s": True}, {"kill_wait_s": None},
    {"side_group_timeout_s": 0}, {"side_group_timeout_s": float("nan")}, {"side_group_timeout_s": -5},
    {"convert_timeout_s": 0}, {"convert_timeout_s": float("inf")},
    {"signals": "TERM"}, {"signals": ("TERM", "SIGTERM")}, {"signals": ("USR1", 10)}, {"signals": (99,)},
    {"signals": ("CHLD",)}, {"signals": ("SEGV",)}, {"signals": ("STOP",)}, {"signals": ("",)},
    {"signals": (None,)},
])
def test_odd_jit_config_is_one_line_with_a_hint(kwargs: dict) -> None:
    with pytest.raises(ValueError) as caught:
        JitConfig(**kwargs)
    message = str(caught.value)
    assert "HINT:" in message and "\n" not in message, message


def test_latch_with_a_signal_named_twice_restores_the_original_handler() -> None:
    # install() recorded its own handler as the "previous" one of the second copy: after train() the latch stayed
    # installed, and every later SIGUSR1 was swallowed.
    seen: list[int] = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        latch = SignalLatch([signal.SIGUSR1, signal.SIGUSR1])
        latch.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert latch.seen and not seen
        latch.restore()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and latch.count == 1
    finally:
        signal.signal(signal.SIGUSR1, original)


# Real ranks (plain DDP over gloo: the paths do not depend on DeepSpeed), evaluation and a periodic save every 2
# steps, save_total_limit=1; a stop at step 6 (SIGTERM at the end of step 5, read one step on) skips that step's
# evaluation: owed.
OWED = ["--max-steps", "8", "--eval-steps", "2", "--save-steps", "2", "--save-total-limit", "1", "--kill-wait", "0",
        "--zero-stage", "0"]
OWED_EVAL_SLEEP_S = "1"  # per evaluation batch on resume: the owed evaluation lasts long enough to be signalled


def _evals(out: Path) -> list[tuple[int, float]]:
    path = out / "evals-rank0.jsonl"
    return [(r["step"], r["eval_loss"]) for r in map(json.loads, path.read_text().splitlines())]


def _dirs(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if "checkpoint-" in p.name)


@pytest.mark.deepspeed
def test_stop_during_the_owed_evaluation_keeps_it_owed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM while the resumed run ran the evaluation owed from step 6: it was aborted, step 7 was trained and
    # saved as a JIT checkpoint owing an evaluation at step 7; the next resume evaluated at 7, never at 6.
    # Meanwhile: output_dir relative and through a symlink, rotation with save_total_limit=1.
    monkeypatch.chdir(tmp_path)  # the ranks inherit it
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "link")
    ref, out = Path("ref"), Path("link/out")
    assert run_to_end(ref, OWED) == [0, 0]
    assert run_to_end(out, [*OWED, "--signal-self-at-step", "5"]) == [0, 0]
    ckpt = out / "checkpoint-6"
    assert _dirs(out) == ["checkpoint-6"]  # checkpoint-4 rotated away once 6 was complete
    assert json.loads((ckpt / protocol.MANIFEST_NAME).read_text())["owed_evaluation"] is True
    ranks = start_demo(out, [*OWED, "--resume", "--eval-sleep", OWED_EVAL_SLEEP_S])
    wait_for(ranks, "ran the owed evaluation", lambda: "running the evaluation owed from step 6" in ranks.log(0))
    for rank in (0, 1):
        ranks.signal(rank, signal.SIGTERM)
    assert ranks.wait(STOP_DEADLINE_S) == [0, 0], ranks.log(0)[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    assert record["checkpoint"] == os.path.abspath(ckpt), record  # absolute: read from any directory
    assert _dirs(out) == ["checkpoint-6"]
    assert "aborted before this run's first step" in ranks.log(0)
    assert ckpt_check(out).stdout.splitlines()[-1] == str(ckpt)
    # the next resume runs the evaluation owed from step 6, and everything is the uninterrupted run's
    assert run_to_end(out, [*OWED, "--resume"]) == [0, 0]
    assert [s for s, _ in _evals(ref)] == [2, 4, 6, 8]
    assert _evals(out) == _evals(ref)
    assert_same_losses(losses(out), losses(ref))
    assert _dirs(out) == ["checkpoint-8"]  # the one resumed from goes once this run has written a newer one


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


def test_stop_record_paths_are_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With a relative output_dir, stop.json named the checkpoint relative to the training's working directory.
    monkeypatch.chdir(tmp_path)
    stop_record.write("out", "jit_stop", step=6, checkpoint="out/checkpoint-6", resumed_from="out/checkpoint-4")
    record = stop_record.read(tmp_path / "out")
    assert record is not None
    assert record["checkpoint"] == str(tmp_path / "out" / "checkpoint-6")
    assert record["resumed_from"] == str(tmp_path / "out" / "checkpoint-4")


# A stop read during the evaluation of step 5 (SIGTERM at the end of step 5): the evaluation is aborted.
ABORTED = ["--max-steps", "10", "--eval-steps", "5", "--kill-wait", "0", "--zero-stage", "0"]


@pytest.mark.deepspeed
def test_resume_after_an_aborted_evaluation_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    # The aborted evaluation had drawn from the RNG (its DataLoader's base seed) before the JIT checkpoint saved
    # the RNG state; the owed evaluation on resume drew again: every later loss (dropout) diverged.
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_to_end(ref, ABORTED) == [0, 0]
    stopped = run_logged(out, [*ABORTED, "--signal-self-at-step", "5"])
    assert stopped.codes == [0, 0] and "evaluation aborted at step 5" in stopped.log, stopped.log[-3000:]
    resumed = run_logged(out, [*ABORTED, "--resume"])
    assert resumed.codes == [0, 0] and "running the evaluation owed from step 5" in resumed.log
    assert _evals(out) == _evals(ref)
    assert_same_losses(losses(out), losses(ref))


@pytest.mark.parametrize("flags", [["--kill-wait", "nan"], ["--signals", "TERM,CHLD"]])
def test_demo_train_says_a_bad_jit_config_in_one_line(tmp_path: Path, flags: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "slurm_jit.demo_train", "--output-dir", str(tmp_path / "out"),
                           "--zero-stage", "0", "--max-steps", "1", *flags], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("demo_train: slurm_jit") or
             line.startswith("demo_train: JitConfig")]
    assert len(lines) == 1 and "HINT:" in lines[0], done.stderr[-3000:]


KILL_BEFORE_SENTINEL_REMOVAL = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from slurm_jit.checkpoint import protocol

    def die(path, *args, **kwargs):  # the manifest is renamed into place; the sentinel not yet removed
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt = Path(sys.argv[1])
    protocol.write_sentinel(ckpt, 6, "jit")
    (ckpt / "trainer_state.json").write_text('{"global_step": 6}')
    os.remove = die
    protocol.write_manifest(ckpt, step=6, kind="jit", world_size=1, zero_stage=None, deepspeed_tag=None,
                            files=protocol.file_entries(ckpt, protocol.payload_files(ckpt)))
""")


def test_kill_between_manifest_and_sentinel_removal_is_incomplete(tmp_path: Path) -> None:
    # Held: the sentinel is read first, so a manifest already in place does not make the checkpoint complete.
    older = ckpt_factory.checkpoint(tmp_path, 4)
    child = subprocess.run([sys.executable, "-c", KILL_BEFORE_SENTINEL_REMOVAL, str(tmp_path / "checkpoint-6")],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert (tmp_path / "checkpoint-6" / protocol.MANIFEST_NAME).is_file()
    resolution = protocol.find_resumable(tmp_path)
    assert resolution.checkpoint is not None and resolution.checkpoint.path == older
    assert [c.status for c in resolution.passed_over] == [protocol.Status.INCOMPLETE]


def test_rotation_never_deletes_the_only_full_checkpoint_under_save_only_model(tmp_path: Path) -> None:
    # save_only_model, save_total_limit=1: resumed from the JIT checkpoint-6 (the only full one), this run wrote
    # the model-only checkpoint-8. Model-only counted as resumable, so rotation deleted checkpoint-6: after a
    # SIGKILL nothing was left to resume from.
    full = ckpt_factory.checkpoint(tmp_path, 6, created=1_700_000_000.0, contents="full")
    model_only = ckpt_factory.checkpoint(tmp_path, 8, created=1_700_000_100.0, model_only=True,
                                         contents="model_only")
    checkpoints, _ = protocol.scan(tmp_path)
    assert protocol.rotation_victims(checkpoints, 1, keep=[model_only]) == []
    assert protocol.find_resumable(tmp_path).checkpoint.path == full  # type: ignore[union-attr]
