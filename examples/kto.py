"""KTO with LoRA, TRL's way: ``KTOTrainer(model=..., peft_config=LoraConfig(...))`` on unpaired rows
(``prompt``/``completion``/``label``): for each arithmetic problem of ``countdown.py`` the right equation is a
desirable completion and the same numbers with wrong operators an undesirable one. The reference is the base model
with the adapter off, so at step 1 every implied reward and the KL estimate are 0 and the loss is exactly 0.5; the
reward of desirable completions then rises above that of undesirable ones.

    python examples/kto.py [--model Qwen/Qwen2.5-0.5B-Instruct] [--max-steps 100] [--out DIR]
"""

from __future__ import annotations

from typing import Any

import countdown
from embedded import ExampleParser, logged, trainer_settings, workspace

import torchlike
from torchlike.peft import LoraConfig
from torchlike.trl import KTOConfig, KTOTrainer


def unpaired_rows(pairs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """TRL's unpaired format: each pair becomes a desirable and an undesirable row."""
    rows = []
    for pair in pairs:
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = ExampleParser(__doc__, default_steps=100, learning_rates=(3e-3, 5e-6)).parse_args(argv)

    with workspace(args.model, args.out) as (source, out):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        rows = unpaired_rows(countdown.preference_pairs(countdown.make_problems(2000, seed=10)))
        config = KTOConfig(output_dir=str(out / "adapter"), max_length=48, per_device_train_batch_size=32, beta=0.1,
                           learning_rate=args.learning_rate, **trainer_settings(args.max_steps))
        trainer = KTOTrainer(model=source, args=config, train_dataset=rows, processing_class=tokenizer,
                             peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"))
        trainer.train()
        trainer.save_model()
        adapter_files = sorted(path.name for path in (out / "adapter").iterdir())

    losses = logged(trainer, "loss")
    chosen = logged(trainer, "rewards/chosen")
    rejected = logged(trainer, "rewards/rejected")
    print("\nsummary")
    print(f"  model                {source}")
    print(f"  KTO                  {args.max_steps} steps of {config.per_device_train_batch_size} rows, beta "
          f"{config.beta}, LoRA r=16, learning rate {args.learning_rate:g}")
    print(f"  loss                 {losses[0]:.4f} -> {losses[-1]:.4f}   (at step 1 policy = reference: 0.5)")
    print(f"  reward, desirable    {chosen[0]:.4f} -> {chosen[-1]:.4f}")
    print(f"  reward, undesirable  {rejected[0]:.4f} -> {rejected[-1]:.4f}")
    print(f"  adapter              {out / 'adapter'} -> {adapter_files}")
    return {"losses": losses, "chosen_rewards": chosen, "rejected_rewards": rejected, "adapter_files": adapter_files,
            "logging_steps": config.logging_steps}


if __name__ == "__main__":
    main()
