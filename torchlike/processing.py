"""``AutoProcessor``: the ``transformers`` processor of a multimodal checkpoint (tokenizer, image processor, chat
template) as it is, and :func:`check_processor_matches`, which refuses a processor built for another checkpoint."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import transformers

__all__ = ["AutoProcessor", "check_processor_matches"]

# One of these must be in a directory for transformers to build a processor's (or a bare) tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class AutoProcessor:
    """Returns the real ``transformers`` processor (nothing is reimplemented)."""

    def __init__(self, *args, **kwargs):
        raise OSError("Use AutoProcessor.from_pretrained(...).")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any,
                        **kwargs: Any) -> transformers.ProcessorMixin | transformers.PreTrainedTokenizerBase:
        """Loads a processor with ``transformers.AutoProcessor.from_pretrained``.

        ``processor(text=..., images=..., return_tensors="np")`` then gives numpy arrays. A directory with a
        tokenizer and no processor or image processor config gives that tokenizer, as ``transformers`` does.

        Args:
            pretrained_model_name_or_path: a directory or hub id.
            kwargs: passed to ``transformers.AutoProcessor.from_pretrained``.

        Returns:
            A ``transformers.ProcessorMixin`` (e.g. ``Gemma3Processor``), or the tokenizer of a text-only directory.

        Raises:
            FileNotFoundError: the directory holds no tokenizer files.
            ModuleNotFoundError: ``transformers``' processor class needs a package that is not installed (Gemma 4's
                needs ``torchvision``); the message names it.
            OSError: the directory does not exist and the name is not an available hub repository
                (``ModelNotFoundError``).
        """
        from transformers import AutoProcessor as HFAutoProcessor

        from .adapters.checkpoint.hf_hub import resolve_model_dir

        source = resolve_model_dir(pretrained_model_name_or_path, revision=kwargs.pop("revision", None),
                                   cache_dir=kwargs.get("cache_dir"), token=kwargs.get("token"),
                                   local_files_only=kwargs.get("local_files_only", False))
        if not any((source / name).is_file() for name in _TOKENIZER_FILES):
            found = sorted(path.name for path in source.iterdir())
            raise FileNotFoundError(
                f"AutoProcessor: {source} holds no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)}; found "
                f"{', '.join(found) or 'nothing'}). Save the processor there with processor.save_pretrained(...), "
                "which writes the tokenizer, processor_config.json and the image processor's "
                "preprocessor_config.json.")
        try:
            return HFAutoProcessor.from_pretrained(source, *args, **kwargs)
        except ModuleNotFoundError as error:  # transformers names the class; the missing package is in the cause
            raise ModuleNotFoundError(
                f"AutoProcessor: transformers' processor for {source} could not be imported: "
                f"{error.__cause__ or error}. Install that package, or load the tokenizer alone with "
                "AutoTokenizer.from_pretrained.") from error


def check_processor_matches(processor: transformers.ProcessorMixin | transformers.PreTrainedTokenizerBase,
                            hf_config: transformers.PretrainedConfig) -> None:
    """Refuses a processor whose tokens would not line up with the checkpoint's embeddings.

    Checked, where the config has the field: the processor's image token id against the config's
    ``image_token_id`` (Gemma 3's ``image_token_index`` answers to that name too), the processor's
    ``image_seq_length`` against ``mm_tokens_per_image``, and the tokenizer's size against the text config's
    ``vocab_size``. For a checkpoint that takes images, a tokenizer alone (no image processor) is refused.

    Args:
        processor: e.g. from :meth:`AutoProcessor.from_pretrained`; a tokenizer for a text-only checkpoint.
        hf_config: the checkpoint's ``transformers`` config (``Gemma3Config``, ``Gemma4Config``).

    Raises:
        ValueError: one line per mismatch, each with both values and what to do.
    """
    problems = []
    image_token_id = getattr(hf_config, "image_token_id", None)  # only vision-language configs have one
    tokens_per_image = getattr(hf_config, "mm_tokens_per_image", None)  # Gemma 3's; Gemma 4 sizes images itself
    if image_token_id is not None and getattr(processor, "image_processor", None) is None:
        problems.append(f"the checkpoint takes images (image_token_id {image_token_id}) but the "
                        f"{type(processor).__name__} given has no image processor; load the processor saved with the "
                        "checkpoint (AutoProcessor.from_pretrained on its directory), not its tokenizer alone.")
    elif image_token_id is not None:
        if processor.image_token_id != image_token_id:
            problems.append(f"the processor's image token id is {processor.image_token_id} but the checkpoint's "
                            f"image_token_id is {image_token_id}; load the processor saved with this checkpoint.")
        if tokens_per_image is not None and processor.image_seq_length != tokens_per_image:
            problems.append(f"the processor's image_seq_length is {processor.image_seq_length} but the checkpoint's "
                            f"mm_tokens_per_image is {tokens_per_image}; load the processor saved with this "
                            f"checkpoint, or build it with image_seq_length={tokens_per_image} (the processor writes "
                            "its image token sequence when it is built: setting the attribute later is not enough).")
    tokenizer = getattr(processor, "tokenizer", processor)  # a text-only directory's processor is its tokenizer
    vocab_size = hf_config.get_text_config().vocab_size
    if len(tokenizer) > vocab_size:
        problems.append(f"the tokenizer has {len(tokenizer)} tokens but the checkpoint's vocab_size is {vocab_size}; "
                        "ids past it have no embedding: load the tokenizer saved with this checkpoint, or resize the "
                        "model's embeddings (model.resize_token_embeddings(len(tokenizer))) before saving it.")
    if problems:
        raise ValueError("The processor does not match the checkpoint:\n- " + "\n- ".join(problems))
