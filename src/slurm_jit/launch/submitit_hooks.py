"""What :class:`~slurm_jit.launch.executor.JitExecutor` needs from the installed submitit, checked at construction.

JitExecutor subclasses ``submitit.SlurmExecutor`` and uses private submitit names (the seams its docs/tips.md
invite subclasses to use). A submitit release that renames one would otherwise fail at the first job on a
cluster; instead the construction fails with one line naming the supported range (as ``train/compat.py`` does
for transformers).
"""

from __future__ import annotations

import inspect
from importlib import metadata

from packaging.version import InvalidVersion, Version

# Keep equal to pyproject.toml's dependency: 1.5.4 added ``teardown`` (lines after srun), which after_step needs.
SUPPORTED_RANGE = "submitit>=1.5.4,<1.6"
LOWEST, BELOW = Version("1.5.4"), Version("1.6")
HINT = f'HINT: pip install "{SUPPORTED_RANGE}"'
# (module path, attribute) pairs JitExecutor and JitJob use or override.
HOOKS = (
    ("submitit.slurm.slurm", "SlurmExecutor._make_submission_file_text"),
    ("submitit.slurm.slurm", "SlurmExecutor._submitit_command_str"),
    ("submitit.slurm.slurm", "SlurmExecutor._make_submission_command"),
    ("submitit.slurm.slurm", "SlurmExecutor._internal_update_parameters"),
    ("submitit.slurm.slurm", "SlurmExecutor._convert_parameters"),
    ("submitit.slurm.slurm", "SlurmExecutor._equivalence_dict"),
    ("submitit.slurm.slurm", "SlurmExecutor._num_tasks"),
    ("submitit.slurm.slurm", "SlurmJob._interrupt"),
    ("submitit.slurm.slurm", "_make_sbatch_string"),
    ("submitit.core.core", "PicklingExecutor.__init__"),
    ("submitit.core.core", "InfoWatcher.register_job"),
    ("submitit.core.core", "InfoWatcher.update"),
    ("submitit.core.core", "InfoWatcher.is_done"),
    ("submitit.core.utils", "JobPaths.result_pickle"),
    ("submitit.core.utils", "JobPaths.submitted_pickle"),
    ("submitit.core.utils", "JobPaths.get_first_id_independent_folder"),
    ("submitit.core.utils", "DelayedSubmission.load"),
    ("submitit.core.utils", "cloudpickle_dump"),
    ("submitit.core.utils", "pickle_load"),
)
# _make_sbatch_string's parameters the JIT script is built from.
SBATCH_STRING_PARAMETERS = ("setup", "teardown", "additional_parameters", "srun_args", "signal_delay_s", "use_srun")


def _has(module_name: str, dotted: str) -> bool:
    import importlib

    try:
        target: object = importlib.import_module(module_name)
    except ImportError:
        return False
    for part in dotted.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True


def problem() -> str | None:
    """Why the installed submitit cannot serve JitExecutor (one line with a HINT), or None."""
    try:
        installed = metadata.version("submitit")
    except metadata.PackageNotFoundError:
        return f"submitit is not installed. {HINT}"
    try:
        version = Version(installed)
    except InvalidVersion:
        return f"submitit {installed}: not a version. {HINT}"
    if not LOWEST <= version < BELOW:
        return f"submitit {installed} is outside the tested range {SUPPORTED_RANGE}. {HINT}"
    missing = [f"{m}.{d}" for m, d in HOOKS if not _has(m, d)]
    if missing:
        return f"submitit {installed} lacks {', '.join(missing)}. {HINT}"
    from submitit.slurm.slurm import _make_sbatch_string

    params = inspect.signature(_make_sbatch_string).parameters
    absent = [name for name in SBATCH_STRING_PARAMETERS if name not in params]
    if absent:
        return f"submitit {installed}: _make_sbatch_string() has no {', '.join(absent)}. {HINT}"
    return None
