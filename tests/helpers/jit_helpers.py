"""Helpers for the JitTrainer tests: start real DeepSpeed ranks, signal them as Slurm would, read what they left.

The one place for test helpers: test files import from here (or use conftest fixtures), never from each other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_jit import local_ranks, timing
from slurm_jit.checkpoint import manifest as manifest_file
from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.ckpt_check import WEIGHTS_SHOWN
from slurm_jit.train import stop_record

START_TIMEOUT_S = 300  # a fresh machine builds DeepSpeed's CPU comm op on first use (~80 s on 2 cores)
# Not a benchmark: a hang detector. A stop that does not end within this long after the last signal is hung
# (upstream hangs until the 30-minute collective timeout); a healthy one ends within kill_wait + a step + a save.
STOP_DEADLINE_S = 45
POLL_S = 0.01  # how often the signal scheduler looks for a new checkpoint directory and for exited ranks
# The JIT save starts once kill_wait since the first signal has passed, at a step boundary; the agreement round
# is read one step after it was sent, so the save may start up to this many steps late.
STEPS_TO_STOP = 2
# Scheduling noise on a loaded 2-core host between an event in a rank and this test process seeing it.
SCHEDULING_SLACK_S = 1.0
# From the end of the JIT save (its manifest) until every rank has exited: rotation, the stop record,
# upstream's end of training, the final barrier, destroy_process_group and interpreter exit (2-4 s idle).
TEARDOWN_S = 20.0
# How a DeepSpeed model-states file is named: the model weights again beside the optimizer's fp32 copy.
MODEL_STATES_GLOB = "global_step*/mp_rank_*_model_states.pt"
ZERO3_MODEL_STATES_GLOB = "global_step*/zero_pp_rank_*_mp_rank_*_model_states.pt"  # buffers, no weights


def losses(out: Path) -> list[tuple[int, float]]:
    path = out / "losses-rank0.jsonl"
    if not path.exists():
        return []
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines()) if r]



def logged(out: Path) -> list[dict[str, float]]:
    """Every value rank 0 logged (demo_train's logs-rank0.jsonl: the timings left out), in order, across the runs."""
    path = out / "logs-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def final_losses(out: Path) -> list[tuple[int, float]]:
    """Per step, the loss of the last run that logged it (a stopped run may log steps its resume repeats)."""
    final: dict[int, float] = {}
    for step, loss in losses(out):
        final[step] = loss
    return sorted(final.items())

@dataclass
class StopResult:
    codes: list[int | None]
    stop_s: float  # from the first signal until every rank exited
    log: str  # what the ranks of this run wrote (both ranks)
    save_start_s: float | None = None  # from the first signal until a new checkpoint directory appeared


@dataclass
class RunResult:
    codes: list[int | None]
    log: str  # what the ranks of this run wrote (rank 0, then rank 1), without earlier runs' lines


_started: list[local_ranks.Ranks] = []  # every group of ranks started here, for kill_leftover_ranks


def kill_leftover_ranks() -> None:
    """SIGKILL every rank group started by these helpers that still runs (a failed or timed-out test's)."""
    while _started:
        _started.pop().kill()


def _log_dir(out: Path) -> Path:
    return out.parent / f"logs-{out.name}"


DEMO = ["-m", "slurm_jit.demo_train"]  # what the helpers start unless told ``program`` (e.g. [examples/x.py])


def _start(out: Path, args: list[str], env: dict[str, str] | None,
           program: list[str] | None = None) -> tuple[local_ranks.Ranks, list[int]]:
    """Start 2 ranks of ``program`` (demo_train when None); also returns the size of each rank log before the
    start (logs are appended to)."""
    log_dir = _log_dir(out)
    offsets = [(log_dir / f"rank{r}.log").stat().st_size if (log_dir / f"rank{r}.log").exists() else 0
               for r in range(2)]
    ranks = local_ranks.start([*(program or DEMO), "--output-dir", str(out), *args], 2, log_dir, env=env)
    _started.append(ranks)
    return ranks, offsets


def start_ranks(out: Path, args: list[str], env: dict[str, str] | None = None,
                program: list[str] | None = None) -> local_ranks.Ranks:
    """Start 2 ranks of demo_train, or of ``program`` taking its arguments (killed after the test if still
    running); logs under logs-<out name>."""
    return _start(out, args, env, program)[0]


def _new_log(ranks: local_ranks.Ranks, offsets: list[int]) -> str:
    return "".join(p.read_bytes()[o:].decode(errors="replace") for p, o in zip(ranks.logs, offsets, strict=True))


def run_to_end(out: Path, args: list[str], env: dict[str, str] | None = None) -> list[int | None]:
    return run_logged(out, args, env).codes


def run_logged(out: Path, args: list[str], env: dict[str, str] | None = None,
               program: list[str] | None = None) -> RunResult:
    """Run 2 ranks to their end; returns the exit codes and this run's own log lines."""
    ranks, offsets = _start(out, args, env, program)
    codes = ranks.wait(START_TIMEOUT_S)
    return RunResult(codes=codes, log=_new_log(ranks, offsets))


def wait_for(ranks: local_ranks.Ranks, what: str, done: Callable[[], bool], timeout_s: float = START_TIMEOUT_S,
             poll_s: float = 0.02) -> None:
    """Poll ``done()`` until true; fail (and kill the ranks) when a rank exits first or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if any(p.poll() is not None for p in ranks.procs) or time.monotonic() > deadline:
            ranks.kill()
            raise AssertionError(f"never {what} (within {timeout_s:.0f} s):\n{ranks.log(0)[-3000:]}")
        time.sleep(poll_s)


def wait_for_steps(ranks: local_ranks.Ranks, out: Path, n: int) -> None:
    wait_for(ranks, f"reached step {n}", lambda: len(losses(out)) >= n)


def _checkpoint_names(out: Path) -> set[str]:
    return {p.name for p in out.glob("checkpoint-*")} if out.is_dir() else set()


def run_and_signal(out: Path, args: list[str], plan: list[tuple[int, float]], after_steps: int = 3,
                   signum: int = signal.SIGTERM, env: dict[str, str] | None = None,
                   wait_until: str | None = None, program: list[str] | None = None) -> StopResult:
    """Start 2 ranks; once ``after_steps`` are logged (or ``wait_until`` exists), send ``signum`` to each
    (rank, delay-since-previous-signal) of ``plan``, to the rank's whole process group as Slurm does. Meanwhile
    note when a new checkpoint directory appears (the sentinel is its first file)."""
    ranks, offsets = _start(out, args, env, program)
    if wait_until is None:
        wait_for_steps(ranks, out, after_steps)
    else:
        wait_for(ranks, f"saw {wait_until}", lambda: bool(list(out.parent.glob(wait_until))), poll_s=POLL_S)
    before = _checkpoint_names(out)
    first = time.monotonic()
    due, elapsed = [], 0.0
    for rank, delay in plan:
        elapsed += delay
        due.append((first + elapsed, rank))
    deadline = first + elapsed + STOP_DEADLINE_S
    save_start_s = None
    while time.monotonic() < deadline and (due or any(p.poll() is None for p in ranks.procs)):
        now = time.monotonic()
        while due and due[0][0] <= now:
            ranks.signal(due.pop(0)[1], signum)
        if save_start_s is None and _checkpoint_names(out) - before:
            save_start_s = now - first
        time.sleep(POLL_S)
    codes = ranks.wait(0.1)  # SIGKILLs what still runs: a hang
    stop_s = time.monotonic() - first
    return StopResult(codes=codes, stop_s=stop_s, log=_new_log(ranks, offsets), save_start_s=save_start_s)


def ckpt_check(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_jit.checkpoint.ckpt_check", str(out), *flags],
                          capture_output=True, text=True, check=False)


def _sizes_on_disk(ckpt: Path) -> dict[str, int]:
    """Relative path -> size of every regular file under ``ckpt``, read from the file system."""
    sizes = {}
    for root, _, names in os.walk(ckpt):
        for name in names:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                sizes[str(path.relative_to(ckpt))] = path.stat().st_size
    return sizes


def assert_byte_report_matches_disk(ckpt: Path, jit_weights: str = protocol.WEIGHTS_MASTER_ONLY) -> None:
    """The manifest's byte report against the files on disk: the total is what is there (less the manifest);
    the duplicate is exactly the DeepSpeed model-states file(s) that hold the whole model (ZeRO-0/1/2 periodic and
    final saves), and nothing for a slim JIT save under ZeRO-1/2 (its model-states file leaves the weights out)
    nor under ZeRO-3, whose per-rank model-states files hold no weights (they are in the optimizer shards).
    ``jit_weights``: the layout of a JIT save under ZeRO-1/2 (a PEFT model's: frozen-excluded-master-only, whose
    model-states file holds placeholders for the adapters)."""
    manifest = json.loads((ckpt / protocol.MANIFEST_NAME).read_text())
    sizes = _sizes_on_disk(ckpt)
    assert protocol.SENTINEL_NAME not in sizes
    on_disk = sum(size for rel, size in sizes.items() if rel != protocol.MANIFEST_NAME)
    assert manifest["total_bytes"] == on_disk, (manifest["total_bytes"], on_disk)
    whole_model = sorted(ckpt.glob(MODEL_STATES_GLOB))
    partitioned = sorted(ckpt.glob(ZERO3_MODEL_STATES_GLOB))
    assert bool(whole_model) != bool(partitioned), f"model-states files in {ckpt}: {whole_model + partitioned}"
    # a JIT save under ZeRO-1/2 (slim: weights "fp32-master-only") leaves the weights out of the model states
    slim = manifest.get("weights") in protocol.MASTER_ONLY
    jit_zero12 = manifest["kind"] == "jit" and manifest["zero_stage"] in (1, 2)
    expect_slim = bool(partitioned) or (jit_zero12 and jit_weights in protocol.MASTER_ONLY)
    assert slim == expect_slim, (manifest.get("weights"), manifest["kind"], manifest["zero_stage"])
    if jit_zero12:
        assert manifest["weights"] == jit_weights, manifest["weights"]
    duplicate = 0 if slim else sum(p.stat().st_size for p in whole_model)
    assert manifest["bytes_weights_duplicate"] == duplicate, (manifest["bytes_weights_duplicate"], duplicate)
    assert manifest["bytes_needed_for_resume"] == on_disk - duplicate


def assert_jit_stop(out: Path, result: StopResult, weights: str = protocol.WEIGHTS_MASTER_ONLY) -> Path:
    """The run stopped for a JIT checkpoint that ckpt-check calls complete, whose DeepSpeed tag is its step;
    ``weights``: its layout under ZeRO-1/2 (a PEFT model's: frozen-excluded)."""
    assert result.codes == [0, 0], result.log[-4000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    ckpt = Path(record["checkpoint"])
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines()[-1] == str(ckpt)
    info = protocol.inspect(ckpt, record["step"], deep=True)
    assert info.status is protocol.Status.COMPLETE and info.kind == "jit", info
    if info.zero_stage:  # ZeRO-1/2: the slim JIT save; ZeRO-3: DeepSpeed's own layout. ckpt-check says so.
        expected = protocol.WEIGHTS_MASTER_ONLY if info.zero_stage == manifest_file.ZERO3 else weights
        assert info.weights == expected, info
        row = next(line for line in check.stdout.splitlines() if line.split()[:1] == [str(record["step"])])
        assert f" {WEIGHTS_SHOWN[expected]} " in row, row
    assert (ckpt / "latest").read_text().strip() == f"global_step{record['step']}"
    # what resume needs, once: no consolidated weights beside the DeepSpeed shards, and the excess is reported
    assert not (ckpt / "model.safetensors").exists()
    assert_byte_report_matches_disk(ckpt, weights)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == record["step"]
    return ckpt


def assert_stop_checkpoint(out: Path, result: StopResult, save_steps: int | None) -> Path:
    """:func:`assert_jit_stop`, except for a stop that lands on a periodic save step (``--save-steps``): a stop
    agreed at the step's boundary writes the JIT save there, one that comes during the periodic save takes that
    save (train/stop_path.py), whichever the timing gives. Either way ONE complete full checkpoint of that step,
    the one ckpt-check picks and the stop record names."""
    assert result.codes == [0, 0], result.log[-4000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop", record
    ckpt = Path(record["checkpoint"])
    info = protocol.inspect(ckpt, record["step"], deep=True)
    if not (save_steps and record["step"] % save_steps == 0 and info.kind == "periodic"):
        return assert_jit_stop(out, result)
    check = ckpt_check(out, "--deep")
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines()[-1] == str(ckpt)
    assert info.status is protocol.Status.COMPLETE, info
    assert ckpt.name == f"checkpoint-{record['step']}", ckpt
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == record["step"]
    return ckpt


def assert_stop_timing(out: Path, result: StopResult, kill_wait_s: float) -> None:
    """The JIT save began no sooner than kill_wait after the FIRST signal (on any rank) and at most
    STEPS_TO_STOP steps later; every rank exited within TEARDOWN_S of the save's end (no hang)."""
    summary = timing.load_summary(out)
    step_max_s = summary.step_max_s or 0.0
    jit_saves = summary.saves.get("jit")
    assert jit_saves is not None, summary
    assert result.save_start_s is not None, "no checkpoint directory appeared after the signal"
    latest_start_s = kill_wait_s + STEPS_TO_STOP * step_max_s + SCHEDULING_SLACK_S
    assert kill_wait_s - SCHEDULING_SLACK_S / 10 <= result.save_start_s <= latest_start_s, (
        f"JIT save began {result.save_start_s:.2f} s after the first signal; expected kill_wait {kill_wait_s} s "
        f"to {latest_start_s:.2f} s (steps up to {step_max_s:.2f} s)")
    stop_bound_s = latest_start_s + jit_saves.max_dur_s + TEARDOWN_S
    assert result.stop_s <= stop_bound_s, (
        f"ranks exited {result.stop_s:.1f} s after the first signal > kill_wait + {STEPS_TO_STOP} steps + save "
        f"{jit_saves.max_dur_s:.1f} s + teardown {TEARDOWN_S} s = {stop_bound_s:.1f} s")


def resume_and_compare(out: Path, args: list[str], reference: list[tuple[int, float]], rel_tol: float = 0.0,
                       expect_from: Path | None = None, env: dict[str, str] | None = None) -> RunResult:
    """Resume with ``--resume``; this run says it resumed from ``expect_from`` (the stop record's checkpoint when
    None), and every step's loss of both runs equals the uninterrupted ``reference`` run's."""
    record = stop_record.read(out)
    if expect_from is None:
        assert record is not None and record.get("checkpoint"), record
        expect_from = Path(record["checkpoint"])
    result = run_logged(out, [*args, "--resume"], env)
    assert result.codes == [0, 0], result.log[-4000:]
    assert f"resuming from {expect_from} " in result.log, result.log[-4000:]
    assert_same_losses(losses(out), reference, rel_tol)
    return result


def assert_same_losses(resumed: list[tuple[int, float]], reference: list[tuple[int, float]],
                       rel_tol: float = 0.0) -> None:
    """Every step logged once, in order, and each loss equal to the uninterrupted run's (bitwise when 0)."""
    steps = [s for s, _ in resumed]
    assert steps == [s for s, _ in reference], f"steps lost or repeated: {steps}"
    for (step, got), (_, want) in zip(resumed, reference, strict=True):
        if rel_tol == 0.0:
            assert got == want, f"step {step}: {got!r} != {want!r}"
        else:
            assert abs(got - want) <= rel_tol * abs(want), f"step {step}: {got!r} vs {want!r}"


def flip_middle_byte(path: Path, mask: int = 0x01) -> None:
    """Damage a file without changing its size: only a checksum can tell."""
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= mask
    path.write_bytes(bytes(blob))


def start_demo(out: Path, args: list[str], world_size: int = 2, log_dir: Path | None = None,
               env: dict[str, str] | None = None, program: list[str] | None = None) -> local_ranks.Ranks:
    """Start ``world_size`` ranks of demo_train, or of ``program`` taking its arguments (logs in
    OUT/../logs-<out name> unless ``log_dir``)."""
    return local_ranks.start([*(program or DEMO), "--output-dir", str(out), *args], world_size,
                             log_dir or out.parent / f"logs-{out.name}", env=env)


def run_demo(out: Path, args: list[str], world_size: int, program: list[str] | None = None) -> str:
    """Run ``world_size`` ranks of demo_train (or ``program``) to their end; asserts every rank exits 0; returns
    their logs."""
    ranks = start_demo(out, args, world_size, program=program)
    codes = ranks.wait(START_TIMEOUT_S)
    log = "\n".join(ranks.log(r) for r in range(world_size))
    assert codes == [0] * world_size, log[-4000:]
    return log


def wait_for_path(ranks: local_ranks.Ranks, path: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until ``path`` exists; fails (and kills the ranks) when they exit first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if any(p.poll() is not None for p in ranks.procs) or time.monotonic() > deadline:
            ranks.kill()
            raise AssertionError(f"{path} never appeared:\n{ranks.log(0)[-3000:]}")
        time.sleep(0.02)


# wandb's transaction log (run-<id>.wandb): a 7-byte header, then LevelDB's log format (32 KiB blocks, each record
# a 7-byte header: crc32 uint32, length uint16, type uint8) whose records are serialized wandb Record protobufs.
# wandb 0.31 has no Python reader of its own (its Go core reads them), so this is the few lines it takes.
WANDB_FILE_MAGIC = b":W&B"
WANDB_FILE_HEADER_BYTES = 7
LEVELDB_BLOCK_BYTES = 32 * 1024
LEVELDB_RECORD_HEADER_BYTES = 7
LEVELDB_FULL, LEVELDB_FIRST, LEVELDB_MIDDLE, LEVELDB_LAST = 1, 2, 3, 4


def _leveldb_records(data: bytes) -> list[bytes]:
    import struct

    records, pending, pos = [], b"", WANDB_FILE_HEADER_BYTES
    while pos + LEVELDB_RECORD_HEADER_BYTES <= len(data):
        left = LEVELDB_BLOCK_BYTES - pos % LEVELDB_BLOCK_BYTES
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + LEVELDB_RECORD_HEADER_BYTES])
        if left < LEVELDB_RECORD_HEADER_BYTES or (kind == 0 and length == 0):  # a block's zero-padded tail
            pos += left
            continue
        if pos + LEVELDB_RECORD_HEADER_BYTES + length > len(data):
            break  # still being written
        chunk = data[pos + LEVELDB_RECORD_HEADER_BYTES:pos + LEVELDB_RECORD_HEADER_BYTES + length]
        pos += LEVELDB_RECORD_HEADER_BYTES + length
        if kind in (LEVELDB_FULL, LEVELDB_FIRST):
            pending = chunk
        elif kind in (LEVELDB_MIDDLE, LEVELDB_LAST):
            pending += chunk
        if kind in (LEVELDB_FULL, LEVELDB_LAST):
            records.append(pending)
    return records


@dataclass
class WandbJob:
    """What one job wrote into its offline run directory."""
    run_id: str
    history: list[dict[str, object]]  # each wandb.log() row, values decoded from JSON
    summary: dict[str, object]  # the last value of each summary key
    preempting: bool  # run.mark_preempting() was called
    exit_code: int | None
    start_time: float = 0.0  # the run record's start (epoch s): the order of the jobs



WANDB_FLUSH_TIMEOUT_S = 30.0  # wandb.finish() and a rank's exit return before wandb's service process has written all


def read_wandb_offline(wandb_dir: Path) -> list[WandbJob]:
    """Every offline run under ``wandb_dir`` (WANDB_DIR/wandb), oldest first, read through wandb's own protobuf;
    each once its file is complete (its exit record is there)."""
    deadline = time.monotonic() + WANDB_FLUSH_TIMEOUT_S
    while True:
        jobs = [_read_wandb_file(path) for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb"))]
        if all(job.exit_code is not None for job in jobs) or time.monotonic() > deadline:
            # the directory name holds the start second only: two runs in one second sort by their id
            return sorted(jobs, key=lambda job: job.start_time)
        time.sleep(POLL_S)


def _read_wandb_file(path: Path) -> WandbJob:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    job = WandbJob(run_id="", history=[], summary={}, preempting=False, exit_code=None)
    if data.startswith(WANDB_FILE_MAGIC):  # else still empty: no exit record, read again
        for raw in _leveldb_records(data):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                job.run_id = record.run.run_id
                job.start_time = record.run.start_time.ToNanoseconds() / 1e9
            elif kind == "history":
                job.history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                    for i in record.history.item})
            elif kind == "summary":
                job.summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                    for i in record.summary.update})
            elif kind == "preempting":
                job.preempting = True
            elif kind == "exit":
                job.exit_code = record.exit.exit_code
    return job


# A child process that says whether another process holds a POSIX lock on argv[1] ("busy") or not ("free").
LOCK_BUSY = """\
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    print("busy")
else:
    print("free")
"""


def train_one_process(out: Path, report_to: str, max_steps: int, resume: bool | str, per_device: int = 2,
                      accumulation: int = 1, dataset: Any = None, epochs: float = 0.0,
                      **training_args: Any) -> Any:
    """One process, a real JitTrainer on a tiny GPT-2, no DeepSpeed (~15 s): trains to ``max_steps`` (or
    ``epochs`` with max_steps -1), saving every 2 steps, resuming from the newest checkpoint when ``resume`` is
    True (or from that path); returns the trainer. ``dataset``: default 8 token sequences; ``training_args``: more
    TrainingArguments."""
    import transformers

    from slurm_jit import demo_train
    from slurm_jit.train.trainer import JitConfig, JitTrainer

    targs = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[report_to],
                                           max_steps=max_steps, save_steps=2, per_device_train_batch_size=per_device,
                                           gradient_accumulation_steps=accumulation, disable_tqdm=True,
                                           logging_steps=1, **({"num_train_epochs": epochs} if epochs else {}),
                                           **training_args)
    trainer = JitTrainer(model=demo_train.build_model("gpt2", 16, 1), args=targs,
                         train_dataset=dataset if dataset is not None else demo_train._Tokens(8, seed=1),
                         jit_config=JitConfig(kill_wait_s=0))
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


class RecordedTokens:
    """A map-style dataset of demo_train's token sequences that records the index of every sample fetched, in order
    (no DataLoader workers: fetched in the training process): which samples a run trained on."""

    def __init__(self, n: int) -> None:
        from slurm_jit import demo_train

        self.tokens = demo_train._Tokens(n, seed=1)
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.fetched.append(int(i))
        return self.tokens[i]
