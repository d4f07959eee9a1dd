"""Online DPO with LoRA, TRL's way: ``OnlineDPOTrainer(model=..., reward_funcs=..., peft_config=LoraConfig(...))`` on
the countdown prompts of ``countdown.py``. Each step samples two answers to every prompt, the countdown checker ranks
them (0.1 for a well-formed answer, 1 more for a right one) and DPO pushes the policy towards the better one. The
reference is the base model with the adapter off, so the first loss is ln 2 and the KL to the reference starts at 0.
The embedded default starts from random weights, so it first gets the short SFT warm-up of ``grpo_countdown.py`` (its
answers must sometimes be well formed for a ranking to mean something); a real model skips it.

    python examples/online_dpo.py [--model Qwen/Qwen2.5-0.5B-Instruct] [--max-steps 100] [--warm-up-steps 100]
                                  [--out DIR]
"""

from __future__ import annotations

import math
from typing import Any

import countdown
from embedded import ExampleParser, early_and_late, logged, trainer_settings, workspace
from grpo_countdown import WARM_UP_LEARNING_RATES, warm_up

import torchlike
from torchlike.peft import LoraConfig
from torchlike.trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = ExampleParser(__doc__, default_steps=100, learning_rates=(3e-3, 5e-7))
    parser.add_argument("--warm-up-steps", type=int, help="SFT steps before online DPO (default: 100 on the embedded "
                                                          "default, 0 with --model)")
    args = parser.parse_args(argv)
    warm_up_steps = (0 if args.model else 100) if args.warm_up_steps is None else args.warm_up_steps

    with workspace(args.model, args.out) as (source, out):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        problems = countdown.make_problems(2000, seed=10)
        model = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        if warm_up_steps:
            warm_up(model, tokenizer, problems, warm_up_steps, WARM_UP_LEARNING_RATES[bool(args.model)],
                    out / "warm-up")
        config = OnlineDPOConfig(output_dir=str(out / "adapter"), per_device_train_batch_size=16, max_new_tokens=16,
                                 max_length=64, beta=0.1, reward_weights=countdown.REWARD_WEIGHTS,
                                 learning_rate=args.learning_rate, **trainer_settings(args.max_steps))
        trainer = OnlineDPOTrainer(model=model, reward_funcs=countdown.REWARD_FUNCS, args=config,
                                   train_dataset=problems, processing_class=tokenizer,
                                   peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                          task_type="CAUSAL_LM"))
        trainer.train()
        trainer.save_model()
        adapter_files = sorted(path.name for path in (out / "adapter").iterdir())

    losses, kl = logged(trainer, "loss"), logged(trainer, "objective/kl")
    scores, margins = logged(trainer, "objective/scores"), logged(trainer, "rewards/margins")
    early, late = early_and_late(scores)
    print("\nsummary")
    print(f"  model                {source}" + (f" after {warm_up_steps} SFT steps" if warm_up_steps else ""))
    print(f"  online DPO           {args.max_steps} steps of {config.per_device_train_batch_size} prompts x 2 "
          f"completions, beta {config.beta}, LoRA r=16, learning rate {args.learning_rate:g}")
    print(f"  loss                 {losses[0]:.4f} -> {losses[-1]:.4f}   (at step 1 policy = reference: "
          f"ln 2 = {math.log(2):.4f})")
    print(f"  KL to the reference  {kl[0]:.4f} -> {kl[-1]:.4f}")
    print(f"  reward of samples    {early:.4f} -> {late:.4f}   (first -> last quarter of the run)")
    print(f"  reward margin        {margins[0]:.4f} -> {margins[-1]:.4f}   (beta x log-ratio, chosen - rejected)")
    print(f"  adapter              {out / 'adapter'} -> {adapter_files}")
    return {"losses": losses, "kl": kl, "scores": scores, "margins": margins, "adapter_files": adapter_files,
            "logging_steps": config.logging_steps}


if __name__ == "__main__":
    main()
