"""Row 7: nothing is unpickled merely to check a checkpoint, and resume loads with torch's restricted loader
wherever the format allows.

Every ``.pt``/``.pth``/``.bin`` file of a real checkpoint is replaced by a ``torch.save``-like zip whose pickle
runs ``touch MARKER`` when unpickled. ckpt-check runs in a process with an audit hook on ``pickle.find_class``
(every unpickling of a global fires it): quick, ``--deep`` and ``--strict``, with the manifest as it was and with
a manifest rewritten to match the doctored files. The full run also resumes real ranks from doctored checkpoints:

- ``rng_state_0.pth`` doctored, manifest rewritten: transformers loads it with ``weights_only=True``: refused,
  nothing runs;
- an optimizer shard doctored, manifest as written: the resume is refused (``corrupt``) before DeepSpeed loads;
- an optimizer shard doctored AND the manifest rewritten (an attacker who can write the output directory):
  DeepSpeed's ``TorchCheckpointEngine.load`` uses ``torch.load(weights_only=False)`` (its shards hold pickled
  objects: the loss scaler, the DeepSpeed config): the pickle runs. Reported, not counted as a failure: the
  manifest guards against accidents, not against someone who can write the checkpoint.
"""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.checkpoint import protocol
from slurm_jit.faults import common

PICKLED_SUFFIXES = (".pt", ".pth", ".bin")
AUDITED_CHECK = """\
import sys
log = sys.argv.pop(1)
def hook(event, args):
    if event == "pickle.find_class":
        with open(log, "a") as handle:
            handle.write(f"{args}\\n")
sys.addaudithook(hook)
from slurm_jit.checkpoint import ckpt_check
ckpt_check.main(sys.argv[1:])
"""


class _TouchOnUnpickle:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def write_evil(path: Path, marker: Path) -> None:
    """A zip laid out like ``torch.save`` output whose data.pkl runs ``touch marker`` when unpickled."""
    path.unlink(missing_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(_TouchOnUnpickle(marker), protocol=2))
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")


def rewrite_manifest(ckpt: Path) -> None:
    """What someone who can write the checkpoint can do: a manifest that matches the doctored files."""
    manifest, _ = manifest_file.read(ckpt)
    assert manifest is not None
    manifest["files"] = protocol.file_entries(ckpt, protocol.payload_files(ckpt))
    (ckpt / protocol.SENTINEL_NAME).write_text("rewriting\n")
    protocol.write_manifest(ckpt, step=manifest["step"], kind=manifest["kind"], world_size=manifest["world_size"],
                            zero_stage=manifest["zero_stage"], deepspeed_tag=manifest["deepspeed_tag"],
                            files=manifest["files"], contents=manifest.get("contents", "full"),
                            run_id=manifest.get("run_id"), weights=manifest_file.weights_layout(manifest))


def _audited_check(out: Path, log: Path, *flags: str) -> int:
    proc = subprocess.run([sys.executable, "-c", AUDITED_CHECK, str(log), str(out), *flags], capture_output=True,
                          text=True, timeout=common.CHECK_TIMEOUT_S, check=False)
    return proc.returncode


def _check_only(sample: Path, root: Path, tally: common.Tally) -> str:
    seen = []
    for rewritten in (False, True):
        case = common.fresh(root / f"check-rewritten-{rewritten}")
        out, marker, log = case / "out", case / "UNPICKLED", case / "find_class.log"
        ckpt = out / sample.name
        shutil.copytree(sample, ckpt, symlinks=True)
        for path in [p for p in ckpt.rglob("*") if p.suffix in PICKLED_SUFFIXES]:
            write_evil(path, marker)
        if rewritten:
            rewrite_manifest(ckpt)
        codes = [_audited_check(out, log, *flags) for flags in ((), ("--deep",), ("--strict", "--json"))]
        tally.trials += 1
        tally.check(not marker.exists() and not log.exists(),
                    f"ckpt-check unpickled something (manifest rewritten: {rewritten})")
        tally.check(all(code in (0, 1) for code in codes), f"ckpt-check gave no verdict: exits {codes}")
        status = common.statuses(common.ckpt_check(out)).get(int(sample.name.split("-")[1]))
        seen.append(f"{'manifest rewritten' if rewritten else 'manifest as written'}: {status}")
        shutil.copy(sample / protocol.MANIFEST_NAME, case / "kept-manifest.json")
        shutil.rmtree(case)
    return ", ".join(seen)


def _resume(sample: Path, root: Path, name: str, doctor: str, rewrite: bool, args: list[str]) -> tuple[bool, str]:
    """Resume real ranks from a doctored copy: (the pickle ran, the run's last words)."""
    case = common.fresh(root / name)
    out, marker = case / "out", case / "UNPICKLED"
    ckpt = out / sample.name
    shutil.copytree(sample, ckpt, symlinks=True)
    write_evil(next(ckpt.glob(doctor)), marker)
    if rewrite:
        rewrite_manifest(ckpt)
    codes, log = common.run(out, [*args, "--resume"])
    last = next((line for line in reversed(log.splitlines()) if "Error" in line or "slurm_jit:" in line), "")
    ran = marker.exists()
    shutil.rmtree(case)
    return ran, f"exit {codes}: {last.strip()[:160]}"


def run_row(root: Path, sample: Path, quick: bool, resume_args: list[str]) -> common.Row:
    t0 = time.monotonic()
    tally = common.Tally()
    detail = "ckpt-check (quick, --deep, --strict) on a checkpoint whose every pickle runs code: " + \
        _check_only(sample, root, tally) + "; no pickle.find_class audit event, nothing ran"
    if not quick:
        ran, rng = _resume(sample, root, "rng", "rng_state_0.pth", True, resume_args)
        tally.trials += 1
        tally.check(not ran, f"resume unpickled a doctored rng_state_0.pth: {rng}")
        ran, shard = _resume(sample, root, "shard", "global_step*/*optim_states.pt", False, resume_args)
        tally.trials += 1
        tally.check(not ran, f"resume unpickled a doctored shard the manifest does not match: {shard}")
        ran_ds, ds = _resume(sample, root, "shard-rewritten", "global_step*/*optim_states.pt", True, resume_args)
        detail += (f". Resume: doctored rng_state_0.pth (manifest rewritten) refused by weights_only=True ({rng}); "
                   f"doctored shard, manifest as written: refused before loading ({shard}); doctored shard AND "
                   f"manifest rewritten: DeepSpeed unpickles it (weights_only=False, documented): "
                   f"{'the pickle ran' if ran_ds else 'the pickle did not run'}")
    return tally.row("security: no unpickling to check", detail, time.monotonic() - t0)
