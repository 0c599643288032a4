"""One rank of a real DeepSpeed ZeRO-3 world over gloo (start it with local_ranks, 2 ranks): the frozen-weights
fingerprint (train/frozen_weights.py) of PEFT LoRA models whose GPT-2 base is built partitioned inside
``deepspeed.zero.Init`` (as ``from_pretrained`` under a ZeRO-3 config builds it), every rank calling ``at_start``
as ``JitTrainer.train()`` does. Rank 0 writes OUT/fingerprints.json (tests/train/test_frozen_fingerprint.py):

- ``partitioned``: the base (the weights of a GPT-2 of seed 0), loaded into a model built inside zero.Init;
- ``changed``: the same with the last element of ``CHANGED`` changed, which lies in rank 1's partition only;
- ``whole``: the base loaded into a model built without zero.Init (every rank holds all of it);
- ``refusal``: the resume refusal of a checkpoint recorded with ``partitioned`` for the model ``changed``.

Usage: python zero3_frozen_bases.py --output-dir OUT
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import deepspeed
import peft
import torch
import transformers

from slurm_jit.checkpoint.manifest import WEIGHTS_FROZEN_EXCLUDED
from slurm_jit.train import frozen_weights

SEED = 0
CHANGED = "transformer.h.0.mlp.c_fc.weight"  # a frozen base weight (LoRA is on c_attn)
DS_CONFIG = {"zero_optimization": {"stage": 3}, "train_batch_size": 2}


def _base_weights() -> dict[str, torch.Tensor]:
    """The base's weights (as a checkpoint on disk holds them): a GPT-2 of SEED built whole. A base built inside
    zero.Init draws its random init otherwise, so the same weights are loaded into both (:func:`_lora_model`)."""
    torch.manual_seed(SEED)
    config = transformers.GPT2Config(vocab_size=32, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    return {name: p.detach().clone() for name, p in transformers.GPT2LMHeadModel(config).named_parameters()}


def _lora_model(weights: dict[str, torch.Tensor], partitioned: bool) -> Any:
    """A LoRA model on a GPT-2 base holding ``weights``, built inside zero.Init or whole; loaded as
    ``from_pretrained`` under ZeRO-3 loads a partitioned base: each parameter gathered, set on rank 0, partitioned
    again (``GatheredParameters(modifier_rank=0)``)."""
    config = transformers.GPT2Config(vocab_size=32, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    built = deepspeed.zero.Init(config_dict_or_path=DS_CONFIG) if partitioned else contextlib.nullcontext()
    with built:
        base = transformers.GPT2LMHeadModel(config)
    for name, param in base.named_parameters():
        gathered = deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=partitioned)
        with gathered, torch.no_grad():
            param.copy_(weights[name])
    return peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"]))


def main(out: Path) -> None:
    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    weights = _base_weights()
    found = {"partitioned": frozen_weights.at_start(_lora_model(weights, partitioned=True), rank == 0)}
    other = {**weights, CHANGED: weights[CHANGED].clone()}
    other[CHANGED].view(-1)[-1] += 1.0  # the last element: in rank 1's partition only
    changed = _lora_model(other, partitioned=True)
    found["changed"] = frozen_weights.at_start(changed, rank == 0)
    found["whole"] = frozen_weights.at_start(_lora_model(weights, partitioned=False), rank == 0)
    if rank == 0:
        manifest = frozen_weights.manifest_fields(WEIGHTS_FROZEN_EXCLUDED, found["partitioned"])
        refusal, _ = frozen_weights.resume_refusal("ck", manifest, None, found["changed"])
        record = {name: fp.as_manifest() for name, fp in found.items() if fp is not None}
        param = dict(changed.named_parameters())[f"base_model.model.{CHANGED}"]
        where = {"changed_index": weights[CHANGED].numel() - 1, "rank0_partition_numel": param.ds_tensor.numel()}
        (out / "fingerprints.json").write_text(json.dumps({**record, **where, "refusal": refusal}))
    torch.distributed.barrier()


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) != 2 or args[0] != "--output-dir":
        sys.exit(f"usage: {Path(__file__).name} --output-dir OUT")
    main(Path(args[1]))
