"""GRPO on a verifiable arithmetic task in the spirit of TinyZero's countdown: the prompt asks for an equation
(``Using the numbers [3, 5], make 8.``) and a checker, not a reward model, scores the completion: 0.1 for a
well-formed ``<answer>3+5</answer>``, plus 1.0 when it uses each number once and hits the target (``countdown.py``).

TinyZero starts from a pretrained base. The embedded default starts from random weights, so it first gets a short
SFT warm-up on worked answers (it learns the format and some arithmetic), then GRPO raises the share of correct
answers. A real model skips the warm-up and trains with TRL's default learning rate.

    python examples/grpo_countdown.py [--model Qwen/Qwen2.5-0.5B-Instruct] [--max-steps 200] [--warm-up-steps 200]
                                      [--out DIR]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import countdown
from embedded import ExampleParser, early_and_late, logged, trainer_settings, workspace

import torchlike
from torchlike.trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

LEARNING_RATES = (1e-3, 1e-6)
"""GRPO learning rate on the embedded default and with ``--model`` (TRL's default)."""
WARM_UP_STEPS = (200, 0)
WARM_UP_LEARNING_RATES = (3e-3, 1e-5)
"""SFT warm-up on the embedded default (random weights learn the answer format first) and with ``--model``."""


def warm_up(model: Any, tokenizer: Any, problems: list[dict], max_steps: int, learning_rate: float,
            output_dir: Path) -> list[float]:
    """Full-weight SFT of ``model`` (in place) on the problems' worked answers; returns the logged losses."""
    config = SFTConfig(output_dir=str(output_dir), max_length=48, per_device_train_batch_size=32,
                       learning_rate=learning_rate, **trainer_settings(max_steps))
    trainer = SFTTrainer(model=model, args=config, train_dataset=countdown.sft_examples(problems),
                         processing_class=tokenizer)
    trainer.train()
    return logged(trainer, "loss")


def train_grpo(model: Any, tokenizer: Any, problems: list[dict], max_steps: int, learning_rate: float,
               output_dir: Path, batch_size: int = 64, num_generations: int = 8,
               max_completion_length: int = 16) -> GRPOTrainer:
    """GRPO of ``model`` (in place) on the countdown rewards; ``batch_size`` completions per step,
    ``num_generations`` per prompt. Returns the trainer (its logs hold the rewards of every step)."""
    config = GRPOConfig(output_dir=str(output_dir), per_device_train_batch_size=batch_size,
                        num_generations=num_generations, max_completion_length=max_completion_length,
                        learning_rate=learning_rate, reward_weights=countdown.REWARD_WEIGHTS,
                        **trainer_settings(max_steps))
    trainer = GRPOTrainer(model=model, reward_funcs=countdown.REWARD_FUNCS, args=config, train_dataset=problems,
                          processing_class=tokenizer)
    trainer.train()
    return trainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = ExampleParser(__doc__, default_steps=200, learning_rates=LEARNING_RATES)
    parser.add_argument("--warm-up-steps", type=int, help=f"SFT steps before GRPO (default: {WARM_UP_STEPS[0]} on the "
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
        evaluation = countdown.make_problems(128, seed=99)
        accuracy_before = countdown.greedy_accuracy(model, tokenizer, evaluation, args.max_completion_length)
        warm_up_losses, accuracy_warm = [], None
        if warm_up_steps:
            warm_up_losses = warm_up(model, tokenizer, problems, warm_up_steps, WARM_UP_LEARNING_RATES[real_model],
                                     out / "warm-up")
            accuracy_warm = countdown.greedy_accuracy(model, tokenizer, evaluation, args.max_completion_length)
        trainer = train_grpo(model, tokenizer, problems, args.max_steps, args.learning_rate, out / "grpo",
                             batch_size=args.batch_size, max_completion_length=args.max_completion_length)
        accuracy_after = countdown.greedy_accuracy(model, tokenizer, evaluation, args.max_completion_length)
        trainer.save_model(out / "model")
        samples = countdown.solve_greedily(model, tokenizer, evaluation[:3], args.max_completion_length)

    rewards = logged(trainer, "reward")
    correct = logged(trainer, "rewards/equation_reward/mean")
    (reward_early, reward_late), (correct_early, correct_late) = early_and_late(rewards), early_and_late(correct)
    print("\nsummary")
    print(f"  model                {source}")
    if warm_up_losses:
        print(f"  SFT warm-up          {warm_up_steps} steps, loss {warm_up_losses[0]:.3f} -> {warm_up_losses[-1]:.3f}")
    print(f"  GRPO                 {args.max_steps} steps of {args.batch_size} completions")
    print(f"  reward (sampled)     {reward_early:.3f} -> {reward_late:.3f}   (first -> last quarter of the run)")
    print(f"  correct (sampled)    {correct_early:.3f} -> {correct_late:.3f}")
    after_warm_up = f"{accuracy_warm:.3f} after warm-up, " if warm_up_losses else ""
    print(f"  correct (greedy)     {accuracy_before:.3f} at start, {after_warm_up}{accuracy_after:.3f} after GRPO   "
          f"({len(evaluation)} problems)")
    for problem, completion in zip(evaluation, samples, strict=False):
        print(f"  {problem['prompt']!r} -> {completion!r}")
    return {"warm_up_losses": warm_up_losses, "rewards": rewards, "correct": correct,
            "accuracy_before": accuracy_before, "accuracy_after_warm_up": accuracy_warm,
            "accuracy_after": accuracy_after, "samples": samples}


if __name__ == "__main__":
    main()
