"""The frozen weights' fingerprint (train/frozen_weights.py): what it is sensitive to, and the refusal's words.

Fast: real torch tensors, no DeepSpeed; then real DeepSpeed ZeRO-3 bases built inside zero.Init on 1 and on 2
ranks over gloo. The 2-rank resume that uses it is in test_peft_checkpoint.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from jit_helpers import run_demo, run_logged

from slurm_jit.checkpoint import protocol
from slurm_jit.checkpoint.manifest import FROZEN_FINGERPRINT, WEIGHTS_FROZEN_EXCLUDED, WEIGHTS_FULL, WEIGHTS_MASTER_ONLY
from slurm_jit.train import frozen_weights


def _named() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(4, 6, generator=gen)), ("b.weight", torch.randn(4, 6, generator=gen)),
            ("c.bias", torch.randn(3, generator=gen))]


def test_fingerprint_does_not_depend_on_the_order_the_tensors_come_in() -> None:
    named = _named()
    assert frozen_weights.fingerprint(named) == frozen_weights.fingerprint(list(reversed(named)))


def test_fingerprint_changes_when_two_names_swap_their_tensors() -> None:
    (a, ta), (b, tb), c = _named()
    assert frozen_weights.fingerprint([(a, tb), (b, ta), c]).digest != frozen_weights.fingerprint(_named()).digest


@pytest.mark.parametrize("change", ["dtype", "shape", "one_value", "name"])
def test_fingerprint_changes_with_dtype_shape_values_and_names(change: str) -> None:
    named = _named()
    name, tensor = named[0]
    changed = {
        "dtype": (name, tensor.to(torch.bfloat16)),
        "shape": (name, tensor.reshape(6, 4)),  # the same bytes in another shape
        "one_value": (name, tensor.clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(0.5))),
        "name": ("z.weight", tensor),
    }[change]
    before, after = frozen_weights.fingerprint(named), frozen_weights.fingerprint([changed, *named[1:]])
    assert before.digest != after.digest
    assert before.tensors != after.tensors


def test_fingerprint_of_a_model_covers_only_its_frozen_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    found = frozen_weights.of_model(model)
    assert sorted(found.tensors) == ["0.bias", "0.weight"]
    with torch.no_grad():
        model[1].weight.add_(1.0)  # a trainable weight: not part of it
    assert frozen_weights.of_model(model) == found


def _manifest(named: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    return frozen_weights.manifest_fields(WEIGHTS_FROZEN_EXCLUDED, frozen_weights.fingerprint(named))


def test_only_a_save_that_leaves_the_frozen_weights_out_records_them() -> None:
    found = frozen_weights.fingerprint(_named())
    assert frozen_weights.manifest_fields(WEIGHTS_FULL, found) == {}
    assert frozen_weights.manifest_fields(WEIGHTS_MASTER_ONLY, None) == {}  # not PEFT: at_start found none
    # a PEFT model under ZeRO-3: its layout is fp32-master-only, and its saves leave the frozen base out too
    assert frozen_weights.manifest_fields(WEIGHTS_MASTER_ONLY, found)[FROZEN_FINGERPRINT]["digest"] == found.digest
    assert frozen_weights.manifest_fields(WEIGHTS_FROZEN_EXCLUDED, None) == {}
    recorded = _manifest(_named())[FROZEN_FINGERPRINT]
    assert recorded["count"] == 3 and recorded["digest"] == found.digest  # type: ignore[index]


def test_resume_refusal_names_the_count_and_the_first_differing_tensor() -> None:
    manifest = _manifest(_named())
    same = frozen_weights.fingerprint(_named())
    assert frozen_weights.resume_refusal("ck", manifest, None, same) == (None, True)
    assert frozen_weights.resume_refusal("ck", {}, None, same) == (None, True)  # written before it: unchecked
    named = _named()
    other = frozen_weights.fingerprint([named[0], ("b.weight", named[1][1] + 1), named[2]])
    why, now = frozen_weights.resume_refusal("ck", manifest, None, other)
    assert now, "the same frozen names: refused before the load"
    assert why is not None and "\n" not in why and "HINT:" in why, why
    assert "1 of its 3 frozen tensors differ" in why and "first: 'b.weight' has other values" in why, why
    fewer = frozen_weights.fingerprint(named[:2])
    why, now = frozen_weights.resume_refusal("ck", manifest, None, fewer)
    assert not now, "other frozen names: after the load's own model checks"
    assert why is not None and "3 frozen tensors in the checkpoint, 2 in this model" in why, why
    assert "'c.bias' is not frozen in this model" in why, why


def test_a_malformed_recorded_fingerprint_is_refused_in_one_line() -> None:
    why, _ = frozen_weights.resume_refusal("ck", {FROZEN_FINGERPRINT: {"tensors": [1]}}, None,
                                           frozen_weights.fingerprint(_named()))
    assert why is not None and "malformed" in why and "HINT:" in why, why


def test_frozen_weights_on_the_meta_device_are_refused_in_one_line_at_the_start() -> None:
    """A PEFT base whose frozen weights have no data (built on the meta device, or offloaded by a device_map) cannot
    be fingerprinted nor supplied to a resume: one line with a HINT, on every rank. Before: NotImplementedError
    ("Cannot copy out of meta tensor") from the fingerprint, a traceback at the start of train()."""
    import peft
    import transformers

    from slurm_jit.train.refusals import JitRefusal

    with torch.device("meta"):
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=8, n_layer=1, n_head=2))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"]))
    for is_rank0 in (True, False):
        with pytest.raises(JitRefusal) as refused:
            frozen_weights.at_start(model, is_rank0)
        why = str(refused.value)
        assert "\n" not in why and "no data (on the meta device)" in why and "HINT:" in why, why


class _QuantState:
    """bitsandbytes is not installed here (its wheel is a CUDA build): a stand-in for its 4-bit ``QuantState`` with
    the fields and the ``as_dict(packed=False)`` of bitsandbytes/functional.py, built from one weight as
    ``quantize_4bit`` does: the packed 4-bit bytes come from the fp32 absmax either way; double quantisation
    (``bnb_4bit_use_double_quant``) then stores that absmax 8-bit, less its mean, with a nested state."""

    def __init__(self, weight: torch.Tensor, double_quant: bool, blocksize: int = 8) -> None:
        self.absmax = weight.reshape(-1, blocksize).abs().amax(dim=1)
        self.shape, self.dtype, self.blocksize, self.quant_type = weight.shape, weight.dtype, blocksize, "nf4"
        self.code = torch.linspace(-1, 1, 16)
        self.nested = double_quant
        if double_quant:
            self.offset = self.absmax.mean()
            centred = self.absmax - self.offset
            self.nested_absmax = centred.abs().amax().reshape(1)
            self.absmax = (centred / self.nested_absmax * 127).round().to(torch.uint8)

    def as_dict(self, packed: bool = False) -> dict[str, Any]:
        assert not packed
        found = {"quant_type": self.quant_type, "absmax": self.absmax, "blocksize": self.blocksize,
                 "quant_map": self.code, "dtype": str(self.dtype).strip("torch."), "shape": tuple(self.shape)}
        if self.nested:
            found.update({"nested_absmax": self.nested_absmax, "nested_blocksize": 256,
                          "nested_quant_map": torch.linspace(-1, 1, 256), "nested_dtype": "float32",
                          "nested_offset": self.offset.item()})
        return found


def _four_bit(weight: torch.Tensor, double_quant: bool) -> torch.nn.Parameter:
    """A frozen 4-bit weight as bitsandbytes' Params4bit holds it: 2 codes per byte, the scales in quant_state."""
    codes = (weight.reshape(-1, 8) / weight.reshape(-1, 8).abs().amax(dim=1, keepdim=True) * 7 + 7.5).to(torch.uint8)
    packed = torch.nn.Parameter((codes.reshape(-1)[0::2] << 4) | codes.reshape(-1)[1::2], requires_grad=False)
    packed.quant_state = _QuantState(weight, double_quant)  # type: ignore[attr-defined]
    return packed


def test_a_4bit_base_with_another_quantisation_state_is_refused() -> None:
    """A QLoRA base with bnb_4bit_use_double_quant True, resumed with it False: the packed 4-bit bytes are the same,
    only the scales kept beside them (quant_state) differ, and the adapters were trained on the dequantised weights
    of the one. Before: the entry covered the bytes only, the same digest, resumed silently (the module's docstring
    promised the refusal of a quantisation change)."""
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    single, double = _four_bit(weight, double_quant=False), _four_bit(weight, double_quant=True)
    assert torch.equal(single, double)
    manifest = _manifest([("q.weight", double)])
    assert frozen_weights.resume_refusal("ck", manifest, None, frozen_weights.fingerprint([("q.weight", double)])) \
        == (None, True)
    why, now = frozen_weights.resume_refusal("ck", manifest, None, frozen_weights.fingerprint([("q.weight", single)]))
    assert now and why is not None and "\n" not in why and "HINT:" in why, why
    assert "'q.weight' has the same bytes under another quantisation state" in why, why


def test_an_8bit_weight_with_other_row_scales_is_refused() -> None:
    """bitsandbytes' Int8Params keeps its row scales (SCB) beside the int8 bytes: other scales, another base."""
    named = []
    for scale in (1.0, 2.0):
        param = torch.nn.Parameter(torch.arange(8, dtype=torch.int8), requires_grad=False)
        param.SCB = torch.full((2,), scale)  # type: ignore[attr-defined]
        named.append(("w", param))
    assert frozen_weights.fingerprint(named[:1]).digest != frozen_weights.fingerprint(named[1:]).digest


_ZERO_INIT_BASES = """
import os, socket
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed, torch
from slurm_jit.train import frozen_weights
deepspeed.init_distributed("gloo")
for seed in (0, 1):
    torch.manual_seed(seed)
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 1}):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model.requires_grad_(False)
    found = frozen_weights.of_model(model)
    print("FOUND", found.digest, found.tensors["0.weight"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).requires_grad_(False)
print("WHOLE", frozen_weights.of_model(model).digest, "-")
"""


@pytest.mark.deepspeed
def test_bases_built_partitioned_by_zero3_init_get_their_own_fingerprints() -> None:
    """from_pretrained under a ZeRO-3 config builds the base inside deepspeed.zero.Init: each parameter's own data
    is empty and its values are in its partition. Two bases (other seeds) must still differ, the shape be the
    whole tensor's, and the base of seed 0 match the same base built whole. Before: every tensor was 'float32[0]'
    with the hash of no bytes, so any base passed; then rank 0's partition only, marked 'zero3:'."""
    done = subprocess.run([sys.executable, "-c", _ZERO_INIT_BASES], capture_output=True, text=True, timeout=300)
    found = [line.split(" ", 2)[1:] for line in done.stdout.splitlines() if line.startswith(("FOUND ", "WHOLE "))]
    assert done.returncode == 0 and len(found) == 3, done.stderr[-3000:]
    (digest0, entry0), (digest1, entry1), (whole, _) = found
    assert digest0 != digest1, found
    assert entry0.startswith("float32[8, 8]:") and "zero3" not in entry0 and entry0 != entry1, found
    assert digest0 == whole, "one rank's partition is the whole tensor: the same base, the same fingerprint"


def _partitioned(full: torch.Tensor, world_size: int, rank: int) -> torch.nn.Parameter:
    """What zero.Init leaves of ``full`` on ``rank``: empty data, the full shape, this rank's padded slice."""
    param = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    size = -(-full.numel() // world_size)
    flat = torch.nn.functional.pad(full.reshape(-1), (0, size * world_size - full.numel()))
    param.ds_shape, param.ds_numel = full.shape, full.numel()  # type: ignore[attr-defined]
    param.ds_tensor = flat[rank * size:(rank + 1) * size].clone()  # type: ignore[attr-defined]
    return param


def test_a_zero3_partition_is_never_hashed_as_the_tensor() -> None:
    """Two bases that differ at element 6 of 8, partitioned over 2 ranks: rank 0's slices are equal. Before: the
    entry was over rank 0's slice (same digest for both, the adapters resumed on the wrong base); now only the
    whole tensor is hashed (of_model gathers it: the 2-rank test below), and a partition alone is refused."""
    base = torch.arange(8, dtype=torch.float32)
    other = base.clone().index_fill_(0, torch.tensor([6]), 99.0)
    for tensor in (base, other):
        with pytest.raises(ValueError, match="partition .0 of 8 elements. is not the whole tensor"):
            frozen_weights.tensor_entry(_partitioned(tensor, 2, 0))
    assert frozen_weights.tensor_entry(base) != frozen_weights.tensor_entry(other)


def test_a_checkpoint_recorded_over_rank0s_partition_resumes_checking_dtype_and_shape_only() -> None:
    """A manifest written before the gather ('dtype[shape]:zero3:...', rank 0's partition) cannot be reproduced:
    its values go unchecked (a warning), its dtype and shape still are; not refused for the same base."""
    named = _named()
    now = frozen_weights.fingerprint(named)
    legacy = {name: f"{entry.split(':')[0]}:zero3:0123456789abcdef" for name, entry in now.tensors.items()}
    manifest = {FROZEN_FINGERPRINT: {"digest": frozen_weights._of_entries(legacy).digest, "tensors": legacy}}
    assert frozen_weights.resume_refusal("ck", manifest, None, now) == (None, True)
    cast = frozen_weights.fingerprint([(name, t.to(torch.float64)) for name, t in named])
    why, _ = frozen_weights.resume_refusal("ck", manifest, None, cast)
    assert why is not None and "'a.weight' was float32[4, 6], is float64[4, 6] now" in why, why


@pytest.mark.deepspeed
def test_a_zero3_base_differing_in_rank1s_partition_only_is_refused_on_2_ranks(tmp_path: Path) -> None:
    """2 real DeepSpeed ZeRO-3 ranks over gloo, PEFT LoRA on a GPT-2 base built inside zero.Init, at_start on every
    rank as train() calls it. A base changed in rank 1's partition only gets another fingerprint, and the resume
    refusal names the tensor; the base of the same seed built whole (no zero.Init) gets the same fingerprint, so
    it does not depend on the partitioning nor on the number of ranks (a resume on another world size meets the
    elastic refusal, not this one). Before: rank 0 hashed its own partition: the changed base passed."""
    out = tmp_path / "out"
    out.mkdir()
    program = [str(Path(__file__).resolve().parents[1] / "helpers" / "zero3_frozen_bases.py")]
    run_demo(out, [], world_size=2, program=program)
    found: dict[str, Any] = json.loads((out / "fingerprints.json").read_text())
    assert found["changed_index"] >= found["rank0_partition_numel"], "the change is in rank 1's partition only"
    assert found["partitioned"]["digest"] != found["changed"]["digest"]
    assert found["partitioned"] == found["whole"]
    assert not any("zero3" in entry for entry in found["whole"]["tensors"].values())
    why = found["refusal"]
    assert why is not None and "\n" not in why and "HINT:" in why, why
    assert "first: 'base_model.model.transformer.h.0.mlp.c_fc.weight' has other values" in why, why


ZERO3_LORA = ["--lora", "--zero-stage", "3", "--max-steps", "2", "--save-steps", "2"]
OTHER_BASE_SEED = "43"  # --seed: the script builds the same architecture with other base weights


@pytest.mark.deepspeed
def test_a_zero3_lora_checkpoint_records_the_fingerprint_and_another_base_is_refused(tmp_path: Path) -> None:
    """A real LoRA training under ZeRO-3 on 2 ranks: its checkpoints leave the frozen base out (DeepSpeed's
    exclude_frozen_parameters) under the layout fp32-master-only, and must record the fingerprint the start
    gathered; a resume whose script builds another base is refused in one line on both ranks, before any step.
    Before: manifest_fields recorded it for the frozen-excluded layouts only, so no ZeRO-3 checkpoint had one and
    the adapters resumed on any base (the gather at every start was done for nothing)."""
    out = tmp_path / "out"
    run_demo(out, ZERO3_LORA, world_size=2)
    manifest = json.loads((out / "checkpoint-2" / protocol.MANIFEST_NAME).read_text())
    assert manifest["weights"] == WEIGHTS_MASTER_ONLY, manifest["weights"]
    recorded = manifest.get(FROZEN_FINGERPRINT)
    assert isinstance(recorded, dict) and recorded["count"] > 0, sorted(manifest)
    result = run_logged(out, [*ZERO3_LORA, "--max-steps", "4", "--resume", "--seed", OTHER_BASE_SEED])
    assert result.codes == [2, 2] and "Traceback" not in result.log, result.log[-4000:]
    refusals = [line for line in result.log.splitlines() if line.startswith("demo_train: slurm_jit: ")]
    assert len(refusals) == 2 and all("frozen tensors differ from this model's" in line and "HINT:" in line
                                      for line in refusals), result.log[-4000:]
    assert not (out / "checkpoint-4").exists()
