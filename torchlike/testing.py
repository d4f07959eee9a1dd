"""Tiny random Hugging Face checkpoints built on the spot, for tests, examples and benchmarks (no downloads).

One home for each kind of builder:

- :func:`tiny_config`: a ``transformers`` config of a supported family, hidden 64 and 2 layers unless overridden;
- :func:`random_model`: a ``transformers`` model with random weights from a seed, ready for ``save_pretrained``;
- :func:`build_tokenizer`: a byte-level BPE tokenizer trained deterministically on a small corpus, and
  :func:`build_word_tokenizer`: one word ``t<id>`` per id, for data made of random ids;
- :func:`tiny_multimodal_config`: a Gemma 3 or Gemma 4 vision-language config around :func:`tiny_config`'s text
  model, :func:`build_multimodal_tokenizer`: :func:`build_tokenizer` with the family's image and turn tokens,
  :func:`build_processor`: Gemma 3's processor around it, :func:`gemma4_processed`: what Gemma 4's processor returns,
  built from its parts, and :func:`tiny_image`: a random RGB image.

``transformers``, ``tokenizers`` and ``torch`` are imported when a builder runs, so importing this module is cheap.

Example::

    from torchlike.testing import build_tokenizer, random_model, tiny_config

    random_model(tiny_config("llama3", num_hidden_layers=4)).save_pretrained("tiny")
    build_tokenizer("tiny")
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import transformers
    from PIL import Image
    from tokenizers import AddedToken

VOCAB_SIZE = 128
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0 (pad), 1 (bos), 2 (eos), 3 (unk)
TOKENIZER_CORPUS = ("the quick brown fox jumps over the lazy dog", "one two three four five six seven eight nine ten",
                    "hello world, this is a tiny tokenizer for tests")

_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def tiny_config(family: str = "qwen2", **overrides: Any) -> Any:
    """A ``transformers`` config of ``family``: the tiny shape, the family's own settings, then ``overrides``.

    The tiny shape: vocabulary 128, hidden 64, intermediate 128, 2 layers, 4 attention heads and 2 key/value heads
    of ``hidden_size // num_attention_heads``, 128 positions, pad/bos/eos ids 0/1/2 (those of
    :func:`build_tokenizer`). Gemma 3's ``query_pre_attn_scalar`` follows the head size, and Gemma 3's and Gemma
    4's ``layer_types`` alternate sliding and full attention over the layers.

    Args:
        family: a tiny config's name (``Family.tiny_configs`` of the registered families: ``qwen2``, ``llama32`` is
            Llama 3.2 (Llama 3 with its rope scaling, tied), ``mistral``, ``deepseek_v3``...).
        overrides: any config field, e.g. ``hidden_size=256, num_hidden_layers=4`` for a larger model.

    Returns:
        The family's ``transformers`` config (``Qwen2Config``, ``MistralConfig``, ``GPTNeoXConfig``...).
    """
    import transformers

    from .adapters.families import tiny_configs

    configs = tiny_configs()
    if family not in configs:
        raise ValueError(f"tiny_config: unknown family {family!r}; choose one of {', '.join(configs)}.")
    tiny = configs[family]
    fields = {**_SHAPE, **tiny.fields, **overrides}
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    for name, source in tiny.copied_fields.items():
        fields.setdefault(name, fields[source])
    if tiny.alternating_layer_types:
        fields.setdefault("layer_types", [("sliding_attention", "full_attention")[layer % 2]
                                          for layer in range(fields["num_hidden_layers"])])
    return getattr(transformers, tiny.config_class)(**fields)


def random_model(config: transformers.PretrainedConfig, seed: int = 0, dtype: str | torch.dtype = "float32",
                 every_parameter: bool = False,
                 attn_implementation: str | None = None) -> transformers.PreTrainedModel:
    """A ``transformers`` causal LM for ``config`` with random weights, in eval mode (for a vision-language config,
    e.g. from :func:`tiny_multimodal_config`, its ``*ForConditionalGeneration``, vision tower and projector included).

    Args:
        config: a ``transformers`` config, e.g. from :func:`tiny_config` or :func:`tiny_multimodal_config`.
        seed: ``torch.manual_seed`` before ``transformers`` initialises the weights.
        dtype: the weights' dtype, a name (``"bfloat16"``) or a ``torch.dtype``.
        every_parameter: draw every parameter again from a generator seeded with ``seed``: norms
            ``1 + N(0, 0.2²)``, the rest (biases included) ``N(0, 0.08²)``, so that no weight-mapping error hides
            behind the zeros and ones ``transformers`` starts biases and norms from; the routers' saved
            ``e_score_correction_bias`` buffers (DeepSeek-V3, GLM-4 MoE), which choose experts, are drawn too.
        attn_implementation: passed to ``from_config`` (``"eager"`` for reference logits; ``None``: the default).

    Returns:
        The model; ``model.save_pretrained(directory)`` writes the checkpoint.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    # A vision-language config builds its *ForConditionalGeneration (AutoModelForCausalLM maps Qwen3.5's to the
    # text-only class, and Qwen-VL's not at all).
    vision = getattr(config, "vision_config", None) is not None
    auto = (transformers.AutoModelForImageTextToText
            if vision and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            else transformers.AutoModelForCausalLM)
    model = auto.from_config(config, attn_implementation=attn_implementation)
    if every_parameter:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.copy_(1.0 + 0.2 * torch.randn(parameter.shape, generator=generator))
                else:
                    parameter.copy_(0.08 * torch.randn(parameter.shape, generator=generator))
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.08 * torch.randn(buffer.shape, generator=generator))
    return model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eval()


def _byte_pair_merges(words: dict[str, int], alphabet: list[str], size: int) -> tuple[list[str], list[tuple]]:
    """Byte-pair encoding trained deterministically: the most frequent pair is merged first, ties broken by the
    pair's text (the ``tokenizers`` trainer breaks ties by hash order, so its vocabulary changes from run to run)."""
    vocab, merges = list(alphabet), []
    splits = {word: list(word) for word in words}
    while len(vocab) < size:
        pairs: dict[tuple[str, str], int] = {}
        for word, count in words.items():
            for pair in zip(splits[word], splits[word][1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        left, right = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append((left, right))
        vocab.append(left + right)
        for word, parts in splits.items():
            merged, index = [], 0
            while index < len(parts):
                if parts[index] == left and index + 1 < len(parts) and parts[index + 1] == right:
                    merged.append(left + right)
                    index += 2
                else:
                    merged.append(parts[index])
                    index += 1
            splits[word] = merged
    return vocab, merges


def build_tokenizer(directory: str | Path, corpus: Sequence[str] = TOKENIZER_CORPUS, vocab_size: int = VOCAB_SIZE,
                    any_text: bool = False, pad_token: str | None = None,
                    added_tokens: Sequence[str | AddedToken] = (),
                    named_tokens: Mapping[str, str] | None = None) -> Path:
    """Trains a byte-level BPE tokenizer on ``corpus`` (the same on every build) and saves it to ``directory`` as a
    ``transformers`` fast tokenizer; specials ``<pad>``, ``<s>`` (bos), ``</s>`` (eos), ``<unk>`` take ids 0-3.

    Args:
        directory: where ``tokenizer.json`` and its ``transformers`` files are written.
        corpus: the training texts.
        vocab_size: size of the vocabulary, specials included (fewer when the corpus runs out of pairs).
        any_text: start from all 256 byte symbols, so any text encodes, and decode ids back to text, as GPT-2-style
            tokenizers do. Otherwise the alphabet is the corpus's symbols plus lowercase letters, digits and common
            punctuation (a small vocabulary), and decoding gives the byte symbols themselves (``Ġ`` for a space).
        pad_token: the tokenizer's ``pad_token`` (e.g. ``"<pad>"``); ``None`` leaves it unset.
        added_tokens: whole tokens that take the last ids of ``vocab_size``, in order: the byte-pair merges stop
            that many entries early, so every entry they keep has the id it has without ``added_tokens``. A ``str``
            is a special token (``"<start_of_image>"``); a ``tokenizers.AddedToken`` is added as it is (e.g.
            ``AddedToken("\\n", special=False, normalized=False)`` for text the alphabet lacks).
        named_tokens: tokenizer attributes naming special tokens, as multimodal tokenizers name theirs:
            ``{"boi_token": "<start_of_image>"}`` gives ``tokenizer.boi_token`` and ``tokenizer.boi_token_id``.

    Returns:
        ``directory``.
    """
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words: dict[str, int] = {}
    for text in corpus:
        for word, _ in pre_tokenizer.pre_tokenize_str(text):
            words[word] = words.get(word, 0) + 1
    if any_text:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    else:
        extra = "".join(symbol for symbol, _ in pre_tokenizer.pre_tokenize_str(
            string.ascii_lowercase + string.digits + ",.!?:;'-"))
        alphabet = sorted(set("".join(words)) | set(extra) | {pre_tokenizer.pre_tokenize_str(" a")[0][0][0]})
    vocab, merges = _byte_pair_merges(words, alphabet, vocab_size - len(SPECIAL_TOKENS) - len(added_tokens))
    tokenizer = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(vocab))},
                                     merges=merges, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizer
    if any_text:
        tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) if isinstance(token, str) else token
                          for token in added_tokens])
    specials: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if pad_token is not None:  # passed as None, transformers would write "pad_token": null to the config
        specials["pad_token"] = pad_token
    if named_tokens:
        specials["extra_special_tokens"] = dict(named_tokens)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)
    fast.save_pretrained(directory)
    return Path(directory)


def build_word_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """Saves to ``directory`` a word-level tokenizer for data made of random ids: the specials take ids 0-3 as in
    :func:`build_tokenizer`, then id ``i`` is the word ``t<i>``. Text splits on whitespace and gets ``<s>``
    prepended, so every id decodes to one word and a text's ids are the same in every library.

    Returns:
        ``directory``.
    """
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{index}": index for index in range(len(SPECIAL_TOKENS), vocab_size)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>",
                                                     bos_token="<s>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)
    return Path(directory)


@dataclasses.dataclass(frozen=True)
class _MultimodalFamily:
    """What a vision-language family adds to its tiny text model: a vision tower, and whole tokens at the end of the
    vocabulary for its chat template and processor."""

    config_class: str
    vision_config_class: str
    vision: dict[str, Any]
    settings: dict[str, Any]
    text_tokens: tuple[str, ...]  # text the tiny alphabet lacks, kept whole
    special_tokens: tuple[str, ...]
    named_tokens: dict[str, str]  # tokenizer attribute -> token, as the published tokenizer names it
    config_token_fields: dict[str, str]  # config field -> the token whose id it holds

    @property
    def added_tokens(self) -> tuple[str, ...]:
        return self.text_tokens + self.special_tokens


_MULTIMODAL_FAMILIES: dict[str, _MultimodalFamily] = {
    # Gemma 3: a SigLIP tower without its pooling head (as Google's configs set it) seeing 28x28 images as 4x4
    # patches of 7, which the projector average-pools 2x2 into 4 soft tokens per image.
    "gemma3": _MultimodalFamily(
        config_class="Gemma3Config", vision_config_class="SiglipVisionConfig",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                    patch_size=7, vision_use_head=False, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
        settings=dict(mm_tokens_per_image=4),
        text_tokens=("\n",),
        special_tokens=("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                        "<image_soft_token>"),
        named_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                      "image_token": "<image_soft_token>"},
        config_token_fields={"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                             "image_token_index": "<image_soft_token>"}),
    # Gemma 4: its own vision encoder (patches of 7 pooled 2x2, positions up to 16 patches a side), no audio tower.
    "gemma4": _MultimodalFamily(
        config_class="Gemma4Config", vision_config_class="Gemma4VisionConfig",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, patch_size=7, pooling_kernel_size=2,
                    position_embedding_size=16),
        settings=dict(audio_config=None),
        text_tokens=("\n",),
        special_tokens=("<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio>",
                        "<audio|>", "<|audio|>"),
        named_tokens={"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                      "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"},
        config_token_fields={"boi_token_id": "<|image>", "eoi_token_id": "<image|>", "image_token_id": "<|image|>",
                             "video_token_id": "<|video|>", "boa_token_id": "<|audio>",
                             "eoa_token_index": "<audio|>", "audio_token_id": "<|audio|>"}),
}
_QWEN_VL_TOKENS = dict(
    text_tokens=("\n",),
    special_tokens=("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                    "<|video_pad|>"),
    named_tokens={},
    config_token_fields={"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                         "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"})
_TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=16,
                  patch_size=4, projection_dim=32)
"""LLaVA's and LLaVA-NeXT's tiny CLIP tower: 3 blocks (width 32, 2 heads) on 16x16 images in patches of 4."""
_LLAVA_TOKENS = dict(text_tokens=("\n",), special_tokens=("<image>",), named_tokens={},
                     config_token_fields={"image_token_id": "<image>"})
_MULTIMODAL_FAMILIES.update({
    # Qwen2.5-VL: a 2-block tower (width 32, 2 heads) on patches of 4 (2 frames deep) merged 2x2; windows of 16
    # pixels (2x2 merged tokens) in block 0, the whole frame in block 1. A 16x16 image is 4x4 patches, 4 tokens.
    "qwen2_5_vl": _MultimodalFamily(
        config_class="Qwen2_5_VLConfig", vision_config_class="Qwen2_5_VLVisionConfig",
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                    tokens_per_second=2),
        settings=dict(tie_word_embeddings=False), **_QWEN_VL_TOKENS),
    # Qwen2-VL: the same sizes with its LayerNorm, quick-GELU fc1/fc2 tower, attending over whole frames.
    "qwen2_vl": _MultimodalFamily(
        config_class="Qwen2VLConfig", vision_config_class="Qwen2VLVisionConfig",
        vision=dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2),
        settings=dict(tie_word_embeddings=False), **_QWEN_VL_TOKENS),
    # Qwen3-VL: a 2-block tower (width 32, 2 heads, a 4x4 position table) on patches of 4 merged 2x2, block 0's
    # DeepStack features joining the first text layer.
    "qwen3_vl": _MultimodalFamily(
        config_class="Qwen3VLConfig", vision_config_class="Qwen3VLVisionConfig",
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                    deepstack_visual_indexes=[0]),
        settings=dict(tie_word_embeddings=False), **_QWEN_VL_TOKENS),
    # Qwen3-VL-MoE: Qwen3-VL's tiny tower before a text decoder whose second layer holds 4 experts (2 per token).
    "qwen3_vl_moe": _MultimodalFamily(
        config_class="Qwen3VLMoeConfig", vision_config_class="Qwen3VLMoeVisionConfig",
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                    deepstack_visual_indexes=[0]),
        settings=dict(tie_word_embeddings=False), **_QWEN_VL_TOKENS),
    # Qwen3.5: its hybrid text decoder (DeltaNet, attention, DeltaNet) with Qwen3-VL's tower without DeepStack.
    "qwen3_5": _MultimodalFamily(
        config_class="Qwen3_5Config", vision_config_class="Qwen3_5VisionConfig",
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
        settings=dict(tie_word_embeddings=False), **_QWEN_VL_TOKENS),
    # LLaVA: a 3-block CLIP tower (width 32, 2 heads) on 16x16 images in patches of 4, its features taken before the
    # last block (vision_feature_layer=-2) without the class position: 16 tokens per image, through the projector
    # into a Llama decoder.
    "llava": _MultimodalFamily(
        config_class="LlavaConfig", vision_config_class="CLIPVisionConfig", vision=_TINY_CLIP,
        settings=dict(tie_word_embeddings=False, image_seq_length=16), **_LLAVA_TOKENS),
    # LLaVA-NeXT: LLaVA's tower (16x16 tiles) before a Mistral decoder; images tiled at 16x32, 32x16 or 32x32 (the
    # pinpoint nearest their aspect ratio) after a 16x16 base view.
    "llava_next": _MultimodalFamily(
        config_class="LlavaNextConfig", vision_config_class="CLIPVisionConfig", vision=_TINY_CLIP,
        settings=dict(tie_word_embeddings=False, image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]]),
        **_LLAVA_TOKENS),
    # Mistral 3: a 2-block Pixtral encoder (width 32, 2 heads of 16) on patches of 4 of images up to 32x32, merged
    # 2x2, before a Mistral decoder. transformers' PixtralProcessor needs torchvision: build_multimodal_tokenizer
    # gives the tokenizer, the image processor is Pixtral's PIL one.
    "mistral3": _MultimodalFamily(
        config_class="Mistral3Config", vision_config_class="PixtralVisionConfig",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                    image_size=32, patch_size=4),
        settings=dict(tie_word_embeddings=False, spatial_merge_size=2),
        text_tokens=("\n",), special_tokens=("[IMG]", "[IMG_BREAK]", "[IMG_END]"), named_tokens={},
        config_token_fields={"image_token_id": "[IMG]"}),
})
# SmolVLM / Idefics3: a 2-block SigLIP encoder (width 32, 2 heads) on 16x16 images in patches of 4, pixel-shuffled 2x2
# into 4 tokens per image, before a Llama decoder. transformers' auto classes load their image processor only with
# torchvision: build_multimodal_tokenizer gives the tokenizer, the image processor is Idefics3's PIL one.
for _name, _prefix in (("smolvlm", "SmolVLM"), ("idefics3", "Idefics3")):
    _MULTIMODAL_FAMILIES[_name] = _MultimodalFamily(
        config_class=f"{_prefix}Config", vision_config_class=f"{_prefix}VisionConfig",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                    patch_size=4),
        settings=dict(tie_word_embeddings=False, scale_factor=2),
        text_tokens=("\n",), special_tokens=("<fake_token_around_image>", "<global-img>", "<image>",
                                             "<end_of_utterance>"),
        named_tokens={}, config_token_fields={"image_token_id": "<image>"})
MULTIMODAL_FAMILIES = tuple(_MULTIMODAL_FAMILIES)


#: LLaVA-1.5's conversation format, simplified: ``USER: <image>\n... ASSISTANT: ...`` turns, an image item written
#: ``<image>\n`` (the processor repeats the token per image feature).
LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'].upper() + ': ' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<image>\n' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT: ' }}{%- endif -%}"
)

#: Qwen2-VL's chat template, simplified (no default system message): ``<|im_start|>role\n...<|im_end|>\n`` turns, an
#: image item is ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor repeats the pad per merged token), a
#: video item the same with ``<|video_pad|>``.
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

#: Gemma 3's published chat template, simplified (no role-alternation checks): a system message prefixes the first
#: user turn, ``assistant`` is written ``model``, an image item is ``<start_of_image>`` (the processor expands it).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


QWEN_VL_FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")


def _multimodal_family(family: str) -> _MultimodalFamily:
    if family not in _MULTIMODAL_FAMILIES:
        raise ValueError(f"unknown multimodal family {family!r}; choose one of {', '.join(MULTIMODAL_FAMILIES)}.")
    return _MULTIMODAL_FAMILIES[family]


def multimodal_token_ids(family: str = "gemma3") -> dict[str, int]:
    """The ids of ``family``'s added tokens in :func:`build_multimodal_tokenizer`'s vocabulary: the last ids of
    :data:`VOCAB_SIZE`, newline first, then the turn and image (Gemma 4: video and audio too) tokens.

    Args:
        family: one of :data:`MULTIMODAL_FAMILIES`.

    Returns:
        Token text to id, e.g. ``{"\\n": 122, "<start_of_turn>": 123, ..., "<image_soft_token>": 127}`` for Gemma 3.
    """
    added = _multimodal_family(family).added_tokens
    return {token: VOCAB_SIZE - len(added) + index for index, token in enumerate(added)}


def tiny_multimodal_config(family: str = "gemma3", **overrides: Any) -> transformers.PretrainedConfig:
    """A ``transformers`` vision-language config: :func:`tiny_config`'s text model of ``family``, a tiny vision
    tower, and the image token ids of :func:`build_multimodal_tokenizer`'s vocabulary.

    Gemma 3: a ``SiglipVisionConfig`` (hidden 32, intermediate 64, 2 layers, 2 heads, 28x28 images in patches of 7,
    no pooling head) whose 16 patches the projector average-pools into ``mm_tokens_per_image=4`` soft tokens.
    Gemma 4: a ``Gemma4VisionConfig`` (hidden 32, intermediate 64, 2 layers, 2 heads and 2 key/value heads of 16,
    patches of 7 pooled 2x2) and no audio tower.

    Args:
        family: one of :data:`MULTIMODAL_FAMILIES`.
        overrides: fields of the outer config; ``text_config`` and ``vision_config`` given as dicts update the tiny
            ones field by field (``text_config={"num_hidden_layers": 4}``).

    Returns:
        A ``Gemma3Config`` or ``Gemma4Config``; ``random_model`` builds its ``*ForConditionalGeneration``.

    Raises:
        ValueError: ``family`` is not a multimodal family.
    """
    import transformers

    spec = _multimodal_family(family)
    text_config = tiny_config(family, **overrides.pop("text_config", {}))
    vision_config = getattr(transformers, spec.vision_config_class)(**{**spec.vision,
                                                                        **overrides.pop("vision_config", {})})
    token_ids = multimodal_token_ids(family)
    fields = {field: token_ids[token] for field, token in spec.config_token_fields.items()}
    return getattr(transformers, spec.config_class)(text_config=text_config, vision_config=vision_config,
                                                    **{**spec.settings, **fields, **overrides})


def build_multimodal_tokenizer(directory: str | Path, family: str = "gemma3") -> Path:
    """:func:`build_tokenizer` (pad token ``<pad>``) with ``family``'s newline, turn and image tokens as the last
    ids of the vocabulary (:func:`multimodal_token_ids`), the image ones named as the published tokenizer names them
    (Gemma 3: ``boi_token``, ``eoi_token``, ``image_token``), so their ids equal :func:`tiny_multimodal_config`'s.

    Every token the text tokenizer keeps has the id it has in :func:`build_tokenizer`'s; the last merges make room.

    Args:
        directory: where the tokenizer files are written.
        family: one of :data:`MULTIMODAL_FAMILIES`.

    Returns:
        ``directory``.
    """
    from tokenizers import AddedToken

    spec = _multimodal_family(family)
    newline = [AddedToken(token, special=False, normalized=False) for token in spec.text_tokens]
    return build_tokenizer(directory, pad_token="<pad>", added_tokens=[*newline, *spec.special_tokens],
                           named_tokens=spec.named_tokens)


def build_processor(directory: str | Path, family: str = "gemma3") -> Path:
    """Saves to ``directory`` a tiny ``Gemma3Processor`` that ``transformers.AutoProcessor.from_pretrained`` loads
    offline: :func:`build_multimodal_tokenizer`'s tokenizer, a ``Gemma3ImageProcessor`` resizing to 28x28 with
    Gemma 3's published mean and std (0.5), ``image_seq_length=4`` (``mm_tokens_per_image`` of
    :func:`tiny_multimodal_config`) and :data:`GEMMA3_CHAT_TEMPLATE`.

    The processor expands each ``<start_of_image>`` of a text into ``"\\n\\n<start_of_image>"``, four
    ``<image_soft_token>`` and ``"<end_of_image>\\n\\n"``.

    Args:
        directory: where the processor files are written (with a checkpoint's, if it holds one).
        family: ``"gemma3"``, ``"gemma4"`` (``transformers``' ``Gemma4Processor`` around its PIL image processor with
            :data:`GEMMA4_IMAGE_PROCESSOR` and a stand-in video processor, as ``torchlike.AutoProcessor`` loads it
            without torchvision, and :data:`GEMMA4_CHAT_TEMPLATE`), ``"llava"``, ``"llava_next"`` or a Qwen-VL
            family.

    Returns:
        ``directory``.

    Raises:
        ValueError: another ``family``.
        RuntimeError: the saved tokenizer's image token ids differ from :func:`tiny_multimodal_config`'s (a corpus
            too small to fill the vocabulary would do it).
    """
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    if family not in ("gemma3", "gemma4", "llava", "llava_next", *QWEN_VL_FAMILIES):
        raise ValueError(f"build_processor: the processors of gemma3, gemma4, llava, llava_next and "
                         f"{', '.join(QWEN_VL_FAMILIES)} are built tiny, not {family!r}'s; use "
                         "build_multimodal_tokenizer(directory, family) for its tokenizer.")
    spec = _multimodal_family(family)
    build_multimodal_tokenizer(directory, family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    found = {token: tokenizer.convert_tokens_to_ids(token) for token in spec.added_tokens}
    if found != multimodal_token_ids(family):
        raise RuntimeError(f"build_processor: the tokenizer gave the added tokens ids {found}, the config expects "
                           f"{multimodal_token_ids(family)}.")
    if family == "gemma4":
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

        from .processing import pil_twin_classes, processor_with_pil_images

        _, image_class = pil_twin_classes("Gemma4Processor")
        processor_with_pil_images("Gemma4Processor", video_config={"video_processor_type": "Gemma4VideoProcessor"},
                                  image_processor=image_class(**GEMMA4_IMAGE_PROCESSOR), tokenizer=tokenizer,
                                  feature_extractor=Gemma4AudioFeatureExtractor(),
                                  chat_template=GEMMA4_CHAT_TEMPLATE).save_pretrained(directory)
        return Path(directory)
    if family == "llava_next":
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        size = spec.vision["image_size"]
        image_processor = LlavaNextImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}, image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5], image_grid_pinpoints=spec.settings["image_grid_pinpoints"])
        transformers.LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                        patch_size=spec.vision["patch_size"], vision_feature_select_strategy="default",
                                        num_additional_image_tokens=1,
                                        chat_template=LLAVA_CHAT_TEMPLATE).save_pretrained(directory)
        return Path(directory)
    if family == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        size = spec.vision["image_size"]
        image_processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                    patch_size=spec.vision["patch_size"], vision_feature_select_strategy="default",
                                    num_additional_image_tokens=1,
                                    chat_template=LLAVA_CHAT_TEMPLATE).save_pretrained(directory)
        return Path(directory)
    if family in QWEN_VL_FAMILIES:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vision = spec.vision
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
            temporal_patch_size=vision["temporal_patch_size"], size={"shortest_edge": 64, "longest_edge": 1024},
            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        processor_class = {"qwen2_5_vl": transformers.Qwen2_5_VLProcessor, "qwen2_vl": transformers.Qwen2VLProcessor,
                           "qwen3_vl": transformers.Qwen3VLProcessor, "qwen3_vl_moe": transformers.Qwen3VLProcessor,
                           "qwen3_5": transformers.Qwen3VLProcessor}[family]
        # transformers' Qwen2VLVideoProcessor is built on torchvision, which the tests do without: its config is
        # saved as transformers writes it, and torchlike.AutoProcessor loads a stand-in that refuses videos.
        from .processing import processor_without_torchvision_videos

        qwen3 = family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")
        video_type = "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor"
        video_config = {"video_processor_type": video_type, "processor_class": processor_class.__name__,
                        "merge_size": vision["spatial_merge_size"], "patch_size": vision["patch_size"],
                        "temporal_patch_size": vision["temporal_patch_size"], "image_mean": [0.5, 0.5, 0.5],
                        "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 64, "longest_edge": 1024}}
        processor_without_torchvision_videos(processor_class, video_config=video_config,
                                             image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=QWEN_VL_CHAT_TEMPLATE).save_pretrained(directory)
        return Path(directory)
    # The PIL image processor, which transformers' Gemma3ImageProcessor falls back to without torchvision; both save
    # as Gemma3ImageProcessor.
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.5, 0.5, 0.5],
                                              image_std=[0.5, 0.5, 0.5])
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=GEMMA3_CHAT_TEMPLATE,
                                             image_seq_length=spec.settings["mm_tokens_per_image"])
    processor.save_pretrained(directory)
    return Path(directory)


GEMMA4_CHAT_TEMPLATE = ("{% for message in messages %}<|turn>{{ message['role'] }}\n"
                        "{% for part in message['content'] %}"
                        "{% if part['type'] == 'image' %}<|image|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
                        "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
"""A Gemma-4-style chat template for the tiny tokenizer: ``<|turn>role`` turns, an image part written ``<|image|>``
(the processor expands it into the image's soft tokens)."""

GEMMA4_IMAGE_PROCESSOR = dict(patch_size=7, pooling_kernel_size=2, max_soft_tokens=70, do_resize=False)
"""The tiny Gemma 4 image processor's settings (:func:`gemma4_processed`): :func:`tiny_multimodal_config`'s patches of
7 pooled 2x2, images kept at their size (multiples of 14 pixels a side; Gemma 4's resize to the soft-token budget would
make every image 70 soft tokens), padded to 280 patches (the smallest budget, 70 soft tokens, times 4)."""


def gemma4_processed(tokenizer: transformers.PreTrainedTokenizerBase, text: Sequence[str],
                     images: Sequence[Sequence[Image.Image]], **tokenizer_kwargs: Any) -> dict[str, Any]:
    """What ``transformers``' ``Gemma4Processor`` returns for ``text`` and ``images``, built from its parts:
    ``transformers``' ``Gemma4ImageProcessorPil`` (:data:`GEMMA4_IMAGE_PROCESSOR`) and each ``<|image|>`` of the text
    expanded into ``<|image>``, one ``<|image|>`` per soft token and ``<image|>``
    (``Gemma4Processor.replace_image_token``).
    ``Gemma4Processor`` itself cannot be built here: its module imports the torchvision image processor.

    Args:
        tokenizer: :func:`build_multimodal_tokenizer`'s for ``"gemma4"``.
        text: one string per row, an ``<|image|>`` where each of its images goes.
        images: each row's images, in the order of its ``<|image|>`` markers.
        tokenizer_kwargs: passed to the tokenizer (``padding=True``, ``padding_side="left"``...).

    Returns:
        numpy ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (1 on image soft tokens), ``pixel_values``
        ``[images, 280, 147]`` and ``image_position_ids`` ``[images, 280, 2]`` (``(-1, -1)`` on padding patches).

    Raises:
        ValueError: a row whose ``<|image|>`` markers and images differ in number.
    """
    import numpy as np
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    flat = [image for row in images for image in row]
    processed = Gemma4ImageProcessorPil(**GEMMA4_IMAGE_PROCESSOR)(flat, return_tensors="np") if flat else {}
    soft_tokens = iter(processed.get("num_soft_tokens_per_image", []))
    expanded = []
    for row, (sample, row_images) in enumerate(zip(text, images, strict=True)):
        pieces = sample.split(tokenizer.image_token)
        if len(pieces) - 1 != len(row_images):
            raise ValueError(f"row {row} has {len(pieces) - 1} {tokenizer.image_token} markers for {len(row_images)} "
                             "images.")
        expanded.append(pieces[0] + "".join(f"{tokenizer.boi_token}{tokenizer.image_token * next(soft_tokens)}"
                                            f"{tokenizer.eoi_token}{piece}" for piece in pieces[1:]))
    out = dict(tokenizer(expanded, return_tensors="np", **tokenizer_kwargs))
    out["mm_token_type_ids"] = (out["input_ids"] == tokenizer.image_token_id).astype(np.int64)
    if flat:
        out["pixel_values"] = np.asarray(processed["pixel_values"], np.float32)
        out["image_position_ids"] = np.asarray(processed["image_position_ids"], np.int64)
    return out


def tiny_image(seed: int, size: int = 28) -> Image.Image:
    """A ``size`` x ``size`` RGB image of uniformly random bytes drawn from ``seed`` (the same on every call).

    Args:
        seed: seeds ``numpy.random.default_rng``.
        size: the image's height and width in pixels.

    Returns:
        A ``PIL.Image.Image`` in mode ``"RGB"``.
    """
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
