"""A reward model, TRL's way: ``RewardTrainer(model=..., train_dataset=pairs)`` loads the checkpoint as a one-label
``AutoModelForSequenceClassification`` (a new ``score`` head on the causal LM) and trains it on the countdown
preference pairs of ``countdown.py`` (the right equation against the same numbers with wrong operators). The share of
held-out pairs it ranks right rises from about one half, and the saved classifier loads in ``transformers`` with the
same scores. A GRPO run can then take it as a reward: ``GRPOTrainer(reward_funcs=str(out / "reward"))``.

    python examples/reward_model.py [--model Qwen/Qwen2.5-0.5B-Instruct] [--max-steps 100] [--out DIR]
"""

from __future__ import annotations

from typing import Any

import countdown
import numpy as np
from embedded import ExampleParser, logged, trainer_settings, workspace

import torchlike
from torchlike.trl import RewardConfig, RewardTrainer


def scores(model: Any, tokenizer: Any, texts: list[str]) -> np.ndarray:
    """One reward per text: the classifier's score at the last non-pad token (right-padded, as TRL scores)."""
    batch = tokenizer(texts, padding=True, return_tensors="np")
    output = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return np.asarray(output[:, 0], np.float32)


def ranking_accuracy(model: Any, tokenizer: Any, pairs: list[dict[str, str]]) -> float:
    """Share of pairs whose chosen answer scores above the rejected one."""
    chosen = scores(model, tokenizer, [pair["prompt"] + pair["chosen"] for pair in pairs])
    rejected = scores(model, tokenizer, [pair["prompt"] + pair["rejected"] for pair in pairs])
    return float(np.mean(chosen > rejected))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = ExampleParser(__doc__, default_steps=100, learning_rates=(1e-3, 1e-5)).parse_args(argv)

    with workspace(args.model, args.out) as (source, out):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        pairs = countdown.preference_pairs(countdown.make_problems(2000, seed=10))
        held_out = countdown.preference_pairs(countdown.make_problems(64, seed=99))
        config = RewardConfig(output_dir=str(out / "reward"), max_length=48, per_device_train_batch_size=32,
                              learning_rate=args.learning_rate, **trainer_settings(args.max_steps))
        trainer = RewardTrainer(model=source, args=config, train_dataset=pairs, processing_class=tokenizer)
        accuracy_before = ranking_accuracy(trainer.model, tokenizer, held_out)
        trainer.train()
        accuracy_after = ranking_accuracy(trainer.model, tokenizer, held_out)
        trainer.save_model()
        reloaded = torchlike.AutoModelForSequenceClassification.from_pretrained(out / "reward", dtype="float32")
        texts = [pair["prompt"] + pair["chosen"] for pair in held_out[:8]]
        import torch
        import transformers

        reference = transformers.AutoModelForSequenceClassification.from_pretrained(out / "reward",
                                                                                    dtype=torch.float32)
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            theirs = reference(**batch).logits[:, 0].numpy()
        export_difference = float(np.abs(scores(reloaded, tokenizer, texts) - theirs).max())

    losses, accuracies = logged(trainer, "loss"), logged(trainer, "accuracy")
    print("\nsummary")
    print(f"  model                {source} (+ a new score head)")
    print(f"  reward training      {args.max_steps} steps of {config.per_device_train_batch_size} pairs, learning "
          f"rate {args.learning_rate:g}")
    print(f"  loss                 {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"  ranking (held out)   {accuracy_before:.3f} -> {accuracy_after:.3f}   ({len(held_out)} pairs)")
    print(f"  transformers reload  max |Δ score| {export_difference:.1e}")
    return {"losses": losses, "accuracies": accuracies, "accuracy_before": accuracy_before,
            "accuracy_after": accuracy_after, "export_difference": export_difference}


if __name__ == "__main__":
    main()
