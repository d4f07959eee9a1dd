"""Add LoRA, then load a checkpoint leniently: a full fine-tune is saved with ``torchlike.save(model.state_dict())``
(as with ``torch.save``), a fresh base gets a LoRA adapter with ``get_peft_model``, and
``load_state_dict(torchlike.load(path), strict=False)`` restores the fine-tuned weights, reporting the adapter's
keys as missing (the checkpoint has none) and nothing unexpected. The adapted model then computes exactly what the
fine-tuned one does (a new adapter adds zero), ready for LoRA training on top. A strict load refuses, naming the keys.

    python examples/lora_lenient_load.py [--model Qwen/Qwen2.5-0.5B] [--max-steps 20] [--out DIR]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import countdown
from embedded import ExampleParser, max_logit_difference, trainer_settings, workspace

import torchlike
from torchlike.peft import LoraConfig, PeftModel, get_peft_model
from torchlike.trl import SFTConfig, SFTTrainer


def add_lora_and_load(source: str, checkpoint: Path, strict: bool = False) -> tuple[PeftModel, Any]:
    """A fresh ``source`` model with a new LoRA adapter (r=8 on every linear layer) and the weights of
    ``checkpoint`` loaded into it. Returns ``(model, result)``; ``result`` has ``missing_keys`` and
    ``unexpected_keys``. With ``strict=True`` the load raises instead, as torch does."""
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32"), lora)
    result = model.load_state_dict(torchlike.load(checkpoint), strict=strict)
    return model, result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = ExampleParser(__doc__, default_steps=20, learning_rates=(1e-3, 1e-5)).parse_args(argv)

    with workspace(args.model, args.out) as (source, out):
        tokenizer = torchlike.AutoTokenizer.from_pretrained(source)
        fine_tuned = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        config = SFTConfig(output_dir=str(out / "sft"), max_length=48, per_device_train_batch_size=16,
                           learning_rate=args.learning_rate, **trainer_settings(args.max_steps))
        SFTTrainer(model=fine_tuned, args=config, train_dataset=countdown.sft_examples(countdown.make_problems(400)),
                   processing_class=tokenizer).train()
        torchlike.save(fine_tuned.state_dict(), out / "checkpoint")

        model, result = add_lora_and_load(source, out / "checkpoint")
        lora_keys = sorted(name for name in model.state_dict() if "_lora_" in name)
        try:
            add_lora_and_load(source, out / "checkpoint", strict=True)
            strict_error = ""
        except RuntimeError as error:
            strict_error = str(error)

        batch = tokenizer([p["prompt"] for p in countdown.make_problems(8, seed=99)], return_tensors="pt",
                          padding=True)
        base = torchlike.AutoModelForCausalLM.from_pretrained(source, dtype="float32")
        to_checkpoint = max_logit_difference(model, fine_tuned, batch)
        to_base = max_logit_difference(model, base, batch)

    print("\nsummary")
    print(f"  model                {source}")
    print(f"  checkpoint           {len(fine_tuned.state_dict())} arrays of a {args.max_steps}-step full fine-tune "
          f"(torchlike.save)")
    print(f"  strict=False load    missing {len(result.missing_keys)} (the {len(lora_keys)} LoRA keys, e.g. "
          f"{result.missing_keys[0]!r}), unexpected {len(result.unexpected_keys)}")
    print(f"  strict load          {' '.join(strict_error.split())[:110] + '...' if strict_error else 'accepted'}")
    print(f"  max |Δ logits|       {to_checkpoint:.2e} to the fine-tuned model, {to_base:.2e} to the base")
    return {"missing_keys": result.missing_keys, "unexpected_keys": result.unexpected_keys, "lora_keys": lora_keys,
            "strict_error": strict_error, "max_abs_diff_to_checkpoint": to_checkpoint,
            "max_abs_diff_to_base": to_base}


if __name__ == "__main__":
    main()
