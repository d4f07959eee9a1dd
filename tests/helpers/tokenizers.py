"""The tests' tokenizer as a trainer's ``processing_class`` (torchlike's ``AutoTokenizer`` of the tokenizer the
``tokenizer_dir`` fixture saves), and the small chat template the preference and reward tests give it."""

from __future__ import annotations

from pathlib import Path

import transformers

import torchlike

#: A small chat template: each message as ``<s>role: content</s>``, the generation prompt ``<s>assistant:``.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
#: A chat template whose turns end with EOS and that has no BOS (``chat_tokenizer_dir``'s: GKD's and IW-OPD's tests).
TURN_EOS_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '</s>' }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


def tokenizer_for(tokenizer_dir: Path | str,
                  chat_template: str | None = None) -> transformers.PreTrainedTokenizerBase:
    """torchlike's tokenizer saved in ``tokenizer_dir``, with ``chat_template`` set when given."""
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
