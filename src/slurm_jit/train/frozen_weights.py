"""The frozen weights a checkpoint leaves out, and the check that a resume's model has the same ones.

A PEFT model's saves leave its frozen base out (``weights: frozen-excluded``, as transformers' own
``exclude_frozen_parameters``): a resume takes the frozen weights from the model the user's script built. Another
base (another model, revision, seed, dtype or quantisation) would then train the checkpoint's adapters on weights
they were never trained with, silently. So a fingerprint of the frozen tensors (xxh3 over each one's name, dtype,
shape and bytes) is computed once per ``train()``, on rank 0 before DeepSpeed casts or wraps the model, written
into the manifest of every checkpoint that leaves them out (``frozen_fingerprint``), and compared before any step
of a resume: a difference is refused in one line naming how many differ and the first one.

Models that are not PEFT keep their frozen parameters in every checkpoint (their elastic resume restores them from
the saved module: ``elastic_unheld.py``); their manifests carry no fingerprint. Manifests written before this field
resume unchecked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

from slurm_jit.checkpoint.manifest import FROZEN_FINGERPRINT, FROZEN_LEFT_OUT, frozen_tensors

logger = logging.getLogger(__name__)

ALGORITHM = "xxh3_128"  # the overall digest; each tensor's own: xxh3_64 (a name to point at, not a checksum)
ZERO3_PART = "zero3:"  # an entry over a ZeRO-3 partition (this rank's bytes), not over the whole tensor
FIRST_SHOWN = 1  # differing names a refusal shows (the count says how many)
HINT = ("HINT: resume with the base model the checkpoint was trained on (the same model, revision, dtype and "
        "quantisation, built the same way), or start a new run in another output_dir")


@dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """What the frozen tensors of a model are: one digest over all, and each tensor's own entry."""

    digest: str  # xxh3_128 over the sorted (name, entry) pairs
    tensors: dict[str, str]  # name -> "dtype[shape]:xxh3_64 of its bytes"

    def as_manifest(self) -> dict[str, Any]:
        return {"algorithm": ALGORITHM, "digest": self.digest, "count": len(self.tensors), "tensors": self.tensors}


def tensor_entry(tensor: Any) -> str:
    """``dtype[shape]:xxh3_64`` of one tensor's bytes (a CPU copy of a device tensor; no numpy dtype needed). A
    parameter that ZeRO-3 partitioned as it was built (``zero.Init``, as ``from_pretrained`` under a ZeRO-3
    config does) holds no data of its own: its full shape, and the bytes of this rank's partition (``zero3:``)."""
    partition = getattr(tensor, "ds_tensor", None)
    shape = list(getattr(tensor, "ds_shape", tensor.shape))
    flat = (tensor if partition is None else partition).detach().contiguous().reshape(-1)
    data = flat.view(_byte_dtype()).cpu().numpy() if flat.numel() else b""
    kind = "" if partition is None else ZERO3_PART
    return f"{str(tensor.dtype).removeprefix('torch.')}{shape}:{kind}{xxhash.xxh3_64_hexdigest(data)}"


def _byte_dtype() -> Any:
    import torch

    return torch.uint8


def fingerprint(named: Iterable[tuple[str, Any]]) -> Fingerprint:
    """The fingerprint of ``named`` (name, tensor) pairs, in any order: sorted by name before hashing."""
    tensors = {name: tensor_entry(tensor) for name, tensor in named}
    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        digest.update(f"{name}\0{tensors[name]}\n".encode())
    return Fingerprint(digest=digest.hexdigest(), tensors=dict(sorted(tensors.items())))


def of_model(model: Any) -> Fingerprint:
    """The fingerprint of ``model``'s frozen parameters (requires_grad False; a tied one under its first name)."""
    t0 = time.monotonic()
    found = fingerprint((name, p) for name, p in model.named_parameters() if not p.requires_grad)
    logger.info("slurm_jit: frozen-weights fingerprint of %d tensors in %.3f s", len(found.tensors),
                time.monotonic() - t0)
    return found


def at_start(model: Any, is_rank0: bool) -> Fingerprint | None:
    """At the start of ``train()``: the fingerprint of a PEFT model's frozen weights (the ones its saves leave out),
    before DeepSpeed casts them, on rank 0; None for any other model or rank. Every rank refuses (one line) frozen
    weights without data (the meta device: offloaded, or not loaded), which no checkpoint could be checked against."""
    from slurm_jit.train.slim_save import excludes_frozen

    if model is None or not excludes_frozen(model, None):
        return None
    no_data = [name for name, p in model.named_parameters() if not p.requires_grad and p.is_meta]
    if no_data:
        from slurm_jit.train.refusals import JitRefusal

        raise JitRefusal(f"slurm_jit: {len(no_data)} frozen parameters have no data (on the meta device), first "
                         f"'{no_data[0]}': a checkpoint leaves the frozen weights out and takes them from the model "
                         "as built, so they must be loaded. HINT: load the base model fully (no device_map with disk "
                         "offload, no init on the meta device) before the Trainer")
    return of_model(model) if is_rank0 else None


def manifest_fields(weights: str, found: Fingerprint | None) -> dict[str, Any]:
    """The manifest's ``frozen_fingerprint`` of a save that leaves the frozen weights out, else nothing."""
    if weights not in FROZEN_LEFT_OUT or found is None:
        return {}
    return {FROZEN_FINGERPRINT: found.as_manifest()}


def resume_refusal(ckpt_dir: str, manifest: dict[str, Any], model: Any,
                   found: Fingerprint | None) -> tuple[str | None, bool]:
    """Rank 0, before any load: why ``model`` (fingerprint ``found`` if computed) cannot resume the checkpoint
    whose frozen weights it must supply (one line with a HINT), or None (also: no fingerprint recorded); and
    whether to refuse now (the same frozen names: another base) or only after the load's model checks
    (:func:`raise_deferred`), whose words name the adapter that differs (another LoRA rank or target modules)."""
    recorded = manifest.get(FROZEN_FINGERPRINT)
    if recorded is None:
        return None, True
    saved = frozen_tensors(manifest)  # manifest.read refuses a malformed one; this, any other caller
    if saved is None:
        return (f"{ckpt_dir}: its manifest's {FROZEN_FINGERPRINT} is malformed, so the frozen weights this run "
                "supplies cannot be checked. HINT: resume from another checkpoint, or start a new run in another "
                "output_dir"), True
    now = found if found is not None else of_model(model)
    if recorded.get("digest") == now.digest and saved == now.tensors:
        return None, True
    return f"{ckpt_dir}: {difference(saved, now.tensors)}. {HINT}", set(saved) == set(now.tensors)


def raise_deferred(refusal: str | None) -> None:
    """After the load, before the first step (every rank): the refusal :func:`resume_refusal` deferred."""
    if refusal:
        from slurm_jit.train.refusals import JitRefusal

        raise JitRefusal(f"slurm_jit: {refusal}")


def difference(saved: dict[str, str], now: dict[str, str]) -> str:
    """How the frozen tensors of the checkpoint (``saved``) and of this model (``now``) differ, in words."""
    differing = sorted(name for name in set(saved) | set(now) if saved.get(name) != now.get(name))
    counts = (f"{len(saved)} frozen tensors in the checkpoint, {len(now)} in this model" if len(saved) != len(now)
              else f"{len(differing)} of its {len(saved)} frozen tensors differ from this model's")
    if not differing:  # the same entries under another digest: the manifest was edited
        return f"the frozen weights' digest differs from this model's ({counts})"
    name = differing[0]
    if name not in now:
        first = f"'{name}' is not frozen in this model"
    elif name not in saved:
        first = f"'{name}' was not frozen in the checkpoint"
    elif saved[name].split(":")[0] != now[name].split(":")[0]:
        first = f"'{name}' was {saved[name].split(':')[0]}, is {now[name].split(':')[0]} now"
    elif (ZERO3_PART in saved[name]) != (ZERO3_PART in now[name]):
        first = f"'{name}' was built partitioned by ZeRO-3 (zero.Init) in one of the two runs only"
    else:
        first = f"'{name}' has other values"
    return (f"its frozen weights (left out of it) are not this model's: "
            f"{counts}; first: {first}")
