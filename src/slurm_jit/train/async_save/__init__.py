"""Asynchronous periodic saves (issue #23), their parts: training copies a save's states into host memory
(:mod:`.staging`, guarded by :mod:`.memory_guard`) and continues; one background thread per process writes them
durably (:mod:`.writer`); each rank's done marker, and rank 0's commit once all exist (:mod:`.commit`). Wired into
the trainer behind ``JitConfig(async_periodic_saves=True)`` (off by default) by :mod:`.periodic`.
"""

from slurm_jit.train.async_save.memory_guard import HOST_MEMORY_MARGIN_BYTES, HostMemoryError, check_host_memory
from slurm_jit.train.async_save.staging import HostStager, StagedSave, StagingBusyError
from slurm_jit.train.async_save.writer import BackgroundWriter, Submitted, WriteStats

__all__ = [
    "HOST_MEMORY_MARGIN_BYTES", "BackgroundWriter", "HostMemoryError", "HostStager", "StagedSave",
    "StagingBusyError", "Submitted", "WriteStats", "check_host_memory",
]
