"""Vision-language SFT with LoRA on a Gemma 3 or Qwen2.5-VL ``*ForConditionalGeneration`` checkpoint, TRL's way: rows
with ``images`` beside ``messages`` (a user turn with an image and a question, the assistant's answer), the model's
processor as ``processing_class``, ``SFTTrainer(model=..., peft_config=LoraConfig(...))``. The task: name the colour
that fills the image. After training, the adapter is saved and loaded back onto a fresh base with the same outputs,
and the model answers from the images with ``generate(pixel_values=...)``.

On the embedded default (a tiny random Gemma 3 with a SigLIP vision tower and its processor, built on the spot; with
``--family qwen2_5_vl`` a tiny Qwen2.5-VL, whose processor keeps each image's own size) the images are 28 x 28; with
``--model google/gemma-3-4b-it`` they are the processor's 896 x 896, with ``--model Qwen/Qwen2.5-VL-3B-Instruct``
their own.

    python examples/vlm_sft.py [--model google/gemma-3-4b-it] [--family qwen2_5_vl] [--max-steps 200] [--out DIR]
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from embedded import ExampleParser, logged, trainer_settings, workspace
from PIL import Image

import torchlike
from torchlike.peft import LoraConfig, PeftModel
from torchlike.trl import SFTConfig, SFTTrainer

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
QUESTION = "the colour is"


def build_tiny_vlm(directory: Path, family: str = "gemma3") -> Path:
    """A tiny random vision-language model of ``family`` (``gemma3`` or ``qwen2_5_vl``) and its processor, saved in
    ``directory``."""
    from torchlike.testing import build_processor, random_model, tiny_multimodal_config

    random_model(tiny_multimodal_config(family)).save_pretrained(directory)
    build_processor(directory, family)
    return directory


def colour_image(colour: str, seed: int, size: int = 28) -> Image.Image:
    """An image filled with ``colour``, with noise."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def rows(count: int, seed: int = 0) -> list[dict]:
    """TRL vision-language SFT rows: ``images`` and the conversation about them."""
    names = list(COLOURS)
    out = []
    for index in range(count):
        colour = names[index % len(names)]
        out.append({"images": [colour_image(colour, seed + index)],
                    "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": colour}]}]})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = ExampleParser(__doc__, default_steps=200, learning_rates=(3e-3, 1e-4))
    parser.add_argument("--family", choices=("gemma3", "qwen2_5_vl"), default="gemma3",
                        help="the embedded default's family (default: %(default)s; ignored with --model)")
    args = parser.parse_args(argv)
    build = functools.partial(build_tiny_vlm, family=args.family)
    with workspace(args.model, args.out, build=build) as (source, out):
        processor = torchlike.AutoProcessor.from_pretrained(source)
        config = SFTConfig(output_dir=str(out / "adapter"), per_device_train_batch_size=4,
                           learning_rate=args.learning_rate, **trainer_settings(args.max_steps))
        trainer = SFTTrainer(model=source, args=config, train_dataset=rows(64), processing_class=processor,
                             peft_config=LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                                    target_modules=r".*language_model.*\.(q_proj|v_proj|o_proj)"))
        trainer.train()
        trainer.save_model()

        questions = rows(4, seed=1000)
        prompts = processor.apply_chat_template([row["messages"][:1] for row in questions], tokenize=False,
                                                add_generation_prompt=True)
        inputs = dict(processor(text=prompts, images=[row["images"] for row in questions], padding=True,
                                padding_side="left", return_tensors="np"))
        generated = np.asarray(trainer.model.generate(**inputs, max_new_tokens=3, do_sample=False))
        answers = processor.batch_decode(generated[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

        reloaded = PeftModel.from_pretrained(torchlike.AutoModelForImageTextToText.from_pretrained(source),
                                             str(out / "adapter"))
        difference = float(np.abs(np.asarray(reloaded(**inputs).logits) -
                                  np.asarray(trainer.model(**inputs).logits))[inputs["attention_mask"] == 1].max())
        for row, answer in zip(questions, answers, strict=True):
            expected = row["messages"][1]["content"][0]["text"]
            print(f"{expected:>5} image -> {answer.strip()!r}")
        print(f"reloaded adapter: max |logit difference| {difference:.2e}")
        return {"losses": logged(trainer, "loss"), "answers": answers, "reload_max_abs_diff": difference,
                "adapter_files": sorted(path.name for path in (out / "adapter").iterdir())}


if __name__ == "__main__":
    main()
