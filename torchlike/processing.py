"""``AutoProcessor``: the ``transformers`` processor of a multimodal checkpoint (tokenizer, image processor, chat
template) as it is, and :func:`check_processor_matches`, which refuses a processor built for another checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
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
            ModuleNotFoundError: ``transformers``' processor class needs a package that is not installed; the message
                names it. Without ``torchvision``, Qwen-VL's processors load with a stand-in video processor, and
                ``PixtralProcessor`` and ``Gemma4Processor`` around their PIL image processors
                (:func:`processor_with_pil_images`).
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
        except ImportError as error:
            processor = _with_pil_images(source, kwargs) or _without_torchvision_videos(source, error, kwargs)
            if processor is not None:
                return processor
            if not isinstance(error, ModuleNotFoundError):
                raise
            # transformers names the class; the missing package is in the cause
            raise ModuleNotFoundError(
                f"AutoProcessor: transformers' processor for {source} could not be imported: "
                f"{error.__cause__ or error}. Install that package, or load the tokenizer alone with "
                "AutoTokenizer.from_pretrained.") from error


VIDEO_CONFIG = "video_preprocessor_config.json"


def _push_to_hub_mixin() -> type:
    from transformers.utils import PushToHubMixin

    return PushToHubMixin


class VideoProcessorWithoutTorchvision(_push_to_hub_mixin()):
    """Stands in for a video processor that ``transformers`` builds on ``torchvision`` (Qwen-VL's) where
    ``torchvision`` is not installed, so that the processor still takes text and images: processing a video raises,
    naming the package. Saved, it writes the original video processor's config back unchanged.

    A ``PushToHubMixin``, as ``transformers``' processors expect of a part they save.

    Args:
        config: the saved video processor's config (``video_preprocessor_config.json``), kept as it is.
        name: the video processor class it stands in for.
    """

    _auto_class = None  # transformers' processor asks, to save custom code (there is none)

    def __init__(self, config: dict[str, Any], name: str):
        self.config = dict(config)
        self.name = name
        for key in ("merge_size", "patch_size", "temporal_patch_size"):
            setattr(self, key, self.config.get(key))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError(f"{self.name} processes videos with torchvision, which is not installed: install "
                                  "torchvision to process videos, or pass pixel_values_videos and video_grid_thw built "
                                  "another way. Text and images work without it.")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.config)

    def to_json_string(self) -> str:
        import json

        return json.dumps(self.config, indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> list[str]:
        from pathlib import Path

        path = Path(save_directory) / VIDEO_CONFIG
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(self.to_json_string())
        temporary.replace(path)
        return [str(path)]


def processor_without_torchvision_videos(processor_class: type, *, video_config: dict[str, Any],
                                         **parts: Any) -> transformers.ProcessorMixin:
    """``processor_class(**parts)`` with :class:`VideoProcessorWithoutTorchvision` as its ``video_processor`` (the
    class checks each part's type; the stand-in is accepted in place of the torchvision one).

    Args:
        processor_class: e.g. ``transformers.Qwen2_5_VLProcessor``.
        video_config: the video processor's config (its ``video_processor_type`` names the class it stands in for).
        parts: the other parts (``image_processor``, ``tokenizer``, ``chat_template``...).
    """
    original = processor_class.check_argument_for_proper_class

    def check(self, argument_name, argument):
        if isinstance(argument, VideoProcessorWithoutTorchvision):
            return argument
        return original(self, argument_name, argument)

    accepting = type(processor_class.__name__, (processor_class,), {"check_argument_for_proper_class": check,
                                                                    "__module__": processor_class.__module__})
    name = video_config.get("video_processor_type", "the video processor")
    return accepting(video_processor=VideoProcessorWithoutTorchvision(video_config, name), **parts)


def _saved_video_config(source: Path) -> dict[str, Any] | None:
    """The video processor's saved config at ``source``, or ``None``: transformers 5 saves every part's config inside
    ``processor_config.json``; older saves have a file of their own."""
    import json

    composite = Path(source) / "processor_config.json"
    saved = json.loads(composite.read_text()) if composite.is_file() else {}
    video_config = saved.get("video_processor")
    if video_config is None and (Path(source) / VIDEO_CONFIG).is_file():
        video_config = json.loads((Path(source) / VIDEO_CONFIG).read_text())
    return video_config if isinstance(video_config, dict) else None


def _saved_settings(processor_class: type, source: Path) -> dict[str, Any]:
    """The processor's own saved settings at ``source`` (its chat template and plain values), without its parts'
    configs, for building it from parts."""
    processor_dict, _ = processor_class.get_processor_dict(source)
    settings = {key: value for key, value in processor_dict.items()
                if key in ("chat_template", "audio_tokenizer") or not isinstance(value, dict)}
    settings.pop("processor_class", None)
    return settings


def _without_torchvision_videos(source, error: ImportError, kwargs: dict[str, Any]
                                ) -> transformers.ProcessorMixin | None:
    """The processor at ``source`` with :class:`VideoProcessorWithoutTorchvision` for its video processor, when
    loading failed only because that one needs ``torchvision``; ``None`` otherwise."""
    import importlib.util
    import json

    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        return None
    composite = source / "processor_config.json"
    saved = json.loads(composite.read_text()) if composite.is_file() else {}
    video_config = _saved_video_config(source)
    if video_config is None:
        return None
    name = saved.get("processor_class") or video_config.get("processor_class")
    processor_class = getattr(transformers, name, None) if name else None
    if processor_class is None or "video_processor" not in processor_class.get_attributes():
        return None
    processor_dict = _saved_settings(processor_class, source)
    # The module's class: transformers' top-level AutoImageProcessor is a placeholder without torchvision.
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    parts = {"tokenizer": transformers.AutoTokenizer.from_pretrained(source, **kwargs),
             "image_processor": AutoImageProcessor.from_pretrained(source, **kwargs)}
    return processor_without_torchvision_videos(processor_class, video_config=video_config, **parts,
                                                **processor_dict)


PIL_TWINS = {"PixtralProcessor": "pixtral", "Gemma4Processor": "gemma4"}
"""Processors whose module imports a helper from the torchvision image processor's module (``transformers.models.
<model>.image_processing_<model>``) that the PIL image processor's module (``image_processing_pil_<model>``) also
defines: without torchvision, :func:`processor_with_pil_images` builds them around the PIL image processor."""


def pil_twin_classes(name: str) -> tuple[type, type]:
    """``(processor class, PIL image processor class)`` of one of :data:`PIL_TWINS`: the processor's module imported
    with the PIL image processor's module standing in for the torchvision one (removed again after)."""
    import importlib
    import sys

    model = PIL_TWINS[name]
    twin = importlib.import_module(f"transformers.models.{model}.image_processing_pil_{model}")
    stand_in = f"transformers.models.{model}.image_processing_{model}"
    previous = sys.modules.get(stand_in)
    sys.modules[stand_in] = twin
    try:
        processing = importlib.import_module(f"transformers.models.{model}.processing_{model}")
    finally:
        if previous is None:
            sys.modules.pop(stand_in, None)
        else:
            sys.modules[stand_in] = previous
    image_class = next(value for key, value in vars(twin).items()
                       if key.endswith("ImageProcessorPil") and isinstance(value, type))
    return getattr(processing, name), image_class


def processor_with_pil_images(name: str, *, video_config: dict[str, Any] | None = None,
                              **parts: Any) -> transformers.ProcessorMixin:
    """``transformers``' processor ``name`` (one of :data:`PIL_TWINS`) built from ``parts`` without torchvision: its
    image processor the PIL one, and, for a processor with a video processor (Gemma 4's), the stand-in
    :class:`VideoProcessorWithoutTorchvision` with ``video_config``.

    Args:
        name: e.g. ``"PixtralProcessor"``.
        video_config: the video processor's config (its ``video_processor_type`` names the class it stands in for).
        parts: ``image_processor`` (a PIL one: :func:`pil_twin_classes`), ``tokenizer``, ``feature_extractor``,
            ``chat_template`` and the processor's own settings.
    """
    processor_class, _ = pil_twin_classes(name)
    if "video_processor" in processor_class.get_attributes():
        return processor_without_torchvision_videos(processor_class, video_config=video_config or {}, **parts)
    return processor_class(**parts)


def _with_pil_images(source: os.PathLike, kwargs: dict[str, Any]) -> transformers.ProcessorMixin | None:
    """The processor saved at ``source`` built by :func:`processor_with_pil_images`, where torchvision is missing and
    its class is one of :data:`PIL_TWINS`; ``None`` otherwise. The saved configs are read as they are."""
    import importlib.util
    import json

    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        return None
    saved = Path(source) / "processor_config.json"
    name = json.loads(saved.read_text()).get("processor_class") if saved.is_file() else None
    if name not in PIL_TWINS:
        return None
    processor_class, image_class = pil_twin_classes(name)
    settings = _saved_settings(processor_class, source)
    parts = {"image_processor": image_class.from_pretrained(source, **kwargs),
             "tokenizer": transformers.AutoTokenizer.from_pretrained(source, **kwargs)}
    if "feature_extractor" in processor_class.get_attributes():
        from transformers.models.auto.feature_extraction_auto import AutoFeatureExtractor

        parts["feature_extractor"] = AutoFeatureExtractor.from_pretrained(source, **kwargs)
    return processor_with_pil_images(name, video_config=_saved_video_config(source), **parts, **settings)


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
