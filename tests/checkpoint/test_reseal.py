"""``ckpt-check --reseal CHECKPOINT`` (issue 19): a checkpoint its owner changed on purpose after its manifest
(resharded, converted) is refused at an explicit path with a HINT naming the reseal; the reseal writes a manifest
of the files there now, keeping the old one beside it, and refuses in one line (nothing changed) a checkpoint that
is not structurally whole, a symlink or odd name, an unfinished save, or one a live run's output lock holds.
Real files (tests/ckpt_factory.py), ckpt-check in-process; the live run holding the lock is a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_factory import checkpoint, run_ckpt_check, torch_like_zip

from slurm_jit.checkpoint import protocol
from slurm_jit.train import output_lock
from slurm_jit.train.refusals import resume_refusal

STEP = 7
TAG = f"global_step{STEP}"
BACKUP_GLOB = f".{protocol.MANIFEST_NAME}.before-reseal-*"  # the old manifest, kept beside the new one
HOLDER_START_S = 30.0  # the lock-holding process imports slurm_jit and takes the lock: well under a second idle


def _ds_checkpoint(out: Path, world: int = 2) -> Path:
    return checkpoint(out, STEP, world=world, deepspeed=True)


def _convert(ckpt: Path) -> None:
    """A converted optimizer shard: another size, so the old manifest no longer matches."""
    torch_like_zip(ckpt / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt", payload=b"\x80\x02}q\x00." * 50)


def _reshard(ckpt: Path, world: int) -> None:
    """The same state on ``world`` ranks: every rank's optimizer shard and RNG state, the old ones gone."""
    for path in [*ckpt.glob("rng_state_*.pth"), *(ckpt / TAG).glob("zero_pp_rank_*")]:
        path.unlink()
    for rank in range(world):
        torch_like_zip(ckpt / f"rng_state_{rank}.pth")
        torch_like_zip(ckpt / TAG / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def _backups(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob(BACKUP_GLOB))


def _one_line_refusal(run: object, *words: str) -> str:
    assert run.code == 2, (run.code, run.stdout, run.stderr)  # type: ignore[attr-defined]
    message = run.stderr.strip()  # type: ignore[attr-defined]
    assert "\n" not in message and "HINT:" in message and "not resealed" in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize(("change", "world"), [("converted", 2), ("resharded", 4)])
def test_a_checkpoint_changed_on_purpose_is_refused_then_resealed(tmp_path: Path, change: str, world: int) -> None:
    ckpt = _ds_checkpoint(tmp_path / "out")
    old_manifest = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    _convert(ckpt) if change == "converted" else _reshard(ckpt, world)

    refusal = resume_refusal(ckpt, world_size=world)
    assert refusal is not None and f"HINT: if you changed it on purpose (resharded, converted): ckpt-check " \
        f"--reseal {ckpt};" in refusal, refusal
    assert protocol.inspect(ckpt, STEP).status not in (protocol.Status.COMPLETE, protocol.Status.UNVERIFIED)

    run = run_ckpt_check("--reseal", ckpt)
    assert run.code == 0, run.stderr
    [backup] = _backups(ckpt)
    assert run.stdout.decode().startswith(f"resealed {ckpt}: ") and backup.name in run.stdout.decode()
    assert backup.read_bytes() == old_manifest  # the old manifest, kept as it was
    info = protocol.inspect(ckpt, STEP, deep=True)
    assert info.status is protocol.Status.COMPLETE and info.world_size == world, info
    manifest = json.loads((ckpt / protocol.MANIFEST_NAME).read_text())
    assert manifest["resealed"]["previous_manifest"] == backup.name
    assert manifest["resealed"]["previous_world_size"] == 2 and manifest["kind"] == "periodic"
    assert backup.name not in manifest["files"]
    assert resume_refusal(ckpt, world_size=world) is None
    assert run_ckpt_check(tmp_path / "out").last_line == os.fsencode(str(ckpt))


def test_a_checkpoint_that_still_matches_its_manifest_is_left_alone(tmp_path: Path) -> None:
    ckpt = _ds_checkpoint(tmp_path / "out")
    before = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    run = run_ckpt_check("--reseal", ckpt)
    assert run.code == 0 and b"nothing resealed" in run.stdout, (run.stdout, run.stderr)
    assert (ckpt / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(ckpt)


def test_an_unfinished_save_is_refused_and_its_refusal_does_not_offer_the_reseal(tmp_path: Path) -> None:
    ckpt = _ds_checkpoint(tmp_path / "out")
    _convert(ckpt)
    (ckpt / protocol.SENTINEL_NAME).write_text("a save that did not finish\n")
    refusal = resume_refusal(ckpt, world_size=2)
    assert refusal is not None and "--reseal" not in refusal, refusal
    _one_line_refusal(run_ckpt_check("--reseal", ckpt), protocol.SENTINEL_NAME)
    assert not _backups(ckpt)


@pytest.mark.parametrize("broken", ["rank 1's RNG state gone", "a shard of a 3rd rank only", "'latest' of step 8"])
def test_a_checkpoint_that_is_not_structurally_whole_is_refused_unchanged(tmp_path: Path, broken: str) -> None:
    ckpt = _ds_checkpoint(tmp_path / "out")
    before = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    if broken.startswith("rank 1"):
        (ckpt / "rng_state_1.pth").unlink()
    elif broken.startswith("a shard"):
        torch_like_zip(ckpt / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    else:
        (ckpt / "latest").write_text("global_step8")
    _one_line_refusal(run_ckpt_check("--reseal", ckpt), "not structurally complete")
    assert (ckpt / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(ckpt)


def test_a_new_manifest_that_does_not_verify_puts_the_old_one_back(tmp_path: Path) -> None:
    """Structure whole, but trainer_state.json says another step: the protocol refuses the new manifest, so the
    old one is restored byte for byte and no backup is left."""
    ckpt = _ds_checkpoint(tmp_path / "out")
    before = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": STEP + 1, "log_history": []}))
    _one_line_refusal(run_ckpt_check("--reseal", ckpt), "does not verify", "global_step")
    assert (ckpt / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(ckpt)


def test_symlinks_odd_names_and_manifest_less_checkpoints_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpt = _ds_checkpoint(out)
    _convert(ckpt)
    link = out / "checkpoint-9"
    link.symlink_to(ckpt, target_is_directory=True)
    _one_line_refusal(run_ckpt_check("--reseal", link), "a symlink")
    odd = out / "checkpoint-7.converted"  # (a quarantined checkpoint-7.incomplete: its own test, below)
    os.rename(ckpt, odd)
    _one_line_refusal(run_ckpt_check("--reseal", odd), "not named checkpoint-<step>")
    _one_line_refusal(run_ckpt_check("--reseal", out / "checkpoint-8"), "no such checkpoint directory")
    plain = checkpoint(tmp_path / "plain", 3, manifest=False)
    _one_line_refusal(run_ckpt_check("--reseal", plain), "no manifest to reseal")
    assert not _backups(odd)


def test_a_checkpoint_held_by_a_live_runs_output_lock_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpt = _ds_checkpoint(out)
    _convert(ckpt)
    before = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom slurm_jit.train import output_lock\n"
         "lock, why = output_lock.acquire(sys.argv[1])\nprint('held' if lock else why, flush=True)\n"
         "time.sleep(60)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HOLDER_START_S
        line = holder.stdout.readline() if holder.stdout else ""
        assert line.strip() == "held" and time.monotonic() < deadline, line
        message = _one_line_refusal(run_ckpt_check("--reseal", ckpt), f"pid {holder.pid}", "reseal once that run")
        assert "another output_dir" not in message, message  # the lock's own HINT is for a new training
        assert (ckpt / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(ckpt)
    finally:
        holder.kill()
        holder.wait()
    assert run_ckpt_check("--reseal", ckpt).code == 0  # the run has ended: resealed
    assert output_lock.lock_path(out).read_text() == ""  # and the lock left free, for the next training


@pytest.mark.parametrize("extra", [["--world-size", "4"], ["--quarantine"], ["--deep"], ["--json"]])
def test_reseal_with_another_option_is_refused_unchanged(tmp_path: Path, extra: list[str]) -> None:
    """``--reseal`` does one thing; an option it would silently ignore (a world size the user meant to check, a
    quarantine) is refused in one line, nothing written."""
    ckpt = _ds_checkpoint(tmp_path / "out")
    _convert(ckpt)
    before = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    run = run_ckpt_check("--reseal", *extra, ckpt)
    assert run.code == 2 and not run.stdout, (run.code, run.stdout, run.stderr)
    message = run.stderr.strip()
    assert "\n" not in message and extra[0] in message and "HINT:" in message, message
    assert (ckpt / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(ckpt)


def test_a_quarantined_checkpoint_is_refused_without_advice_to_rename_it(tmp_path: Path) -> None:
    """ckpt-check --quarantine set it aside as not resumable: the refusal says so, and never tells the user to
    rename it back so that a reseal may seal what was found broken."""
    out = tmp_path / "out"
    ckpt = _ds_checkpoint(out)
    quarantined = ckpt.with_name(ckpt.name + protocol.QUARANTINE_SUFFIX)
    ckpt.rename(quarantined)
    message = _one_line_refusal(run_ckpt_check("--reseal", quarantined), "quarantined", "ckpt-check OUT_DIR")
    assert "rename it" not in message, message


def _reseal_under_file_size_limit(ckpt: Path, limit_bytes: int) -> subprocess.CompletedProcess[str]:
    """The ckpt-check command in a process that may write no file past ``limit_bytes`` (RLIMIT_FSIZE: EFBIG, as a
    full disk's ENOSPC, at the write that crosses it)."""
    code = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes}))\n"
            "from slurm_jit.launch import ckpt_check_command\nckpt_check_command.main(sys.argv[1:])\n")
    return subprocess.run([sys.executable, "-c", code, "--reseal", str(ckpt)], capture_output=True, text=True,
                          timeout=HOLDER_START_S)


def test_an_output_dir_whose_lock_cannot_be_written_is_not_called_held_by_a_run(tmp_path: Path) -> None:
    ckpt = _ds_checkpoint(tmp_path / "out")
    _convert(ckpt)
    before = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    run = _reseal_under_file_size_limit(ckpt, 16)  # the lock's record is longer
    assert run.returncode == 2 and "\n" not in run.stderr.strip() and "HINT:" in run.stderr, run.stderr
    assert "cannot be written" in run.stderr and "once that run has ended" not in run.stderr, run.stderr
    assert (ckpt / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(ckpt)


def test_a_manifest_write_that_fails_leaves_the_old_manifest_and_no_partial_file(tmp_path: Path) -> None:
    ckpt = _ds_checkpoint(tmp_path / "out")
    _convert(ckpt)
    before = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    run = _reseal_under_file_size_limit(ckpt, len(before) // 2)  # the lock's record fits, the new manifest not
    assert run.returncode == 2 and "\n" not in run.stderr.strip() and "HINT:" in run.stderr, run.stderr
    assert "not resealed" in run.stderr, run.stderr
    assert (ckpt / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(ckpt)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".")) == [], list(ckpt.iterdir())
    assert protocol.inspect(ckpt, STEP).status is not protocol.Status.COMPLETE  # still the old, changed-after one


def test_ckpt_check_without_the_output_lock_refuses_to_reseal(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    """``python -m slurm_jit.checkpoint.ckpt_check`` (no lock handed in, or an old ``ckpt-check`` script) never
    reseals unlocked: one line naming the command that can."""
    from slurm_jit.checkpoint import ckpt_check

    ckpt = _ds_checkpoint(tmp_path / "out")
    _convert(ckpt)
    before = (ckpt / protocol.MANIFEST_NAME).read_bytes()
    with pytest.raises(SystemExit) as exited:
        ckpt_check.main(["--reseal", str(ckpt)])
    message = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and "\n" not in message, message
    assert f"HINT: run the ckpt-check command (python -m slurm_jit.launch.ckpt_check_command --reseal {ckpt})" \
        in message, message
    assert (ckpt / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(ckpt)


def test_a_superseded_copy_is_refused_without_advice_to_rename_it(tmp_path: Path) -> None:
    """A complete checkpoint a later save of its step replaced: renaming it back to checkpoint-<step> (the generic
    refusal's advice) would put it in the way of that save's checkpoint; the refusal names what it is."""
    out = tmp_path / "out"
    aside = protocol.set_aside_replaced(_ds_checkpoint(out))
    assert protocol.SUPERSEDED_RE.fullmatch(aside.name), aside
    before = (aside / protocol.MANIFEST_NAME).read_bytes()
    message = _one_line_refusal(run_ckpt_check("--reseal", aside), "superseded", "ckpt-check OUT_DIR")
    assert "rename it" not in message, message
    assert (aside / protocol.MANIFEST_NAME).read_bytes() == before and not _backups(aside)
