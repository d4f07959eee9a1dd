"""The test cases: tiny random HF models by name (built with ``torchlike.testing``), a padded batch and padded
training examples, the tool-calling tokenizer, and the TRL comparisons: GRPO/RLOO trainers (torchlike's and TRL's)
given the same scripted completions, ORPO/CPO trainers on the same pairs."""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch
import transformers

from tests.helpers.logs import evaluated
from torchlike.testing import VOCAB_SIZE as VOCAB
from torchlike.testing import build_tokenizer as build_tokenizer  # the tests' tokenizer: tiny.build_tokenizer
from torchlike.testing import random_model, tiny_config

CACHE_ROOT = os.environ.get("TORCHLIKE_TEST_CACHE", os.path.join(tempfile.gettempdir(), "torchlike-test-cache"))

# gemma3: a window (8) shorter than padded_batch's rows (24), one layer of each type; gemma3_mha: Tunix fuses qkv.
# gemma2: a window of 4, both soft-caps binding, query_pre_attn_scalar != head_dim; gemma2_mha: Tunix fuses qkv.
# gemma4: a window of 8, full layers with their own head size and proportional rope; gemma4_moe: 4 experts, top 2,
# full layers whose keys are their values (one key head); gemma4_ple: per-layer inputs, one key head, and the last two
# layers sharing the keys and values of the first two, in a layer order Tunix's own sharing pattern gets wrong.
GEMMA4_PLE_LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
CASES = {
    "qwen2": lambda: tiny_config("qwen2"),
    "qwen2_tied": lambda: tiny_config("qwen2", tie_word_embeddings=True),
    "qwen3": lambda: tiny_config("qwen3"),
    "qwen3_tied": lambda: tiny_config("qwen3", rope_theta=1000000.0, tie_word_embeddings=True),
    "llama3": lambda: tiny_config("llama3"),
    "llama32": lambda: tiny_config("llama32"),
    "gemma3": lambda: tiny_config("gemma3"),
    "gemma3_mha": lambda: tiny_config("gemma3", num_key_value_heads=4),
    "gemma2": lambda: tiny_config("gemma2"),
    "gemma2_mha": lambda: tiny_config("gemma2", num_key_value_heads=4),
    "gemma4": lambda: tiny_config("gemma4"),
    "gemma4_moe": lambda: tiny_config("gemma4", enable_moe_block=True, num_experts=4, top_k_experts=2,
                                      moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1),
    "gemma4_ple": lambda: tiny_config("gemma4", num_hidden_layers=4, layer_types=list(GEMMA4_PLE_LAYER_TYPES),
                                      hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
                                      num_key_value_heads=1),
    "qwen3_moe": lambda: tiny_config("qwen3_moe"),
    # The families on the native decoder (see torchlike.testing for what each tiny config exercises).
    "mistral": lambda: tiny_config("mistral"),
    "ministral": lambda: tiny_config("ministral"),
    "phi3": lambda: tiny_config("phi3"),
    # Phi-3's LongRoPE: rows of 24 tokens pass original_max_position_embeddings (16), so the long factors apply.
    "phi3_longrope": lambda: tiny_config("phi3", sliding_window=None, tie_word_embeddings=False,
                                         original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16, "factor": 8.0,
        "short_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
        "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]}),
    "smollm3": lambda: tiny_config("smollm3"),
    "olmo2": lambda: tiny_config("olmo2"),
    "olmo3": lambda: tiny_config("olmo3"),
    "gpt_neox": lambda: tiny_config("gpt_neox"),
    "gpt_neox_sequential": lambda: tiny_config("gpt_neox", use_parallel_residual=False, attention_bias=False),
    "granite": lambda: tiny_config("granite"),
    "cohere2": lambda: tiny_config("cohere2"),
    "gpt_oss": lambda: tiny_config("gpt_oss"),
    "glm4_moe": lambda: tiny_config("glm4_moe"),
    "deepseek_v3": lambda: tiny_config("deepseek_v3"),
    # The hybrid decoders (gated DeltaNet and gated attention layers).
    "qwen3_next": lambda: tiny_config("qwen3_next"),
    "qwen3_5": lambda: tiny_config("qwen3_5"),
    "qwen3_5_moe": lambda: tiny_config("qwen3_5_moe"),
    "lfm2": lambda: tiny_config("lfm2"),
    "nemotron_h": lambda: tiny_config("nemotron_h"),
}
HYBRID_CASES = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "nemotron_h"]
"""The hybrid cases (recurrent layers beside attention), on the native decoder."""
NATIVE_CASES = ["mistral", "ministral", "phi3", "phi3_longrope", "smollm3", "olmo2", "olmo3", "gpt_neox",
                "gpt_neox_sequential", "granite", "cohere2", "gpt_oss", "glm4_moe", "deepseek_v3"]
"""The cases on torchlike's native decoder."""


def build_hf_model(config, seed: int = 0, dtype=torch.float32) -> transformers.PreTrainedModel:
    """The reference model of a case: every parameter random (biases and norms too), eager attention."""
    return random_model(config, seed=seed, dtype=dtype, every_parameter=True, attn_implementation="eager")


class CheckpointFactory:
    """Builds and saves each case once per session."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._built: dict[str, Path] = {}

    def path(self, case: str, dtype=torch.float32, **save_kwargs) -> Path:
        options = "".join(f"-{k}{v}" for k, v in sorted(save_kwargs.items()))
        key = f"{case}-{str(dtype).removeprefix('torch.')}{options}"
        if key not in self._built:
            model = build_hf_model(CASES[case](), dtype=dtype)
            model.save_pretrained(self.root / key, **save_kwargs)
            self._built[key] = self.root / key
        return self._built[key]


def wandering_model(case: str, path: Path):
    """A tiny ``case`` model whose weights (all but the norms) are scaled up (std 0.16) so greedy and sampled decoding
    wander instead of repeating one token, saved to ``path``: ``(transformers model, torchlike model)``, both
    float32."""
    import torchlike

    reference = build_hf_model(CASES[case](), seed=0)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" not in name:
                parameter.mul_(2.0)
    reference.save_pretrained(path)
    return reference, torchlike.AutoModelForCausalLM.from_pretrained(path, dtype="float32")


def wandering_qwen2(path: Path):
    """:func:`wandering_model` of Qwen2 with no default end token (so rows run to ``max_new_tokens`` unless a test
    passes one)."""
    reference, model = wandering_model("qwen2", path)
    reference.generation_config.eos_token_id = model.generation_config.eos_token_id = None
    return reference, model


def padded_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three rows of unequal length: right-padded, left-padded, full. Returns (ids, mask, position_ids)."""
    rng = np.random.default_rng(0)
    length = 24
    ids = rng.integers(3, VOCAB, size=(3, length))
    mask = np.ones((3, length), dtype=np.int64)
    mask[0, 15:] = 0  # right padding
    mask[1, :9] = 0  # left padding
    ids[mask == 0] = 0
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    return ids, mask, positions


def hf_logits(model, ids, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


#: A small Qwen-style chat template for tool calling: Qwen 2.5's tool-call and tool-response layout, the tools listed
#: on one system line (so prompts stay short), prefix-preserving.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- if call.function is defined %}{%- set call = call.function %}"
    "{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

def build_tool_tokenizer(path: Path, corpus: list[str]) -> Path:
    """The tests' byte-level BPE (trained on ``corpus``, 320 tokens, any text encodable) with ChatML specials,
    ``<|im_end|>`` as EOS, the tool-call and tool-response tags as tokens and :data:`TOOL_CHAT_TEMPLATE`, saved to
    ``path``."""
    build_tokenizer(path, corpus=corpus, vocab_size=320, any_text=True, pad_token="<pad>")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def load_tool_tokenizer(path: Path, for_trl: bool = False):
    """A tokenizer :func:`build_tool_tokenizer` saved; TRL's copy gets TRL's Qwen 3 response parser (the new-style
    ``response_template`` where transformers has it, from 5.13; the legacy ``response_schema`` before), which TRL sets
    itself only for the chat templates it knows by heart."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if for_trl:
        from trl.chat_template_utils import _SUPPORTS_RESPONSE_TEMPLATE, qwen3_schema

        if _SUPPORTS_RESPONSE_TEMPLATE:
            from trl.chat_template_utils import qwen3_template

            tokenizer.response_template = qwen3_template
        else:
            tokenizer.response_schema = qwen3_schema
    return tokenizer


EXAMPLE_LENGTH = 24


def padded_examples(count: int, seed: int = 0, full: bool = False) -> list[dict]:
    """Examples of unequal lengths, right-padded to EXAMPLE_LENGTH, loss on every real token."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(count):
        size = EXAMPLE_LENGTH if full else int(rng.integers(6, EXAMPLE_LENGTH + 1))
        ids = np.zeros(EXAMPLE_LENGTH, np.int32)
        ids[:size] = rng.integers(3, VOCAB, size)
        mask = (np.arange(EXAMPLE_LENGTH) < size).astype(np.int32)
        examples.append({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.copy()})
    return examples


# --- GRPO on scripted completions: torchlike's and TRL's GRPOTrainer given the same completions --------------------

PROMPTS = ["the quick brown", "one two three", "hello world", "lazy dog", "four five", "tiny test", "seven eight",
           "the fox", "nine ten", "over the", "jumps over", "brown fox", "a tiny", "for tests", "this is", "world"]
EVAL_PROMPTS = ["the quick brown", "lazy dog", "tiny test", "brown fox"]
COMPLETION_LENGTH = 8
EOS = 2


def scripted_rollout(prompts, trainer):
    """TRL's ``rollout_func``: a fixed completion per (prompt, index in its group) of varying length, some ending
    with EOS, some cut at ``max_completion_length``, some stopping without EOS."""
    tokenizer = trainer.processing_class
    generations = trainer.args.num_generations
    prompt_ids, completion_ids = [], []
    for index, prompt in enumerate(prompts):
        rng = np.random.default_rng([zlib.crc32(prompt.encode()), index % generations])
        length = int(rng.integers(2, COMPLETION_LENGTH + 1))
        ids = rng.integers(3, VOCAB, size=length).tolist()
        if rng.random() < 0.5 and length < COMPLETION_LENGTH:
            ids[-1] = EOS
        prompt_ids.append(tokenizer(prompt)["input_ids"])
        completion_ids.append(ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids]}


def token_reward(completion_ids, **kwargs):
    return [float((sum(ids) * 7919) % 13) / 13 for ids in completion_ids]


def length_reward(completion_ids, **kwargs):
    return [len(ids) / COMPLETION_LENGTH for ids in completion_ids]


def grpo_settings(**case) -> dict:
    """GRPO config values for the scripted comparisons, with ``case`` over them."""
    # bf16 off: the comparison is in float32 on both sides. A learning rate large enough that the policy moves
    # within a generation batch (so old log-probs matter), and an Adam epsilon above float noise, so entries whose
    # gradient is ~0 do not take lr-sized steps of either sign.
    values = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=COMPLETION_LENGTH,
                  max_steps=3, learning_rate=1e-2, adam_epsilon=1e-4, weight_decay=0.01, max_grad_norm=0.5,
                  logging_steps=1, seed=0, report_to="none", save_strategy="no", bf16=False, shuffle_dataset=False,
                  reward_weights=[1.0, 0.5])
    values.update(case)
    return values


#: The GRPO-loop trainers the scripted comparisons build: name -> (TRL's module, torchlike's module, class prefix).
GRPO_LOOP_TRAINERS = {"grpo": ("trl", "torchlike.trl", "GRPO"),
                      "gmpo": ("trl.experimental.gmpo", "torchlike.trl.experimental.gmpo", "GMPO")}


def trl_grpo_trainer(path, tokenizer_path, output_dir, monkeypatch, eval_prompts: list[str] | None = None,
                     algorithm: str = "grpo", **case):
    """The real ``trl.GRPOTrainer`` (or another trainer of :data:`GRPO_LOOP_TRAINERS`) of ``path`` (float32) on
    :data:`PROMPTS` (and ``eval_prompts`` to evaluate) with :func:`scripted_rollout`, the rows of each generation batch
    kept in order, configured by :func:`grpo_settings` (``case`` over them)."""
    import importlib

    import datasets
    import trl.trainer.grpo_trainer as trl_grpo

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    module_name, _, prefix = GRPO_LOOP_TRAINERS[algorithm]
    module = importlib.import_module(module_name)
    return getattr(module, f"{prefix}Trainer")(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=[token_reward, length_reward],
        args=getattr(module, f"{prefix}Config")(output_dir=str(output_dir), use_cpu=True, **grpo_settings(**case)),
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=None if eval_prompts is None else datasets.Dataset.from_dict({"prompt": eval_prompts}),
        processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_path),
        rollout_func=scripted_rollout)


def torchlike_grpo_trainer(path, tokenizer_path, output_dir, eval_prompts: list[str] | None = None,
                           algorithm: str = "grpo", **case):
    """torchlike's ``GRPOTrainer`` (or ``algorithm``'s trainer) set up as :func:`trl_grpo_trainer` (rows in order:
    ``_shuffled`` is the identity)."""
    import importlib

    import torchlike

    _, module_name, prefix = GRPO_LOOP_TRAINERS[algorithm]
    module = importlib.import_module(module_name)
    trainer = getattr(module, f"{prefix}Trainer")(
        model=str(path), reward_funcs=[token_reward, length_reward],
        args=getattr(module, f"{prefix}Config")(output_dir=str(output_dir), **grpo_settings(**case)),
        train_dataset=[{"prompt": p} for p in PROMPTS],
        eval_dataset=None if eval_prompts is None else [{"prompt": p} for p in eval_prompts],
        processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_path), rollout_func=scripted_rollout)
    trainer._shuffled = lambda batch, seed: batch
    return trainer


def train_trl_recording_advantages(trainer, output_dir: Path) -> tuple[list[dict], list[np.ndarray], dict]:
    """Train a real TRL online trainer (GRPO, RLOO): its log history, each generation batch's advantages and its final
    parameters (:func:`saved_hf_params`)."""
    advantages = []
    score = trainer._generate_and_score_completions

    def recording(inputs):
        output = score(inputs)
        advantages.append(output["advantages"].numpy().copy())
        return output

    trainer._generate_and_score_completions = recording
    trainer.train()
    return trainer.state.log_history, advantages, saved_hf_params(trainer.model, Path(output_dir) / "model")


def train_torchlike_recording_advantages(trainer, output_dir: Path) -> tuple[list[dict], list[np.ndarray], dict]:
    """torchlike's counterpart of :func:`train_trl_recording_advantages`, the rows of each generation batch kept in
    order: its log history, advantages and final parameters as exported."""
    from safetensors.numpy import load_file

    advantages = []

    def in_order(batch, seed):
        advantages.append(batch["advantages"].copy())
        return batch

    trainer._shuffled = in_order
    trainer.train()
    trainer.model.save_pretrained(Path(output_dir) / "model")
    return trainer.state.log_history, advantages, load_file(Path(output_dir) / "model" / "model.safetensors")


def saved_hf_params(model, folder) -> dict:
    """A ``transformers`` model's parameters as ``save_pretrained`` writes them (numpy, the checkpoint's names: a
    mixture-of-experts model's experts one by one, as torchlike exports them, not fused as in its state dict)."""
    from safetensors.numpy import load_file

    model.save_pretrained(folder)
    params = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        params.update(load_file(file))
    return params


# --- TRL's experimental pairwise trainers (ORPO, CPO): the real one and torchlike's on the same data ---------------

def run_trl_pairwise(trainer_class, config_class, path, tokenizer_path, output_dir, data: list[dict],
                     settings: dict, eval_data: list[dict] | None = None) -> tuple[list[dict], dict, dict]:
    """A real ``trl.experimental`` pairwise trainer (``ORPOTrainer``, ``CPOTrainer``) of ``path`` (float32) on
    ``data`` in order, the tokenizer padding with ``<pad>``: its log history, final parameters (HF names) and, with
    ``eval_data``, ``evaluate()``'s metrics on it after training (:func:`evaluated`)."""
    import datasets
    import transformers
    from torch.utils.data import SequentialSampler

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.pad_token = "<pad>"
    trainer = trainer_class(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                            args=config_class(output_dir=str(output_dir), use_cpu=True, **settings),
                            train_dataset=datasets.Dataset.from_list(data), processing_class=tokenizer,
                            eval_dataset=None if eval_data is None else datasets.Dataset.from_list(eval_data))
    trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(trainer.train_dataset)
    trainer.train()
    metrics = {} if eval_data is None else evaluated(trainer)
    return trainer.state.log_history, saved_hf_params(trainer.model, Path(output_dir) / "model"), metrics


def run_torchlike_pairwise(trainer_class, config_class, path, tokenizer_path, output_dir, data: list[dict],
                           settings: dict, eval_data: list[dict] | None = None) -> tuple[list[dict], dict, dict]:
    """torchlike's counterpart of :func:`run_trl_pairwise`: its log history and final parameters as exported."""
    from safetensors.numpy import load_file

    import torchlike

    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.pad_token = "<pad>"
    trainer = trainer_class(model=str(path), args=config_class(output_dir=str(output_dir),
                                                               train_sampling_strategy="sequential", **settings),
                            train_dataset=data, processing_class=tokenizer, eval_dataset=eval_data)
    trainer.train()
    metrics = {} if eval_data is None else evaluated(trainer)
    trainer.model.save_pretrained(Path(output_dir) / "model")
    return trainer.state.log_history, load_file(Path(output_dir) / "model" / "model.safetensors"), metrics


def assert_pairwise_trainer_matches_trl(trl_classes: tuple, torchlike_classes: tuple, path, tokenizer_path,
                                        output_dir: Path, data: list[dict], settings: dict, eval_data: list[dict],
                                        metrics: tuple[str, ...]) -> None:
    """A pairwise trainer (``(trainer class, config class)`` of TRL's and of torchlike's) trained on ``data`` by both
    and evaluated on ``eval_data``: the same logs (:func:`compare_pairwise_logs` of ``metrics``), final parameters
    (rtol 1e-4) and evaluation metrics."""
    theirs, their_params, their_eval = run_trl_pairwise(*trl_classes, path, tokenizer_path, Path(output_dir) / "trl",
                                                        data, settings, eval_data)
    ours, params, our_eval = run_torchlike_pairwise(*torchlike_classes, path, tokenizer_path,
                                                    Path(output_dir) / "ours", data, settings, eval_data)
    compare_pairwise_logs(ours, theirs, metrics, settings["max_grad_norm"])
    assert set(params) == set(their_params)
    for name, value in their_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=5e-6, err_msg=name)
    assert set(our_eval) == set(their_eval)
    for key, value in their_eval.items():
        np.testing.assert_allclose(our_eval[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


def compare_pairwise_logs(ours: list[dict], theirs: list[dict], keys: tuple[str, ...], max_grad_norm: float) -> None:
    """Four steps of training logs equal to TRL's at rtol 1e-4 (the same metric names), clipping on in every step."""
    expected = {entry["step"]: entry for entry in theirs if "loss" in entry}
    found = {entry["step"]: entry for entry in ours if "loss" in entry}
    assert list(found) == list(expected) == [1, 2, 3, 4]
    assert all(entry["grad_norm"] > max_grad_norm for entry in expected.values())
    assert all(set(found[step]) == set(expected[step]) for step in found)
    for key in keys:
        np.testing.assert_allclose([found[step][key] for step in found], [expected[step][key] for step in expected],
                                   rtol=1e-4, atol=1e-6, err_msg=key)
    # Steps 1 and 2 score the initial weights (warmup starts at lr 0): chosen > rejected may be decided by noise.
    assert [found[step]["rewards/accuracies"] for step in (3, 4)] == \
        [expected[step]["rewards/accuracies"] for step in (3, 4)]


#: Every linear module of a native case, named as PEFT names them (a fused projection is one module), where they are
#: not the Llama names.
_NATIVE_LORA_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                        "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
                        "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"],
                        "glm4_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
                        "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
                        # Qwen3-Next's MLP names reach its fused experts in PEFT (qwen2_moe's conversion).
                        "qwen3_next": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba",
                                       "out_proj"],
                        "qwen3_5": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
                        # Qwen3.5-MoE's MLP names reach the shared expert only (PEFT converts no experts for it).
                        "qwen3_5_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                                        "shared_expert_gate"],
                        "lfm2": ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"],
                        # PEFT refuses LoRA on Nemotron-H's Mamba-2 out_proj (and conv1d).
                        "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj"]}
LLAMA_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_targets(case: str) -> list[str]:
    """The LoRA ``target_modules`` adapting every linear module of a case that LoRA adapts as PEFT does (GPT-OSS's
    experts and router are not linear modules; DeepSeek-V3's and GLM-4 MoE's MLP names reach their routed experts in
    PEFT, so only their attention is adapted)."""
    family = case.removesuffix("_longrope").removesuffix("_sequential")
    return list(_NATIVE_LORA_TARGETS.get(family, LLAMA_LORA_TARGETS))
