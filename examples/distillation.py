"""On-policy distillation, TRL's way: ``DistillationTrainer(model=student, teacher_model=teacher, ...)``. The
student samples completions for the countdown prompts and learns the teacher's next-token distribution on them
(generalised JSD, ``beta`` 0.5). On the embedded default the teacher is the tiny model after a short SFT on worked
answers, and the student the untrained model it started from; the divergence falls as the student learns.

    python examples/distillation.py [--model Qwen/Qwen2.5-0.5B-Instruct --teacher Qwen/Qwen2.5-1.5B-Instruct]
                                    [--max-steps 100] [--out DIR]
"""

from __future__ import annotations

from typing import Any

import countdown
from embedded import ExampleParser, early_and_late, logged, trainer_settings, workspace
from grpo_countdown import WARM_UP_LEARNING_RATES, warm_up

import torchlike
from torchlike.trl import DistillationConfig, DistillationTrainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = ExampleParser(__doc__, default_steps=100, learning_rates=(1e-3, 1e-6))
    parser.add_argument("--teacher", help="teacher checkpoint (default: the embedded default after an SFT warm-up)")
    parser.add_argument("--warm-up-steps", type=int, default=100, help="the embedded teacher's SFT steps "
                                                                         "(default: %(default)s)")
    args = parser.parse_args(argv)

    with workspace(args.model, args.out) as (source, out):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        problems = countdown.make_problems(2000, seed=10)
        if args.teacher:
            teacher = torchlike.AutoModelForCausalLM.from_pretrained(args.teacher)
        else:
            teacher = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
            warm_up(teacher, tokenizer, problems, args.warm_up_steps, WARM_UP_LEARNING_RATES[0], out / "teacher")
        config = DistillationConfig(output_dir=str(out / "student"), per_device_train_batch_size=16,
                                    max_completion_length=16, beta=0.5, learning_rate=args.learning_rate,
                                    **trainer_settings(args.max_steps))
        trainer = DistillationTrainer(model=source, teacher_model=teacher, args=config,
                                      train_dataset=[{"prompt": problem["prompt"]} for problem in problems],
                                      processing_class=tokenizer)
        trainer.train()
        trainer.save_model()

    losses = logged(trainer, "loss")
    early, late = early_and_late(losses)
    print("\nsummary")
    print(f"  student              {source}")
    print(f"  teacher              {args.teacher or f'the same model after {args.warm_up_steps} SFT steps'}")
    print(f"  distillation         {args.max_steps} steps of {config.per_device_train_batch_size} on-policy "
          f"completions, beta {config.beta}")
    print(f"  divergence           {early:.4f} -> {late:.4f}   (first -> last quarter of the run)")
    return {"losses": losses}


if __name__ == "__main__":
    main()
