"""The frozen weights a checkpoint leaves out, and the check that a resume's model has the same ones.

A PEFT model's saves leave its frozen base out (``weights: frozen-excluded``, as transformers' own
``exclude_frozen_parameters``): a resume takes the frozen weights from the model the user's script built. Another
base (another model, revision, seed, dtype or quantisation) would then train the checkpoint's adapters on weights
they were never trained with, silently. So a fingerprint of the frozen tensors (xxh3 over each one's name, dtype,
shape and bytes, and a quantised one's scales) is computed once per ``train()``, before DeepSpeed casts or wraps
the model (rank 0 hashes; a base partitioned by ``zero.Init`` is gathered tensor by tensor on every rank, so each
rank's partition counts), written into the manifest of every checkpoint that leaves them out
(``frozen_fingerprint``), and compared before any step of a resume: a difference is refused in one line naming
how many differ and the first one.

Models that are not PEFT keep their frozen parameters in every checkpoint (their elastic resume restores them from
the saved module: ``elastic_unheld.py``); their manifests carry no fingerprint. Manifests written before this field
resume unchecked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import xxhash

from slurm_jit.checkpoint.manifest import FROZEN_FINGERPRINT, FROZEN_LEFT_OUT, WEIGHTS_MASTER_ONLY, frozen_tensors

logger = logging.getLogger(__name__)

ALGORITHM = "xxh3_128"  # the overall digest; each tensor's own: xxh3_64 (a name to point at, not a checksum)
# Recorded before the whole tensor was gathered: an entry over rank 0's ZeRO-3 partition only, which no run can
# reproduce on another number of ranks; such entries are checked for dtype and shape only (a warning says so)
LEGACY_ZERO3_PART = "zero3:"
QUANT_PART = "+quant:"  # then the xxh3_64 of a quantised tensor's state kept beside its bytes (bitsandbytes)
NOT_GATHERED = "not-gathered"  # a partitioned tensor rank 0 could not gather alone (matches no recorded entry)
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
    """``dtype[shape]:xxh3_64`` of one whole tensor's bytes (a CPU copy of a device tensor; no numpy dtype needed),
    then ``+quant:xxh3_64`` of the state a quantised one keeps beside its bytes (:func:`_quant_entry`). A parameter
    that ZeRO-3 partitioned as it was built (``zero.Init``) is gathered first (:func:`of_model`): one rank's
    partition is not the tensor, and hashing it would miss a difference in another rank's."""
    shape = list(getattr(tensor, "ds_shape", tensor.shape))
    if tensor.numel() != math.prod(shape):
        raise ValueError(f"a ZeRO-3 partition ({tensor.numel()} of {math.prod(shape)} elements) is not the whole "
                         "tensor: gather it first (of_model)")
    return f"{_kind_of(tensor, shape)}:{xxhash.xxh3_64_hexdigest(_bytes(tensor))}{_quant_entry(tensor)}"


def _kind_of(tensor: Any, shape: list[int]) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{shape}"


def _bytes(tensor: Any) -> Any:
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).cpu().numpy() if flat.numel() else b""


def _quant_entry(tensor: Any) -> str:
    """bitsandbytes keeps a quantised weight's scales beside its bytes, which are the same under another scheme:
    the 4-bit ``quant_state`` (its serialised form, ``as_dict``: absmax, quant map, block size, quant type, dtype,
    shape and double quantisation's nested state) and the 8-bit ``SCB``. "" for any other tensor."""
    import torch

    as_dict = getattr(getattr(tensor, "quant_state", None), "as_dict", None)
    items: dict[str, Any] = dict(as_dict(packed=False)) if callable(as_dict) else {}
    if getattr(tensor, "SCB", None) is not None:
        items["SCB"] = tensor.SCB
    if not items:
        return ""
    digest = xxhash.xxh3_64()
    for key in sorted(items):
        value = items[key]
        if isinstance(value, torch.Tensor):
            digest.update(f"{key}\0{_kind_of(value, list(value.shape))}\0".encode())
            digest.update(_bytes(value))
        else:
            digest.update(f"{key}\0{value!r}\n".encode())
    return f"{QUANT_PART}{digest.hexdigest()}"


def fingerprint(named: Iterable[tuple[str, Any]]) -> Fingerprint:
    """The fingerprint of ``named`` (name, whole tensor) pairs, in any order: sorted by name before hashing."""
    return _of_entries({name: tensor_entry(tensor) for name, tensor in named})


def _of_entries(entries: dict[str, str]) -> Fingerprint:
    digest = xxhash.xxh3_128()
    for name in sorted(entries):
        digest.update(f"{name}\0{entries[name]}\n".encode())
    return Fingerprint(digest=digest.hexdigest(), tensors=dict(sorted(entries.items())))


@contextlib.contextmanager
def _whole(param: Any, gather: bool) -> Iterator[bool]:
    """Within: whether ``param`` is whole here. One that ZeRO-3 partitioned (``ds_status`` NOT_AVAILABLE, the same
    on every rank) is gathered from every rank's partition by DeepSpeed (``GatheredParameters``, a collective:
    every rank takes part), and partitioned again after; ``gather`` False (rank 0 alone): it stays partitioned."""
    status = getattr(param, "ds_status", None)
    if getattr(status, "name", None) != "NOT_AVAILABLE":
        yield True
    elif not gather:
        yield False
    else:
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield True


def _frozen_entries(model: Any, hashed: bool, gather: bool) -> dict[str, str]:
    """Each frozen parameter's entry (requires_grad False; a tied one under its first name); ``hashed`` False: none
    (a rank that only takes part in the gathers)."""
    entries: dict[str, str] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        with _whole(param, gather) as whole:
            if hashed:
                shape = list(getattr(param, "ds_shape", param.shape))
                entries[name] = tensor_entry(param) if whole else f"{_kind_of(param, shape)}:{NOT_GATHERED}"
    return entries


def of_model(model: Any, gather: bool = True) -> Fingerprint:
    """The fingerprint of ``model``'s frozen parameters. Where ZeRO-3 partitioned them every rank must call
    :func:`at_start` instead (the gathers are collectives); ``gather`` False: one rank alone, a partitioned
    parameter's entry says it was not gathered (it matches no recorded one)."""
    t0 = time.monotonic()
    found = _of_entries(_frozen_entries(model, hashed=True, gather=gather))
    logger.info("slurm_jit: frozen-weights fingerprint of %d tensors in %.3f s", len(found.tensors),
                time.monotonic() - t0)
    return found


def at_start(model: Any, is_rank0: bool) -> Fingerprint | None:
    """At the start of ``train()``, on every rank: the fingerprint of a PEFT model's frozen weights (the ones its
    saves leave out), before DeepSpeed casts them, on rank 0 (the other ranks take part in the gathers of a base
    ZeRO-3 partitioned as it was built); None for any other model or rank. Every rank refuses (one line) frozen
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
    if is_rank0:
        return of_model(model)
    _frozen_entries(model, hashed=False, gather=True)
    return None


def manifest_fields(weights: str, found: Fingerprint | None) -> dict[str, Any]:
    """The manifest's ``frozen_fingerprint`` of a save that leaves the frozen weights out, else nothing: a PEFT
    model's (``found``: :func:`at_start` computes it for those only), in the frozen-excluded layouts and in
    ZeRO-3's ``fp32-master-only``, which every ZeRO-3 save gets and whose PEFT saves leave the base out too
    (DeepSpeed's ``exclude_frozen_parameters``)."""
    if weights not in (*FROZEN_LEFT_OUT, WEIGHTS_MASTER_ONLY) or found is None:
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
    entries, unchecked = _as_recorded(saved, (found if found is not None else of_model(model, gather=False)).tensors)
    if unchecked:
        logger.warning("slurm_jit: %s: %d frozen tensors were recorded over rank 0's ZeRO-3 partition only (an earlier "
                       "version), first '%s': their dtype and shape are checked, not their values", ckpt_dir,
                       len(unchecked), unchecked[0])
    if recorded.get("digest") == _of_entries(entries).digest and saved == entries:
        return None, True
    return f"{ckpt_dir}: {difference(saved, entries)}. {HINT}", set(saved) == set(entries)


def _as_recorded(saved: dict[str, str], now: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """This model's entries as the checkpoint's version recorded them: without the quantisation state where its
    entry has none (written before that was hashed), and an entry over rank 0's ZeRO-3 partition only
    (``LEGACY_ZERO3_PART``) taken as recorded where dtype and shape agree; those names, whose values go unchecked."""
    entries, unchecked = {}, []
    for name, entry in now.items():
        old = saved.get(name)
        if old is not None and QUANT_PART not in old:
            entry = entry.split(QUANT_PART)[0]
        if old is not None and LEGACY_ZERO3_PART in old and _kind(old) == _kind(entry):
            entry = old
            unchecked.append(name)
        entries[name] = entry
    return entries, unchecked


def _kind(entry: str) -> str:
    """An entry's ``dtype[shape]``."""
    return entry.split(":")[0]


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
    elif _kind(saved[name]) != _kind(now[name]):
        first = f"'{name}' was {_kind(saved[name])}, is {_kind(now[name])} now"
    elif saved[name].split(QUANT_PART)[0] == now[name].split(QUANT_PART)[0]:
        first = (f"'{name}' has the same bytes under another quantisation state (bitsandbytes: quant type, block "
                 "size, double quantisation)")
    elif now[name].endswith(NOT_GATHERED):
        first = f"'{name}' is partitioned by ZeRO-3 in this model and was not gathered"
    else:
        first = f"'{name}' has other values"
    return (f"its frozen weights (left out of it) are not this model's: "
            f"{counts}; first: {first}")
