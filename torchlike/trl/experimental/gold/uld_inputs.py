"""GOLD's tokenizer-side inputs of the ULD loss, as TRL 1.16 makes them (``trl.experimental.gold.gold_trainer`` and
``trl.experimental.utils``), NumPy in and out.

The ULD loss (``adapters/losses/uld.py``) aligns the two sides by UTF-8 byte offsets relative to the completion's
text: ``(start, end)`` per token, ``(0, 0)`` at the prompt and the padding. The teacher's come from
:func:`build_teacher_inputs_from_texts` (the completion re-encoded by the teacher's tokenizer, EOS appended at
``(len, len)``); the student's from the dataset's tokenisation (``gold_data.tokenize_with_original_text``) or, for
its own sampled completions, from :func:`completion_byte_offsets` (the labelled tokens' piece lengths, cumulated).
Offsets come from a fast tokenizer's character offsets (:func:`encode_with_byte_offsets`); only ByteLevel BPE
tokenizers are supported there, as in TRL.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np

from ....type_aliases import Tokenizer
from ..gkd.gkd_data import is_byte_level_tokenizer

if TYPE_CHECKING:
    import tokenizers

__all__ = ["build_teacher_inputs_from_texts", "completion_byte_offsets", "encode_with_byte_offsets",
           "pad_byte_offsets"]

ByteOffsets = list[tuple[int, int]]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of ByteLevel BPE pieces."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, [chr(code) for code in characters], strict=True))


#: A ByteLevel piece's character -> the byte it stands for.
_BYTE_LEVEL_DECODER = {character: byte for byte, character in _bytes_to_unicode().items()}


def _piece_byte_length(piece: str, text: bytes, start: int) -> int | None:
    """The bytes a ByteLevel piece stands for in ``text`` at ``start`` (a leading space the text lacks there, added
    by the pre-tokenizer, not counted), or ``None`` when ``piece`` is not ByteLevel-spelled."""
    if any(character not in _BYTE_LEVEL_DECODER for character in piece):
        return None
    piece_bytes = [_BYTE_LEVEL_DECODER[character] for character in piece]
    if piece_bytes and piece_bytes[0] == ord(" ") and text[start:start + 1] != b" ":
        piece_bytes = piece_bytes[1:]
    return len(piece_bytes)


def _split_repeated_offsets(offsets: ByteOffsets, tokens: list[str]) -> ByteOffsets:
    """Runs of tokens sharing one span (the bytes of one character split over several pieces) get consecutive
    sub-spans of their pieces' lengths, when those lengths add up to the span."""
    split = list(offsets)
    first = 0
    while first < len(offsets):
        end = first + 1
        while end < len(offsets) and offsets[end] == offsets[first]:
            end += 1
        if end - first > 1:
            span_start, span_end = offsets[first]
            lengths = [len(token) for token in tokens[first:end]]
            if sum(lengths) == span_end - span_start:
                cursor = span_start
                for index, length in enumerate(lengths, start=first):
                    split[index] = (cursor, cursor + length)
                    cursor += length
        first = end
    return split


def _normalized_offsets(offsets: ByteOffsets, tokens: list[str], text: bytes) -> ByteOffsets:
    """TRL's ``_normalize_byte_offsets``: repeated spans split, overlapping spans cut to their pieces' bytes, and
    empty tokens placed at the running end, so the offsets never go back."""
    offsets = _split_repeated_offsets(offsets, tokens)
    normalized: ByteOffsets = []
    cursor = 0
    for index, (start, end) in enumerate(offsets):
        if start == end:
            normalized.append((cursor, cursor))
            continue
        length = _piece_byte_length(tokens[index], text, start)
        next_start = offsets[index + 1][0] if index + 1 < len(offsets) else None
        overlaps = start < cursor or (next_start is not None and next_start < end)
        if length is not None and (overlaps or length == end - start):
            candidate_start = max(start, cursor)
            if candidate_start + length <= end:
                start, end = candidate_start, candidate_start + length
        if start < cursor or end < start:
            raise ValueError("Tokenizer produced overlapping byte offsets that could not be normalized. "
                             "Cross-tokenizer ULD requires monotonic byte offsets.")
        normalized.append((start, end))
        cursor = end
    return normalized


def encode_with_byte_offsets(backend: tokenizers.Tokenizer, texts: Sequence[str], add_special_tokens: bool = False
                             ) -> list[tuple[list[int], ByteOffsets]]:
    """TRL's ``encode_with_byte_offsets``: each text's token ids and UTF-8 byte offsets, from the fast tokenizer's
    character offsets (repeated and overlapping spans of byte-level pieces split across their bytes).

    Args:
        backend: ``tokenizer.backend_tokenizer`` of a ByteLevel BPE fast tokenizer.
        texts: the texts to encode.
        add_special_tokens: let the tokenizer's post-processor add its special tokens.

    Returns:
        One ``(ids, [(start, end), ...])`` per text.

    Raises:
        NotImplementedError: the tokenizer is not ByteLevel (TRL's message).
        ValueError: offsets that cannot be made monotonic.
    """
    if not is_byte_level_tokenizer(backend):
        raise NotImplementedError(
            "Cross-tokenizer ULD currently supports only ByteLevel BPE tokenizers "
            "(Llama-3, Qwen, SmolLM, Phi, Mistral v0.3+, …). The given tokenizer is not ByteLevel.")
    encoded = []
    for text, encoding in zip(texts, backend.encode_batch(list(texts), add_special_tokens=add_special_tokens),
                              strict=True):
        char_to_byte = list(accumulate((len(character.encode("utf-8")) for character in text), initial=0))
        offsets = [(char_to_byte[start], char_to_byte[end]) for start, end in encoding.offsets]
        encoded.append((list(encoding.ids), _normalized_offsets(offsets, encoding.tokens, text.encode("utf-8"))))
    return encoded


def pad_byte_offsets(offsets: Sequence[tuple[int, int]], target_length: int, padding_side: str) -> np.ndarray:
    """TRL's ``pad_byte_offsets``: ``[max(len, target_length), 2]`` ``int64`` offsets padded with ``(0, 0)`` on
    ``padding_side`` (``"left"`` or ``"right"``)."""
    rows = np.asarray(offsets, np.int64).reshape(-1, 2)
    padding = np.zeros((max(target_length - len(rows), 0), 2), np.int64)
    return np.concatenate([padding, rows] if padding_side == "left" else [rows, padding])


def build_teacher_inputs_from_texts(tokenizer: Tokenizer, prompt_texts: Sequence[str],
                                    completion_texts: Sequence[str], use_extended_uld: bool = True
                                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """TRL's ``build_teacher_inputs_from_texts``: the teacher's right-padded inputs of the student's prompts and
    completions, re-encoded by the teacher's tokenizer.

    A row is the prompt (tokenised with special tokens, a trailing EOS removed), the completion (without special
    tokens) and the EOS; the completion and the EOS are labelled.

    Args:
        tokenizer: the teacher's fast tokenizer (ByteLevel BPE with ``use_extended_uld``).
        prompt_texts: the prompts' texts (``original_prompt_text``).
        completion_texts: the completions' texts (``original_completion_text``).
        use_extended_uld: compute the byte offsets (else they are all zero: positional ULD ignores them).

    Returns:
        ``(input_ids, labels, attention_mask, byte_offsets)``: ``[B, L]`` ``int64`` ids padded with the pad token (0
        without one), ``[B, L]`` ``int64`` labels (``-100`` at the prompt and padding), ``[B, L]`` ``bool`` mask and
        ``[B, L, 2]`` ``int64`` completion-relative offsets (the EOS at ``(len, len)`` of the completion's UTF-8
        bytes; prompt and padding ``(0, 0)``).
    """
    eos_token_id = tokenizer.eos_token_id
    prompt_token_ids = tokenizer(list(prompt_texts), add_special_tokens=True)["input_ids"]
    if use_extended_uld:
        completions = encode_with_byte_offsets(tokenizer.backend_tokenizer, completion_texts, add_special_tokens=False)
    else:
        completions = [(ids, [(0, 0)] * len(ids))
                       for ids in tokenizer(list(completion_texts), add_special_tokens=False)["input_ids"]]
    sequences, labels, offsets = [], [], []
    for prompt_ids, (completion_ids, completion_offsets), completion_text in zip(
            prompt_token_ids, completions, completion_texts, strict=True):
        if eos_token_id is not None and prompt_ids and prompt_ids[-1] == eos_token_id:
            prompt_ids = prompt_ids[:-1]
        sequence = list(prompt_ids) + list(completion_ids)
        row_offsets = [(0, 0)] * len(prompt_ids) + list(completion_offsets)
        if eos_token_id is not None:
            sequence.append(eos_token_id)
            content_length = len(completion_text.encode("utf-8"))
            row_offsets.append((content_length, content_length) if use_extended_uld else (0, 0))
        sequences.append(sequence)
        labels.append([-100] * len(prompt_ids) + sequence[len(prompt_ids):])
        offsets.append(row_offsets)
    width = max(len(sequence) for sequence in sequences)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def padded(rows: list[list[int]], value: int) -> np.ndarray:
        return np.array([row + [value] * (width - len(row)) for row in rows], np.int64)

    attention_mask = padded([[1] * len(sequence) for sequence in sequences], 0).astype(bool)
    byte_offsets = np.stack([pad_byte_offsets(row, width, padding_side="right") for row in offsets])
    return padded(sequences, pad_token_id), padded(labels, -100), attention_mask, byte_offsets


def completion_byte_offsets(tokenizer: Tokenizer, input_ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The student's byte offsets of its own sampled completions, as ``GOLDTrainer._maybe_add_completion_byte_offsets``
    attaches them: each labelled token spans its piece's length (``len(convert_ids_to_tokens(id))``, one character
    per byte for a ByteLevel piece) after the previous labelled token, from 0; other positions ``(0, 0)``.

    Args:
        tokenizer: the student's tokenizer.
        input_ids: ``[B, W]`` the batch's ids.
        labels: ``[B, W]`` its labels (``-100`` where none).

    Returns:
        ``[B, W, 2]`` ``int64`` offsets.
    """
    input_ids, labels = np.asarray(input_ids), np.asarray(labels)
    offsets = np.zeros((*input_ids.shape, 2), np.int64)
    for row in range(input_ids.shape[0]):
        cursor = 0
        for position in np.flatnonzero(labels[row] != -100):
            length = len(tokenizer.convert_ids_to_tokens([int(input_ids[row, position])])[0])
            offsets[row, position] = (cursor, cursor + length)
            cursor += length
    return offsets
