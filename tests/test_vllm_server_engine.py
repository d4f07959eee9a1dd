"""``use_vllm=True``: with ``vllm_mode="server"`` GRPO samples through a vLLM server's OpenAI API (here a local
stand-in, ``tests/helpers/vllm_test_server.py``, generating with ``transformers`` and ``peft``), the policy's LoRA
adapter loaded into it after each optimizer step; full fine-tuning and an unreachable server are refused in words;
with ``vllm_mode="colocate"`` a warning says that torchlike's own JAX engine samples."""

from __future__ import annotations

import socket
import warnings

import jax
import numpy as np
import pytest
import transformers

import torchlike
from tests.helpers.data import PROMPT_ROWS, length_reward
from tests.helpers.vllm_test_server import VLLMTestServer
from torchlike.adapters.rollout import RolloutRequest
from torchlike.adapters.rollout.sampling_settings import SamplingSettings
from torchlike.adapters.rollout.vllm_server import VLLMServerError
from torchlike.peft import LoraConfig, PeftModel
from torchlike.trl import GRPOConfig, GRPOTrainer
from torchlike.trl.online.vllm_mode import vllm_engine_settings

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _config(tmp_path, **kwargs) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=2, max_completion_length=6,
                      num_generations=4, per_device_train_batch_size=4, temperature=1.0, top_k=0,
                      learning_rate=5e-2, logging_steps=1, **kwargs)


def _trainer(checkpoint, tokenizer_dir, args, **kwargs) -> GRPOTrainer:
    return GRPOTrainer(model=str(checkpoint), reward_funcs=length_reward, args=args, train_dataset=PROMPT_ROWS,
                       processing_class=torchlike.AutoTokenizer.from_pretrained(tokenizer_dir), **kwargs)


class AdapterAfterStep(transformers.TrainerCallback):
    """Saves the policy's adapter (PEFT's layout) after optimizer step ``step``."""

    def __init__(self, step: int, folder):
        self.step, self.folder, self.trainer = step, folder, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.trainer.model.save_pretrained(self.folder)


def _logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """``log_softmax(logits)`` of each completion token after the prompt, from torchlike's forward pass."""
    logits = np.asarray(model(np.array([prompt + completion])).logits[0], np.float64)
    logits = logits[len(prompt) - 1:-1]
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return logprobs[np.arange(len(completion)), completion]


def test_grpo_in_server_mode_samples_each_round_with_the_adapter_of_the_last_step(tiny_checkpoints, tokenizer_dir,
                                                                                    tmp_path):
    checkpoint = tiny_checkpoints.path("qwen2")
    after_step_1 = AdapterAfterStep(1, tmp_path / "adapter-after-step-1")
    with VLLMTestServer(checkpoint) as server:
        args = _config(tmp_path / "run", use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
                       vllm_server_timeout=10.0)
        trainer = _trainer(checkpoint, tokenizer_dir, args, peft_config=LoraConfig(**LORA), callbacks=[after_step_1])
        after_step_1.trainer = trainer
        trainer.train()
        loaded = [body["lora_name"] for path, body in server.requests if path == "/v1/load_lora_adapter"]
        first, second = server.completions("/v1/completions")
        # One adapter per weights version, the round after step 1 sampling the one saved after it.
        assert [name.rsplit("-", 1)[1] for name in loaded] == ["v0", "v1"]
        assert (first["model"], second["model"]) == tuple(loaded)
        assert [path for path, _ in server.requests].count("/v1/unload_lora_adapter") == 1  # v0, once v1 is in
        assert second["n"] == 4 and second["top_k"] == -1 and second["logprobs"] == 0

        # The server's greedy tokens with the synced adapter are torchlike's greedy tokens with it.
        prompt = second["prompt"]
        [greedy] = trainer.rollout_engine.generate([RolloutRequest(prompt, 6)], SamplingSettings(do_sample=False))
        torchlike_model = PeftModel.from_pretrained(torchlike.AutoModelForCausalLM.from_pretrained(checkpoint),
                                                    after_step_1.folder)
        ours = torchlike_model.generate(np.array([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
        np.testing.assert_array_equal(greedy.token_ids[0], np.asarray(ours)[:len(greedy.token_ids[0])])
        trainer.rollout_engine.close()
        assert [path for path, _ in server.requests].count("/v1/unload_lora_adapter") == 2

    # The second round's completions are the adapter's: the server's log-probs of them are torchlike's model after
    # step 1 (not the base model's).
    base = torchlike.AutoModelForCausalLM.from_pretrained(checkpoint)
    for choice in server.answers[1]["choices"]:
        theirs = np.array(choice["logprobs"]["token_logprobs"])
        np.testing.assert_allclose(theirs, _logprobs(torchlike_model, prompt, choice["token_ids"]), atol=2e-4)
        assert not np.allclose(theirs, _logprobs(base, prompt, choice["token_ids"]), atol=2e-4)
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logged) == 2 and all(np.isfinite(log["loss"]) for log in logged)


def test_server_mode_refuses_full_fine_tuning_in_words(tiny_checkpoints, tokenizer_dir, tmp_path):
    args = _config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:9")
    trainer = _trainer(tiny_checkpoints.path("qwen2"), tokenizer_dir, args)
    with pytest.raises(ValueError, match=r"syncs the policy into the vLLM server as a LoRA adapter.*"
                                         r"peft_config=LoraConfig.*use_vllm=False"):
        _ = trainer.rollout_engine


def test_an_unreachable_server_is_named_with_how_to_start_one(tiny_checkpoints, tokenizer_dir, tmp_path):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}"
    args = _config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=0.5)
    trainer = _trainer(tiny_checkpoints.path("qwen2"), tokenizer_dir, args, peft_config=LoraConfig(**LORA))
    with pytest.raises(VLLMServerError, match=rf"No vLLM server answered at {url}/health within "
                                              r"vllm_server_timeout=0.5 s.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                                              r"vllm serve <model> --enable-lora"):
        _ = trainer.rollout_engine


def test_use_vllm_on_the_training_mesh_warns_that_torchlikes_jax_engine_samples(tiny_checkpoints, tokenizer_dir,
                                                                               tmp_path):
    with pytest.warns(UserWarning) as caught:
        trainer = _trainer(tiny_checkpoints.path("qwen2"), tokenizer_dir, _config(tmp_path, use_vllm=True))
    [message] = [str(item.message) for item in caught if "use_vllm" in str(item.message)]
    assert message.startswith("use_vllm=True with vllm_mode='colocate': completions are sampled by torchlike's own "
                              "JAX rollout engine (rollout_engine: by default the backend's, on the CPU 'paged'")
    assert "vLLM is a CUDA/PyTorch engine and cannot run inside a JAX process" in message
    assert "on a TPU host the Tunix vLLM sampler path is not wired into torchlike yet" in message
    assert type(trainer.rollout_engine).__name__ == "PagedEngine"
    assert jax.default_backend() == "cpu"


def test_server_mode_and_use_vllm_false_do_not_warn(tiny_checkpoints, tokenizer_dir, tmp_path):
    for kwargs in ({"use_vllm": True, "vllm_mode": "server"}, {"use_vllm": False}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer(tiny_checkpoints.path("qwen2"), tokenizer_dir, _config(tmp_path, **kwargs),
                     peft_config=LoraConfig(**LORA))
        assert [str(item.message) for item in caught if "vllm" in str(item.message).lower()] == []


def test_server_mode_sampling_ahead_at_another_temperature_is_refused_in_words(tmp_path):
    # The sampler correction would read the server's log-probs, which vLLM gives before temperature.
    args = _config(tmp_path, use_vllm=True, vllm_mode="server", max_staleness=1)
    assert vllm_engine_settings(args)["engine"] == "vllm_server"  # at temperature 1, TRL's default
    args = _config(tmp_path, use_vllm=True, vllm_mode="server", max_staleness=1)
    args.temperature = 0.7
    with pytest.raises(ValueError, match=r"before temperature.*temperature=1.0 \(TRL's default\) or max_staleness=0"):
        vllm_engine_settings(args)
