"""torchlike end to end, in a few minutes on a CPU: build a tiny model and tokenizer, SFT it, GRPO it on a
verifiable arithmetic task (the reward rises), save and reload it with ``state_dict``, add LoRA and load the
checkpoint leniently, export it to Hugging Face format and reload the export with ``transformers`` to show the same
generations. A summary with the numbers ends the run.

With no arguments the model is the embedded default: a tiny random Qwen2 and a BPE tokenizer built on the spot (no
downloads). ``--model DIR_OR_HUB_ID`` runs the same steps on a real checkpoint. Each step is one of the examples
beside this file (``grpo_countdown.py``, ``lora_lenient_load.py``, ``export_for_vllm.py``), strung together.
``--quick`` trains 3 steps per stage (what CI runs): it shows the plumbing, not the learning.

    python examples/demo.py [--model Qwen/Qwen2.5-0.5B] [--max-steps 200 | --quick] [--out DIR]
"""

from __future__ import annotations

import time
from typing import Any

import countdown
import jax
from embedded import ExampleParser, early_and_late, logged, max_logit_difference, workspace
from export_for_vllm import compare_with_transformers
from grpo_countdown import LEARNING_RATES, WARM_UP_LEARNING_RATES, train_grpo, warm_up
from lora_lenient_load import add_lora_and_load

import torchlike


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = ExampleParser(__doc__, default_steps=200)
    parser.add_argument("--quick", action="store_true", help="3 steps per stage, small batches (what CI runs)")
    args = parser.parse_args(argv)
    steps = 3 if args.quick else args.max_steps
    real_model = bool(args.model)
    started = time.perf_counter()

    with workspace(args.model, args.out) as (source, out):
        import torch
        import transformers

        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        model = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        print(model)
        problems = countdown.make_problems(4000, seed=10)
        evaluation = countdown.make_problems(64 if args.quick else 128, seed=99)
        accuracy = [countdown.greedy_accuracy(model, tokenizer, evaluation)]
        sft_losses = warm_up(model, tokenizer, problems, steps, WARM_UP_LEARNING_RATES[real_model], out / "sft")
        accuracy.append(countdown.greedy_accuracy(model, tokenizer, evaluation))
        grpo = train_grpo(model, tokenizer, problems, steps, LEARNING_RATES[real_model], out / "grpo",
                          batch_size=8 if args.quick else 64, num_generations=4 if args.quick else 8)
        accuracy.append(countdown.greedy_accuracy(model, tokenizer, evaluation))

        batch = tokenizer([p["prompt"] for p in evaluation[:16]], return_tensors="pt", padding=True)
        torchlike.save(model.state_dict(), out / "checkpoint")
        reloaded = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        strict_result = reloaded.load_state_dict(torchlike.load(out / "checkpoint"))
        reload_difference = max_logit_difference(model, reloaded, batch)

        adapted, lenient_result = add_lora_and_load(source, out / "checkpoint")
        lenient_difference = max_logit_difference(model, adapted, batch)

        model.save_pretrained(out / "hf-export", tokenizer=tokenizer)
        exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf-export", dtype=torch.float32)
        export_check = compare_with_transformers(model, exported, tokenizer, evaluation[:16])
        export_files = sorted(path.name for path in (out / "hf-export").iterdir())

    rewards = logged(grpo, "reward")
    correct = logged(grpo, "rewards/equation_reward/mean")
    (reward_early, reward_late), (correct_early, correct_late) = early_and_late(rewards), early_and_late(correct)
    agrees = export_check["same_generations"] == 16 and export_check["max_abs_logit_diff"] < 1e-3
    print("\nsummary")
    print(f"  model            {source} ({model.num_parameters():,} parameters, {model.dtype}, "
          f"{jax.default_backend()}); total {time.perf_counter() - started:.0f} s")
    print(f"  1 SFT            {steps} steps, loss {sft_losses[0]:.3f} -> {sft_losses[-1]:.3f}; "
          f"greedy accuracy {accuracy[0]:.3f} -> {accuracy[1]:.3f}   ({len(evaluation)} problems)")
    print(f"  2 GRPO           {steps} steps of {grpo.args.per_device_train_batch_size} completions; first -> last "
          f"quarter: reward {reward_early:.3f} -> {reward_late:.3f}, sampled accuracy {correct_early:.3f} -> "
          f"{correct_late:.3f}; greedy accuracy {accuracy[1]:.3f} -> {accuracy[2]:.3f}")
    print(f"                   reward every {grpo.args.logging_steps} steps: {' '.join(f'{r:.2f}' for r in rewards)}")
    print(f"  3 state_dict     torchlike.save -> fresh model.load_state_dict: {strict_result}, "
          f"max |Δ logits| {reload_difference:.1e}")
    print(f"  4 LoRA, lenient  get_peft_model + load_state_dict(strict=False): {len(lenient_result.missing_keys)} "
          f"missing (the LoRA keys), {len(lenient_result.unexpected_keys)} unexpected, "
          f"max |Δ logits| {lenient_difference:.1e}")
    print(f"  5 HF export      {out / 'hf-export'} -> {export_files}")
    print(f"                   transformers reload: same greedy answers {export_check['same_generations']}/16, "
          f"max |Δ logits| {export_check['max_abs_logit_diff']:.1e}  ({'OK' if agrees else 'MISMATCH'})")
    for problem, completion in list(zip(evaluation, export_check["generations"], strict=False))[:3]:
        print(f"                   {problem['prompt']!r} -> {completion!r}")
    if not agrees:
        raise SystemExit("the transformers reload of the export disagrees with torchlike")
    return {"sft_losses": sft_losses, "rewards": rewards, "correct": correct, "greedy_accuracy": accuracy,
            "reward_early_late": (reward_early, reward_late), "correct_early_late": (correct_early, correct_late),
            "reload_max_abs_diff": reload_difference, "lenient_missing": lenient_result.missing_keys,
            "lenient_unexpected": lenient_result.unexpected_keys, "lenient_max_abs_diff": lenient_difference,
            "export": export_check}


if __name__ == "__main__":
    main()
