"""AutoModelForSequenceClassification: transformers' *ForSequenceClassification checkpoints in and out, last-non-pad
pooling, and LoRA with task_type="SEQ_CLS" exported in PEFT's layout."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from tests.helpers.models import hf_classifier
from torchlike import AutoModelForSequenceClassification, SequenceClassifier
from torchlike.adapters.checkpoint.safetensors_io import SafetensorsReader
from torchlike.adapters.model.nnx_state import flat_variables
from torchlike.adapters.model.sequence_classification import last_non_pad_indices
from torchlike.peft import LoraConfig, PeftModel, get_peft_model

TOLERANCE = 1e-4


def hf_scores(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' scores as a user calls the model: no position_ids."""
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


@pytest.fixture(scope="module")
def qwen2_classifier_dir(tmp_path_factory):
    """A saved transformers Qwen2ForSequenceClassification with one label (a reward model)."""
    folder = tmp_path_factory.mktemp("qwen2-reward")
    hf_classifier("qwen2", num_labels=1).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family, num_labels", [("qwen2", 1), ("qwen2", 3), ("qwen3", 2), ("llama3", 2),
                                                ("gemma2", 2), ("gemma3", 2), ("qwen3_moe", 2), ("mistral", 2),
                                                ("ministral", 2), ("phi3", 2), ("smollm3", 2), ("olmo3", 2),
                                                ("gpt_neox", 2), ("gpt_oss", 2), ("deepseek_v3", 2),
                                                ("qwen3_next", 2), ("qwen3_5", 2)])
def test_transformers_classifier_loads_with_the_same_scores(tmp_path, padded_batch, family, num_labels):
    ids, mask, _ = padded_batch  # a right-padded, a left-padded and a full row
    reference = hf_classifier(family, num_labels)
    reference.save_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype="float32")
    scores = model(ids, mask).logits
    assert isinstance(model, SequenceClassifier) and model.num_labels == num_labels
    assert scores.shape == (3, num_labels) and scores.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(scores), hf_scores(reference, ids, mask), atol=TOLERANCE, rtol=0)


def test_pooling_takes_the_rightmost_non_pad_token_as_transformers():
    ids = jnp.array([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [5, 0, 6, 0, 0], [0, 0, 0, 0, 0]])
    assert last_non_pad_indices(ids, pad_token_id=0).tolist() == [2, 4, 2, 0]
    assert last_non_pad_indices(ids[:1], pad_token_id=None).tolist() == [4]
    with pytest.raises(ValueError, match="Cannot handle batch sizes > 1 if no padding token is defined"):
        last_non_pad_indices(ids, pad_token_id=None)


def test_scores_function_runs_inside_jit(qwen2_classifier_dir, padded_batch):
    ids, mask, _ = padded_batch
    model = AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir)
    scores = nnx.jit(model.scores_function)(model.module, jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(model(ids, mask).logits), atol=1e-6, rtol=0)


def test_transformers_state_dict_loads_through_load_state_dict(qwen2_classifier_dir, padded_batch):
    ids, mask, _ = padded_batch
    model = AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir)
    other = hf_classifier("qwen2", num_labels=1, seed=1)
    result = model.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    np.testing.assert_allclose(np.asarray(model(ids, mask).logits), hf_scores(other, ids, mask), atol=TOLERANCE,
                               rtol=0)


@pytest.fixture(scope="module")
def classifier_from_causal_lm(tiny_checkpoints):
    """A qwen2 causal-LM checkpoint loaded as a two-label classifier, with the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForSequenceClassification.from_pretrained(tiny_checkpoints.path("qwen2"), num_labels=2)
    return model, [str(warning.message) for warning in caught]


def test_causal_lm_checkpoint_gets_a_new_score_head_and_a_warning_naming_it(classifier_from_causal_lm):
    model, messages = classifier_from_causal_lm
    assert any("newly initialized: ['score.weight']" in message for message in messages), messages
    assert any("not used" in message and "lm_head.weight" in message for message in messages), messages
    kernel = np.asarray(model.get_parameter("score.kernel"))
    assert kernel.shape == (64, 2)
    assert 0.01 < kernel.std() < 0.03  # normal(0, initializer_range=0.02), as transformers initialises a Linear


def test_exported_classifier_loads_in_transformers_with_the_same_scores(classifier_from_causal_lm, tmp_path,
                                                                        padded_batch):
    ids, mask, _ = padded_batch
    model, _ = classifier_from_causal_lm
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    assert not (tmp_path / "generation_config.json").exists()
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(reference).__name__ == "Qwen2ForSequenceClassification" and reference.config.num_labels == 2
    np.testing.assert_allclose(np.asarray(model(ids, mask).logits), hf_scores(reference, ids, mask), atol=TOLERANCE,
                               rtol=0)


def test_save_pretrained_round_trip_is_bit_exact(classifier_from_causal_lm, tmp_path):
    model, _ = classifier_from_causal_lm
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    before, after = model.state_dict(), reloaded.state_dict()
    assert sorted(before) == sorted(after)
    for name in before:
        np.testing.assert_array_equal(np.asarray(after[name]), np.asarray(before[name]), err_msg=name)


def _peft_reference_adapter(base: transformers.PreTrainedModel, folder) -> dict[str, tuple[int, ...]]:
    """What peft itself saves for a SEQ_CLS LoRA on ``base``: adapter key -> shape."""
    import peft

    peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])) \
        .save_pretrained(folder)
    with SafetensorsReader(folder / "adapter_model.safetensors") as reader:
        return {name: tuple(reader.get(name).shape) for name in reader.keys()}


def test_seq_cls_lora_trains_the_score_head_and_exports_in_peft_layout(qwen2_classifier_dir, tmp_path, padded_batch):
    import peft

    ids, mask, _ = padded_batch
    model = AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir)
    config = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(model, config)
    assert config.modules_to_save == ["classifier", "score"]
    trainable = sorted(flat_variables(peft_model.module, peft_model.trainable_filter))
    assert trainable == sorted([f"layers.{layer}.attn.{proj}.w_lora_{factor}" for layer in (0, 1)
                                for proj in ("q_proj", "v_proj") for factor in "ab"] + ["score.kernel"])
    assert peft_model.get_nb_trainable_parameters()[0] == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 4 * 32) + 64

    rng = np.random.default_rng(0)  # as if trained: LoRA B and the head away from their starting values
    for variable in flat_variables(peft_model.module, peft_model.trainable_filter).values():
        value = variable.get_value()
        variable.set_value(jnp.asarray(rng.normal(0.0, 0.1, value.shape), value.dtype))
    scores = np.asarray(peft_model(ids, mask).logits)
    peft_model.save_pretrained(tmp_path / "ours")

    with SafetensorsReader(tmp_path / "ours" / "adapter_model.safetensors") as reader:
        saved = {name: tuple(reader.get(name).shape) for name in reader.keys()}
    base = transformers.AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir,
                                                                          attn_implementation="eager")
    assert saved == _peft_reference_adapter(base, tmp_path / "peft")
    assert "base_model.model.score.weight" in saved
    saved_config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert (saved_config["task_type"], saved_config["modules_to_save"]) == ("SEQ_CLS", ["classifier", "score"])

    base = transformers.AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir,
                                                                          attn_implementation="eager")
    reference = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    np.testing.assert_allclose(scores, hf_scores(reference, ids, mask), atol=TOLERANCE, rtol=0)

    reloaded = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir),
                                         tmp_path / "ours")
    np.testing.assert_array_equal(np.asarray(reloaded(ids, mask).logits), scores)


def test_seq_cls_lora_gradients_reach_the_score_head_inside_jit(qwen2_classifier_dir, padded_batch):
    ids, mask, _ = padded_batch
    model = AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir)
    peft_model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"]))
    scores = peft_model.scores_function

    @nnx.jit
    def gradients(module, input_ids, attention_mask):
        loss = lambda module: scores(module, input_ids, attention_mask).sum()  # noqa: E731
        return nnx.grad(loss, argnums=nnx.DiffState(0, peft_model.trainable_filter))(module)

    grads = {name: np.asarray(variable.get_value())
             for name, variable in flat_variables(gradients(peft_model.module, jnp.asarray(ids), jnp.asarray(mask)),
                                                  ...).items()}
    assert np.abs(grads["score.kernel"]).sum() > 0
    assert np.abs(grads["layers.0.attn.q_proj.w_lora_b"]).sum() > 0  # B starts at zero; its gradient does not
    assert not any("embed" in name or name.endswith("mlp.up_proj.kernel") for name in grads)


def test_seq_cls_lora_is_refused_on_a_causal_lm(tiny_checkpoints):
    from torchlike import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints.path("qwen2"))
    with pytest.raises(ValueError, match="AutoModelForSequenceClassification"):
        get_peft_model(model, LoraConfig(task_type="SEQ_CLS"))


def test_classifier_cannot_generate(qwen2_classifier_dir):
    model = AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir)
    with pytest.raises(TypeError, match="cannot generate"):
        model.generate([[1, 2, 3]])


def test_no_pad_token_pools_the_last_token_of_a_single_row(tmp_path):
    reference = hf_classifier("qwen2", num_labels=1)
    reference.config.pad_token_id = None
    reference.save_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    ids = np.array([[5, 9, 0, 0, 7, 0]])  # 0 is an ordinary token here
    np.testing.assert_allclose(np.asarray(model(ids).logits), hf_scores(reference, ids, np.ones_like(ids)),
                               atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="no padding token"):
        model(np.repeat(ids, 2, axis=0))



def test_a_head_of_another_num_labels_is_refused_unless_ignore_mismatched_sizes(qwen2_classifier_dir):
    with pytest.raises(ValueError, match="ignore_mismatched_sizes=True"):
        AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir, num_labels=3)
    with pytest.warns(UserWarning, match=r"shapes did not match: score.weight: found shape \(1, 64\)"):
        model = AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir, num_labels=3,
                                                                   ignore_mismatched_sizes=True)
    assert model.get_parameter("score.kernel").shape == (64, 3)


def test_a_classifier_gives_no_token_logits(qwen2_classifier_dir):
    model = AutoModelForSequenceClassification.from_pretrained(qwen2_classifier_dir)
    with pytest.raises(TypeError, match="no language-model head"):
        model.family.forward(model.module, None, None, None)


def test_a_family_transformers_has_no_classifier_for_is_refused_naming_it(tiny_checkpoints):
    with pytest.raises(ValueError, match=r"gemma4 has no sequence-classification model in transformers"):
        AutoModelForSequenceClassification.from_pretrained(tiny_checkpoints.path("gemma4"))
