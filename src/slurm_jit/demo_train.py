"""A tiny, real training job: GPT-2 (or Llama) built from a config, DeepSpeed ZeRO on CPU ranks over gloo.

Used by the demo, the tests and the benchmarks. Run one process per rank (srun, or tests/ranks.py), e.g.::

    python -m slurm_jit.demo_train --output-dir out --max-steps 20 --save-steps 10 --resume

Per-step training losses go to ``OUT/losses-rank0.jsonl`` (rank 0), so that runs can be compared bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from slurm_jit.train import dist_env

VOCAB = 128
SEQ_LEN = 32


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=0, help="periodic save every N steps (0: none)")
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--workers", type=int, default=0, help="dataloader_num_workers")
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--width", type=int, default=64, help="hidden size (bigger: slower steps, bigger saves)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per training step")
    p.add_argument("--eval-sleep", type=float, default=0.0, help="extra seconds per evaluation batch")
    p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True)")
    p.add_argument("--trainer", choices=("jit", "plain"), default="jit",
                   help="slurm_jit.JitTrainer, or transformers.Trainer for comparison")
    p.add_argument("--upstream-jit", action="store_true", help="TrainingArguments(enable_jit_checkpoint=True)")
    p.add_argument("--kill-wait", type=float, default=3.0)
    p.add_argument("--workers-take-signals", action="store_true",
                   help="JitConfig(ignore_signals_in_workers=False), to show what the default prevents")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--ds-optimizer", choices=("AdamW",), default=None,
                   help='an "optimizer" section in the DeepSpeed config (default: none, the Trainer\'s AdamW)')
    p.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer on CPU (DeepSpeedCPUAdam)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help='max_grad_norm (DeepSpeed "gradient_clipping": "auto")')
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2, help="Llama only")
    p.add_argument("--dump-state-at", default="",
                   help="comma-separated steps: write the complete training state of each rank to "
                        "OUT/exact-state/step-N/ (compare two runs with python -m slurm_jit.exactness)")
    return p.parse_args(argv)


class _Tokens:
    """Deterministic random token sequences (a torch Dataset without importing torch at module level)."""

    def __init__(self, n: int, seed: int, vocab: int = VOCAB) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, SEQ_LEN), generator=gen)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def build_model(kind: str, width: int, layers: int, vocab: int = VOCAB, heads: int = 2, kv_heads: int = 2) -> Any:
    import transformers

    if kind == "gpt2":
        cfg: Any = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ_LEN * 2, n_embd=width, n_layer=layers,
                                           n_head=heads, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 2,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=SEQ_LEN * 2)
    return transformers.LlamaForCausalLM(cfg)


# The optimizer section as a user writes it: Trainer fills each "auto" from TrainingArguments.
_DS_OPTIMIZER_PARAMS = {
    "AdamW": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
}


def deepspeed_config(zero_stage: int, optimizer: str | None = None, offload: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }
    if optimizer:
        config["optimizer"] = {"type": optimizer, "params": dict(_DS_OPTIMIZER_PARAMS[optimizer])}
    return config


def _callbacks(args: argparse.Namespace, rank: int) -> list[Any]:
    import transformers

    out_dir = args.output_dir

    class LossLog(transformers.TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs")
            if rank == 0 and logs and "loss" in logs:
                with open(os.path.join(out_dir, "losses-rank0.jsonl"), "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")

    class Sleep(transformers.TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            if args.step_sleep:
                time.sleep(args.step_sleep)

        def on_prediction_step(self, *a: Any, **kw: Any) -> None:
            if args.eval_sleep:
                time.sleep(args.eval_sleep)

    callbacks = [LossLog(), Sleep()]
    if args.dump_state_at:
        callbacks.append(_state_dump_callback(args, rank))
    return callbacks


def _state_dump_callback(args: argparse.Namespace, rank: int) -> Any:
    import transformers

    from slurm_jit import exactness

    steps = {int(s) for s in args.dump_state_at.split(",") if s}
    state_dir = os.path.join(args.output_dir, "exact-state")

    class DumpState(transformers.TrainerCallback):
        trainer: Any = None  # set once the trainer exists

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step in steps:
                exactness.dump(self.trainer, state_dir, state.global_step, rank)

    return DumpState()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    dist_env.from_slurm()
    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    import transformers

    transformers.set_seed(args.seed)
    rank = int(os.environ.get("RANK", "0"))
    targs = transformers.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        max_grad_norm=args.clip,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        dataloader_num_workers=args.workers,
        use_cpu=True,
        deepspeed=deepspeed_config(args.zero_stage, args.ds_optimizer, args.offload) if args.zero_stage else None,
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
        enable_jit_checkpoint=args.upstream_jit,
    )
    model = build_model(args.model, args.width, args.layers, args.vocab, args.heads, args.kv_heads)
    common: dict[str, Any] = dict(
        model=model, args=targs, train_dataset=_Tokens(args.samples, args.seed, args.vocab),
        eval_dataset=_Tokens(args.eval_samples, args.seed + 1, args.vocab) if args.eval_steps else None,
        callbacks=_callbacks(args, rank),
    )
    if args.trainer == "jit":
        from slurm_jit.train.trainer import JitConfig, JitTrainer

        trainer: Any = JitTrainer(**common, jit_config=JitConfig(
            kill_wait_s=args.kill_wait, ignore_signals_in_workers=not args.workers_take_signals))
    else:
        trainer = transformers.Trainer(**common)
    for callback in common["callbacks"]:
        if hasattr(callback, "trainer"):
            callback.trainer = trainer
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    import torch.distributed as dist

    if dist.is_initialized():  # a clean teardown, so that no rank aborts at exit while its peer is gone
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
