"""Tiny vision-language checkpoints (a random ``*ForConditionalGeneration`` and its processor in one directory) and
the padded image-and-text batches their processor makes of TRL-style conversations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers

from tests import tiny
from torchlike.testing import (
    QWEN_VL_FAMILIES,
    build_multimodal_tokenizer,
    build_processor,
    random_model,
    tiny_image,
    tiny_multimodal_config,
)

#: The texts of :func:`vlm_batch`'s conversations: corpus words, so they tokenize without ``<unk>``.
PROMPTS = ("the quick brown fox", "hello world", "one two three", "the lazy dog")
ANSWERS = ("jumps over", "this is a tiny", "four five six", "seven eight nine")


def save_tiny_vlm(root: Path, family: str = "gemma3", dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Saves a random ``family`` vision-language model (every parameter drawn, eager attention) and its processor
    into ``root / f"tiny-{family}-vlm"``, for ``AutoProcessor.from_pretrained`` and
    ``transformers.AutoModelForImageTextToText.from_pretrained``.


    Args:
        root: the parent directory (e.g. from ``tmp_path_factory.mktemp``).
        family: ``"gemma3"``, ``"gemma4"``, ``"qwen2_5_vl"`` or ``"qwen2_vl"``.
        dtype: the saved weights' dtype.
        seed: the weights' seed.

    Returns:
        The checkpoint directory.
    """
    directory = Path(root) / f"tiny-{family}-vlm"
    model = random_model(tiny_multimodal_config(family), seed=seed, dtype=dtype, every_parameter=True,
                         attn_implementation="eager")
    model.save_pretrained(directory)
    if family in ("gemma3", "gemma4", "llava", "llava_next", *QWEN_VL_FAMILIES):
        build_processor(directory, family)
    else:
        build_multimodal_tokenizer(directory, family)
    return directory


def vision_conversations(count: int = 2, seed: int = 0,
                         text_only_row: bool = True) -> tuple[list[list[dict]], list[list]]:
    """``count`` TRL vision conversations (a user turn with one image and a question, an assistant answer), then,
    with ``text_only_row``, one without an image.

    Returns:
        The conversations and, per conversation, its images (``[]`` for the text-only one).
    """
    conversations, images = [], []
    for row in range(count + text_only_row):
        with_image = row < count
        question = [{"type": "text", "text": PROMPTS[row % len(PROMPTS)]}]
        answer = [{"type": "text", "text": ANSWERS[row % len(ANSWERS)]}]
        conversations.append([{"role": "user", "content": ([{"type": "image"}] if with_image else []) + question},
                              {"role": "assistant", "content": answer}])
        images.append([tiny_image(seed + row)] if with_image else [])
    return conversations, images


def vlm_batch(processor: transformers.ProcessorMixin, count: int = 2, seed: int = 0,
              text_only_row: bool = True) -> transformers.BatchFeature:
    """:func:`vision_conversations` rendered with the processor's chat template and processed as TRL's vision data
    collator does (``padding=True``, no special tokens added: the template writes ``<bos>``), as numpy arrays.

    Gemma 3's processor takes a row without an image in the same batch, so the last row is text only unless
    ``text_only_row=False``.

    Returns:
        ``input_ids``, ``attention_mask``, ``token_type_ids`` (1 on image soft tokens) of shape
        ``(count + text_only_row, length)`` and ``pixel_values`` of shape ``(count, 3, 28, 28)`` float32.
    """
    conversations, images = vision_conversations(count, seed, text_only_row)
    texts = processor.apply_chat_template(conversations, tokenize=False)
    return processor(text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="np")


def vision_preferences(count: int = 2, seed: int = 0, text_only_row: bool = True) -> list[dict]:
    """``count`` TRL vision preference rows, then, with ``text_only_row``, one without an image: the prompt is the
    user turn of :func:`vision_conversations` (its image, if any, in ``images``), ``chosen`` its assistant answer and
    ``rejected`` the next answer of ``ANSWERS``.

    Returns:
        Rows with ``prompt``, ``chosen``, ``rejected`` (message lists of typed parts) and ``images``.
    """
    conversations, images = vision_conversations(count, seed, text_only_row)
    rows = []
    for row, (conversation, row_images) in enumerate(zip(conversations, images, strict=True)):
        rejected = [{"role": "assistant", "content": [{"type": "text", "text": ANSWERS[(row + 1) % len(ANSWERS)]}]}]
        rows.append({"prompt": conversation[:1], "chosen": conversation[1:], "rejected": rejected,
                     "images": row_images})
    return rows


def processor_with_image_seq_length(path: Path, image_seq_length: int) -> transformers.ProcessorMixin:
    """The processor saved at ``path`` rebuilt with another ``image_seq_length`` (a processor that does not match its
    checkpoint: each image then expands to that many soft tokens)."""
    import torchlike

    processor = torchlike.AutoProcessor.from_pretrained(path)
    return transformers.Gemma3Processor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                                        chat_template=processor.chat_template, image_seq_length=image_seq_length)


def scripted(count: int) -> tuple[list[list[int]], list[list[float]]]:
    """Completions for the rows of a generation batch, by row: varying lengths, some ending with EOS."""
    completions = []
    for row in range(count):
        rng = np.random.default_rng([7, row])
        length = int(rng.integers(2, tiny.COMPLETION_LENGTH + 1))
        ids = rng.integers(3, 100, size=length).tolist()
        if row % 3 == 0 and length < tiny.COMPLETION_LENGTH:
            ids[-1] = tiny.EOS
        completions.append(ids)
    return completions, [[0.0] * len(ids) for ids in completions]


def hf_vlm(path) -> transformers.PreTrainedModel:
    """The checkpoint at ``path`` as transformers' ``*ForConditionalGeneration``, eager attention, eval mode."""
    return transformers.AutoModelForImageTextToText.from_pretrained(path, attn_implementation="eager").eval()


def logits_counting_real_tokens(model: transformers.PreTrainedModel, inputs: dict) -> np.ndarray:
    """transformers' float32 logits of ``inputs`` with positions counting real tokens only (as torchlike's and
    ``generate``'s), for models whose positions follow the attention mask only when given."""
    positions = np.maximum(np.cumsum(inputs["attention_mask"], axis=-1) - 1, 0)
    with torch.no_grad():
        tensors = {key: torch.tensor(value) for key, value in inputs.items()}
        return model(**tensors, position_ids=torch.tensor(positions)).logits.float().numpy()


def scripted_grpo_runs(path: Path, rows: list[dict], settings: dict, output: Path, monkeypatch,
                       trl_processor: transformers.ProcessorMixin | None = None) -> tuple[list, dict, list, dict]:
    """TRL's ``GRPOTrainer`` (float32, eager) and torchlike's on the vision-language checkpoint at ``path``, both
    completing every prompt with :func:`scripted` and keeping the rows of a generation batch in order.

    Args:
        rows: TRL's vision prompt rows, given to both.
        settings: the config values both get (``tiny.grpo_settings`` and the case's).
        output: the runs' parent directory (``trl`` and ``ours`` under it).
        monkeypatch: pytest's, to silence TRL's experimental warning and keep its batches unshuffled.
        trl_processor: the processor TRL reads (default: ``torchlike.AutoProcessor`` of ``path`` padding on the
            left, as TRL loads one itself; TRL reads the prompts' token types on the processor's padding side).

    Returns:
        ``(TRL's log history, its final weights, torchlike's log history, its exported weights)``.
    """
    import datasets
    import trl
    import trl.trainer.grpo_trainer as trl_grpo

    import torchlike
    from torchlike.trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    if trl_processor is None:
        trl_processor = torchlike.AutoProcessor.from_pretrained(path)
        trl_processor.tokenizer.padding_side = "left"
    rewards = [tiny.token_reward, tiny.length_reward]
    reference = trl.GRPOTrainer(
        model=transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                                        attn_implementation="eager"),
        reward_funcs=rewards, args=trl.GRPOConfig(output_dir=str(output / "trl"), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(rows), processing_class=trl_processor)
    reference._generate_single_turn = lambda prompt_ids, *args, **kwargs: scripted(len(prompt_ids))
    expected, _, expected_params = tiny.train_trl_recording_advantages(reference, output / "trl")
    trainer = GRPOTrainer(model=str(path), reward_funcs=rewards,
                          args=GRPOConfig(output_dir=str(output / "ours"), **settings), train_dataset=rows,
                          processing_class=torchlike.AutoProcessor.from_pretrained(path))
    trainer._generate_single_turn = lambda prompt_ids, *args: scripted(len(prompt_ids))
    ours, _, params = tiny.train_torchlike_recording_advantages(trainer, output / "ours")
    return expected, expected_params, ours, params


def offline_runs(name: str, path: Path, rows: list[dict], settings: dict, output: Path,
                 processor: Callable[[], transformers.ProcessorMixin] | None = None
                 ) -> tuple[transformers.Trainer, object]:
    """TRL's ``<name>Trainer`` (``"SFT"``, ``"DPO"``, ``"KTO"``; float32, eager attention) and torchlike's, trained
    on ``rows`` of the vision-language checkpoint at ``path`` in dataset order, each with a processor from
    ``processor`` (default: ``torchlike.AutoProcessor`` of ``path``).

    Returns:
        ``(TRL's trainer, torchlike's trainer)``, both trained.
    """
    import datasets
    import trl
    from torch.utils.data import SequentialSampler

    import torchlike
    import torchlike.trl as ours

    processor = processor or (lambda: torchlike.AutoProcessor.from_pretrained(path))
    reference = getattr(trl, f"{name}Trainer")(
        model=transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                                        attn_implementation="eager"),
        args=getattr(trl, f"{name}Config")(output_dir=str(output / "trl"), use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(rows), processing_class=processor())
    reference._get_train_sampler = lambda *args, **kwargs: SequentialSampler(reference.train_dataset)
    reference.train()
    config = getattr(ours, f"{name}Config")(output_dir=str(output / "ours"),
                                            **{"train_sampling_strategy": "sequential", **settings})
    trainer = getattr(ours, f"{name}Trainer")(model=str(path), args=config,
                                              train_dataset=datasets.Dataset.from_list(rows),
                                              processing_class=processor())
    trainer.train()
    return reference, trainer


SFT_SETTINGS = dict(per_device_train_batch_size=3, max_steps=3, learning_rate=3e-3, lr_scheduler_type="linear",
                    warmup_steps=1, weight_decay=0.1, max_grad_norm=0.5, adam_epsilon=1e-4, logging_steps=1, seed=0,
                    bf16=False, report_to="none", save_strategy="no")
"""The vision SFT comparisons' settings: a warmup then a decaying learning rate, weight decay, clipping below every
step's norm, an Adam epsilon above float noise, float32 (TRL's bf16 is autocast, torchlike's casts the weights)."""


def image_conversations(count: int, images_of: Callable[[int], list]) -> list[dict]:
    """``count`` TRL conversation rows: a user turn with ``images_of(row)``'s images (placeholders first) and one of
    :data:`PROMPTS`, an assistant turn with one of :data:`ANSWERS`, and the ``images`` column."""
    rows = []
    for row in range(count):
        images = images_of(row)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image"}] * len(images)
             + [{"type": "text", "text": PROMPTS[row % len(PROMPTS)]}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[row % len(ANSWERS)]}]}],
            "images": images})
    return rows


def assert_sft_matches_trl(reference: transformers.Trainer, trainer: object,
                           metrics: tuple[str, ...] = ("loss", "grad_norm", "entropy", "mean_token_accuracy"),
                           published: Callable[[str], str | None] = lambda name: name, buffers: bool = False) -> None:
    """The two SFT runs of :func:`offline_runs` agree step for step: each of ``metrics`` logged every step within
    rtol 1e-4, and every final weight (torchlike's exported tensors against the transformers model's parameters,
    named by ``published``, which returns ``None`` for one not compared, with its buffers when ``buffers``) within rtol
    1e-4, atol 1e-5."""
    from tests.helpers.logs import logged

    expected, ours = reference.state.log_history, trainer.state.log_history
    steps = reference.args.max_steps
    for key in metrics:
        assert len(logged(expected, key)) == steps, key
        np.testing.assert_allclose(logged(ours, key), logged(expected, key), rtol=1e-4, err_msg=key)
    tensors = reference.model.state_dict() if buffers else dict(reference.model.named_parameters())
    theirs = {renamed: tensor.detach().numpy() for name, tensor in tensors.items()
              if (renamed := published(name)) is not None}
    mine = trainer.model.hf_tensors()
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(np.asarray(mine[name]), value, rtol=1e-4, atol=1e-5, err_msg=name)


def qwen_vl_image_batch(path, padding_side: str) -> dict:
    """Three Qwen-VL conversations processed by the checkpoint's processor: one 16x16 image; a 16x32 and a 32x32
    image; text alone (grids 1x4x4, 1x4x8, 1x8x8)."""
    import torchlike

    processor = torchlike.AutoProcessor.from_pretrained(path)
    images = [[tiny_image(0, 16)], [tiny_image(1, 32).resize((32, 16)), tiny_image(2, 32)], []]
    questions = ["the quick brown fox", "hello world", "one two three four five six seven"]
    conversations = [[{"role": "user", "content": [{"type": "image"}] * len(row) + [{"type": "text", "text": text}]}]
                     for row, text in zip(images, questions, strict=True)]
    texts = processor.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
    processor.tokenizer.padding_side = padding_side
    inputs = processor(text=texts, images=[image for row in images for image in row], padding=True,
                       return_tensors="np")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8], [1, 8, 8]]
    return dict(inputs)


def reference_logits(model: transformers.PreTrainedModel, inputs: dict) -> np.ndarray:
    """transformers' float32 logits of ``inputs`` (numpy arrays), every position (Qwen-VL's multimodal positions
    from ``mm_token_type_ids`` and the grids)."""
    with torch.no_grad():
        return model(**{key: torch.tensor(value) for key, value in inputs.items()}).logits.float().numpy()
