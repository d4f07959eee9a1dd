"""RLOO on the countdown task of ``grpo_countdown.py``: the same prompts and checker rewards, trained with TRL's
REINFORCE Leave-One-Out (each completion's baseline is the mean reward of the other completions of its prompt, and
the KL to the reference, ``beta`` 0.05 by default, is taken from the reward). The embedded default gets the same
short SFT warm-up first.

    python examples/rloo_countdown.py [--model Qwen/Qwen2.5-0.5B-Instruct] [--max-steps 200] [--warm-up-steps 200]
                                      [--out DIR]
"""

from __future__ import annotations

from typing import Any

import countdown
from embedded import ExampleParser, early_and_late, logged, trainer_settings, workspace
from grpo_countdown import LEARNING_RATES, WARM_UP_LEARNING_RATES, WARM_UP_STEPS, warm_up

import torchlike
from torchlike.trl import RLOOConfig, RLOOTrainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = ExampleParser(__doc__, default_steps=200, learning_rates=LEARNING_RATES)
    parser.add_argument("--warm-up-steps", type=int, help=f"SFT steps before RLOO (default: {WARM_UP_STEPS[0]} on the "
                                                            f"embedded default, {WARM_UP_STEPS[1]} with --model)")
    parser.add_argument("--batch-size", type=int, default=64, help="completions per step (default: %(default)s)")
    parser.add_argument("--max-completion-length", type=int, default=16, help="default: %(default)s")
    args = parser.parse_args(argv)
    real_model = bool(args.model)
    warm_up_steps = WARM_UP_STEPS[real_model] if args.warm_up_steps is None else args.warm_up_steps

    with workspace(args.model, args.out) as (source, out):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        model = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        problems = countdown.make_problems(4000, seed=10)
        if warm_up_steps:
            warm_up(model, tokenizer, problems, warm_up_steps, WARM_UP_LEARNING_RATES[real_model], out / "warm-up")
        config = RLOOConfig(output_dir=str(out / "rloo"), per_device_train_batch_size=args.batch_size,
                            num_generations=8, max_completion_length=args.max_completion_length,
                            learning_rate=args.learning_rate, reward_weights=countdown.REWARD_WEIGHTS,
                            **trainer_settings(args.max_steps))
        trainer = RLOOTrainer(model=model, reward_funcs=countdown.REWARD_FUNCS, args=config, train_dataset=problems,
                              processing_class=tokenizer)
        trainer.train()
        trainer.save_model(out / "model")

    rewards, kl = logged(trainer, "reward"), logged(trainer, "kl")
    reward_early, reward_late = early_and_late(rewards)
    print("\nsummary")
    print(f"  model                {source}")
    print(f"  RLOO                 {args.max_steps} steps of {args.batch_size} completions, beta {config.beta}")
    print(f"  reward (sampled)     {reward_early:.3f} -> {reward_late:.3f}   (first -> last quarter of the run)")
    print(f"  KL to the reference  {kl[0]:.4f} -> {kl[-1]:.4f}   (0 at step 1: policy = reference)")
    return {"rewards": rewards, "kl": kl, "model_files": sorted(path.name for path in (out / "model").iterdir())}


if __name__ == "__main__":
    main()
