"""Judging a parsed batch script (sbatch_script.SbatchScript) against the grace it needs: ``grace-calc check``'s
findings, each ok, warn or fail, with a HINT for what is not ok."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_jit.grace.calc import (
    GRACE_FRACTION_WARN,
    LAUNCHER_KILL_AFTER_S,
    LEAD_ENV_VAR,
    SLURM_SIGNAL_EARLY_S,
    ClusterFacts,
    GraceResult,
    cluster_notes,
)
from slurm_jit.grace.sbatch_script import Launch, SbatchScript, ScriptError, SignalSpec


@dataclass(frozen=True, kw_only=True)
class Finding:
    level: str  # "ok", "warn" or "fail" (fail: exit 1)
    message: str  # what was found; for warn and fail, a HINT on how to fix it


@dataclass(frozen=True, kw_only=True)
class CheckReport:
    """Everything ``grace-calc check`` found in one script."""

    script: SbatchScript
    findings: tuple[Finding, ...]

    @property
    def exit_code(self) -> int:
        return 1 if any(f.level == "fail" for f in self.findings) else 0


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fixed_signal(sig: SignalSpec, lead_s: int) -> str:
    return f"#SBATCH --signal={'B:' if sig.batch_only else ''}TERM@{lead_s}"


def _check_lead(script: SbatchScript, sig: SignalSpec, result: GraceResult) -> list[Finding]:
    where = f"line {script.signal_lineno}: --signal={sig.text}"
    default = "" if "@" in sig.text else " (sbatch's default when no @N is given)"
    if sig.lead_s < result.lead_s:
        return [Finding(level="fail", message=(
            f"{where}: lead {sig.lead_s} s{default} < needed {result.lead_s} s. HINT: use "
            f"{_fixed_signal(sig, result.lead_s)}"))]
    findings = [Finding(level="ok", message=f"{where}: lead {sig.lead_s} s >= needed {result.lead_s} s")]
    # Beyond the needed lead plus what the early signal already costs, extra lead is compute thrown away.
    slack_s = sig.lead_s - result.lead_s
    if slack_s > max(SLURM_SIGNAL_EARLY_S, result.lead_s):
        findings.append(Finding(level="warn", message=(
            f"{where}: {slack_s} s more than needed, thrown away at every job end. HINT: use "
            f"{_fixed_signal(sig, result.lead_s)}")))
    return findings


def _check_time_limit(script: SbatchScript, sig: SignalSpec) -> list[Finding]:
    limit_s = script.time_limit_s
    if limit_s is None:
        return [Finding(level="ok", message="no --time: the partition's default time limit applies")]
    if sig.lead_s >= limit_s:
        return [Finding(level="fail", message=(
            f"--signal lead {sig.lead_s} s >= --time {limit_s} s: the signal is due as soon as the job "
            "starts. HINT: ask for a longer --time"))]
    early_s = sig.lead_s + SLURM_SIGNAL_EARLY_S
    if early_s > GRACE_FRACTION_WARN * limit_s:
        return [Finding(level="warn", message=(
            f"--signal lead {sig.lead_s} s (+{SLURM_SIGNAL_EARLY_S} s early) is {early_s / limit_s:.0%} of "
            f"--time {limit_s} s. HINT: ask for a longer --time, or make the checkpoint faster"))]
    return [Finding(level="ok", message=f"--time {limit_s} s leaves at least {limit_s - early_s} s to train")]


def _check_reach(script: SbatchScript, sig: SignalSpec, launch: Launch, result: GraceResult) -> list[Finding]:
    where, cmd, name = f"line {launch.lineno}", _short(launch.text), f"SIG{sig.name}"
    if not sig.batch_only:
        if not launch.via_srun:
            return [Finding(level="fail", message=(
                f"{where}: `{cmd}` runs in the batch shell, but --signal without B: goes to job steps (srun) "
                f"only: {name} never reaches Python. HINT: start it with srun, one task per rank (`srun "
                "python ...`)"))]
        reach = Finding(level="ok", message=f"{where}: runs in an srun job step, which --signal reaches")
    elif launch.uses_exec:
        forward = " (srun forwards it to its tasks, srun(1))" if launch.via_srun else ""
        message = f"{where}: `exec` made it the batch shell, which B: signals{forward}"
        reach = Finding(level="ok", message=message)
    elif script.traps_signal and launch.background:
        reach = Finding(level="ok", message=(
            f"{where}: B: signals the batch shell; assuming its trap forwards {name} to the training"))
    elif script.traps_signal:
        return [Finding(level="fail", message=(
            f"{where}: with B: the batch shell traps {name}, but bash runs a trap only after the foreground "
            "command ends. HINT: start the launch with `&` and then `wait`, or drop B: and launch with "
            "srun"))]
    else:
        return [Finding(level="fail", message=(
            f"{where}: with B: only the batch shell gets {name}; `{cmd}` is its child and never gets it. "
            f"HINT: drop B: ({_fixed_signal(sig, max(sig.lead_s, result.lead_s)).replace('B:', '')}) and "
            "start it with srun, or start it with `exec`"))]
    return [reach, *_check_launcher(launch, result)]


def _check_launcher(launch: Launch, result: GraceResult) -> list[Finding]:
    where, cmd = f"line {launch.lineno}", _short(launch.text)
    findings: list[Finding] = []
    if launch.launcher in LAUNCHER_KILL_AFTER_S:
        cap_s = LAUNCHER_KILL_AFTER_S[launch.launcher]
        if result.needed_s > cap_s:
            findings.append(Finding(level="fail", message=(
                f"{where}: {launch.launcher} SIGKILLs its workers {cap_s} s after it forwards SIGTERM: the "
                f"checkpoint gets {cap_s} s < needed {result.lead_s} s. HINT: start one task per rank "
                f"with srun (`srun --ntasks-per-node=GPUS python train.py`) instead of {launch.launcher}")))
        else:
            findings.append(Finding(level="ok", message=(
                f"{where}: {launch.launcher} kills its workers {cap_s} s after SIGTERM; needed "
                f"{result.lead_s} s fits")))
    elif not launch.runs_python:
        findings.append(Finding(level="warn", message=(
            f"{where}: cannot see what `{cmd}` runs; assuming it is the training, with no torchrun in "
            "between. HINT: put the python command on the srun line")))
    return findings


def _check_signal_name(sig: SignalSpec) -> list[Finding]:
    if sig.name == "TERM":
        return []
    return [Finding(level="warn", message=(
        f"--signal sends SIG{sig.name}, but Slurm sends SIGTERM at the time limit and at preemption, and "
        f"Python dies of SIG{sig.name} unless the trainer handles it. HINT: use --signal=TERM@N"))]


def _check_export(script: SbatchScript, sig: SignalSpec) -> list[Finding]:
    exported = script.exported_lead
    if exported is None:
        return [Finding(level="warn", message=(
            f"the script does not export {LEAD_ENV_VAR}, so the trainer does not know its budget. HINT: add "
            f"`export {LEAD_ENV_VAR}={sig.lead_s}`"))]
    if exported.startswith("$") or exported == str(sig.lead_s):
        return [Finding(level="ok", message=f"exports {LEAD_ENV_VAR}={exported}")]
    return [Finding(level="fail", message=(
        f"exports {LEAD_ENV_VAR}={exported} but the --signal lead is {sig.lead_s} s: the trainer would "
        f"budget with the wrong number. HINT: export {LEAD_ENV_VAR}= the same N as --signal=TERM@N"))]


def check_script(script: SbatchScript, result: GraceResult, facts: ClusterFacts) -> CheckReport:
    """Compare a script with the needed grace; ScriptError (exit 2) when it has no --signal or launch."""
    sig = script.signal
    if sig is None:
        if script.ignored_signal_lineno is not None:
            raise ScriptError(
                f"{script.path}:{script.ignored_signal_lineno}: #SBATCH --signal comes after the first "
                "command, and sbatch ignores it there. HINT: move it up, above the first command"
            )
        raise ScriptError(f"{script.path}: no #SBATCH --signal. HINT: add {_fixed_signal_plain(result)}")
    if not script.launches:
        raise ScriptError(
            f"{script.path}: no training launch found (srun, python, torchrun, deepspeed). HINT: start the "
            "training with `srun python ...`"
        )
    findings = _check_signal_name(sig) + _check_lead(script, sig, result) + _check_time_limit(script, sig)
    for launch in script.launches:
        findings += _check_reach(script, sig, launch, result)
    findings += [Finding(level="ok", message=(
        f"line {side.lineno}: `{_short(side.text)}` runs in the batch shell and gets no signal; taken as a "
        "pre/post step, not the training")) for side in script.side_launches]
    findings += _check_export(script, sig) + _check_node_range(script)
    findings += [Finding(level="warn", message=w) for w in cluster_notes(result, facts)[1]]
    return CheckReport(script=script, findings=tuple(findings))


def _check_node_range(script: SbatchScript) -> list[Finding]:
    """A node range: a start (a requeue too) may get its fewest nodes, whose optimizer steps are the longest once
    the JitTrainer keeps the global batch; the lead checked above is sized for the ranks the times came from."""
    if script.nodes is None or not script.nodes.elastic:
        return []
    return [Finding(level="warn", message=(
        f"{script.path}: #SBATCH --nodes={script.nodes.sbatch_value()}: a start (a requeue too) may get "
        f"{script.nodes.min_nodes} node(s), and its steps are longer (the global batch is kept by more gradient "
        "accumulation); the lead above is sized for the world size of the times given. HINT: check it for the "
        f"fewest: --world-size <ranks on {script.nodes.min_nodes} node(s)> with --from OUT_DIR (scaled as after a "
        "shrink), or submit through launch/submit.py, which sizes a range for its fewest nodes"))]


def _fixed_signal_plain(result: GraceResult) -> str:
    return f"#SBATCH --signal=TERM@{result.lead_s} (and export {LEAD_ENV_VAR}={result.lead_s})"
