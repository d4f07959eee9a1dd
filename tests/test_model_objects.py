"""A trainer takes a ``transformers`` model object as TRL's do (TRL's ``orpo.py`` and ``cpo.py`` load the model with
transformers and pass it in): it trains the torchlike model of the same weights, dtype and ``name_or_path``, whose
tokenizer it loads when none is given."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import torchlike
from tests.helpers.scripts import build_script_model_dir
from tests.helpers.tokenizers import CHAT_TEMPLATE, tokenizer_for
from torchlike.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from torchlike.trl.experimental.cpo import CPOConfig, CPOTrainer
from torchlike.trl.experimental.orpo import ORPOConfig, ORPOTrainer
from torchlike.trl.registry import TRAINERS as REGISTRY

PAIRS = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
         {"prompt": "Grass is", "chosen": " green.", "rejected": " blue."}] * 2
PROMPTS = [{"prompt": "The sky is"}, {"prompt": "Grass is"}] * 2
UNPAIRED = [{"prompt": "The sky is", "completion": " blue.", "label": True},
            {"prompt": "Grass is", "completion": " blue.", "label": False}] * 2

TRIPLES = [{**pair, "reference": pair["chosen"] + " Always."} for pair in PAIRS]
MESSAGES = [{"messages": [{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": "blue."}]}] * 4


def _length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


#: Each registry trainer's data and the further arguments it needs (a teacher, a reward).
TRAINER_INPUTS = {"sft": ([{"prompt": "The sky is", "completion": " blue."}] * 4, {}),
                  "grpo": (PROMPTS, {"reward_funcs": _length_reward}),
                  "rloo": (PROMPTS, {"reward_funcs": _length_reward}),
                  "dpo": (PAIRS, {}), "kto": (UNPAIRED, {}), "bco": (UNPAIRED, {}),
                  "distillation": (PROMPTS, {"teacher_model": "model_dir"}),
                  "gkd": (MESSAGES, {"teacher_model": "model_dir"}),
                  "orpo": (PAIRS, {}), "cpo": (PAIRS, {}),
                  "online_dpo": (PROMPTS, {"reward_funcs": _length_reward}),
                  "xpo": (PROMPTS, {"reward_funcs": _length_reward}),
                  "nash_md": (PROMPTS, {"reward_funcs": _length_reward}),
                  "gmpo": (PROMPTS, {"reward_funcs": _length_reward}),
                  "async_grpo": (PROMPTS, {"reward_funcs": _length_reward}),
                  "tpo": (TRIPLES, {}),
                  "a2po": (PROMPTS, {"reward_funcs": _length_reward}),
                  "sdft": ([{**row, "privileged_context": "Think."} for row in PROMPTS], {}),
                  "sdpo": (PROMPTS, {"reward_funcs": _length_reward}),
                  "iw_opd": (MESSAGES, {"teacher_model": "model_dir"}),
                  "gold": (MESSAGES, {"teacher_model": "model_dir"})}
TRAINERS = {"SFT": (SFTTrainer, SFTConfig, [{"prompt": "The sky is", "completion": " blue."}] * 4),
            "DPO": (DPOTrainer, DPOConfig, PAIRS),
            "ORPO": (ORPOTrainer, ORPOConfig, PAIRS),
            "CPO": (CPOTrainer, CPOConfig, PAIRS)}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints, tokenizer_dir, tmp_path_factory):
    """A tiny checkpoint with its tokenizer, as a hub model folder holds them."""
    return build_script_model_dir(tiny_checkpoints.path("qwen2"), tokenizer_dir,
                                  tmp_path_factory.mktemp("model_objects") / "model")


@pytest.fixture(scope="module")
def loaded(model_dir):
    """The state dict torchlike loads from the folder."""
    return {key: np.asarray(value) for key, value in
            torchlike.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").state_dict().items()}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_a_transformers_model_object_is_the_model_its_folder_loads(name, model_dir, loaded, tmp_path):
    trainer_class, config_class, rows = TRAINERS[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = trainer_class(model=model, args=config_class(str(tmp_path), report_to="none"), train_dataset=rows)
    assert isinstance(trainer.model, torchlike.CausalLM)
    assert trainer.model.name_or_path == str(model_dir)
    assert trainer.processing_class.name_or_path == str(model_dir)  # the default tokenizer, from the model's folder
    state = trainer.model.state_dict()
    assert state.keys() == loaded.keys()
    for key, value in loaded.items():
        np.testing.assert_array_equal(np.asarray(state[key]), value, err_msg=key)


def test_every_causal_lm_trainer_takes_a_transformers_model_object(model_dir, loaded, tmp_path):
    """Every trainer of the registry but the reward trainer (a classifier) takes the object as the stable ones do."""
    assert set(TRAINER_INPUTS) == {entry.name for entry in REGISTRY} - {"reward"}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for entry in REGISTRY:
        if entry.name == "reward":
            continue
        rows, extra = TRAINER_INPUTS[entry.name]
        extra = {key: str(model_dir) if value == "model_dir" else value for key, value in extra.items()}
        trainer = entry.trainer_class()(model=model, args=entry.config_class()(str(tmp_path), report_to="none"),
                                        train_dataset=rows, processing_class=tokenizer_for(model_dir, CHAT_TEMPLATE),
                                        **extra)
        assert isinstance(trainer.model, torchlike.CausalLM), entry.name
        assert trainer.model.name_or_path == str(model_dir), entry.name
        np.testing.assert_array_equal(np.asarray(trainer.model.state_dict()["embedder.input_embedding"]),
                                      loaded["embedder.input_embedding"], err_msg=entry.name)


def test_the_reward_trainer_takes_a_transformers_classifier_object(model_dir, tmp_path):
    from torchlike.trl import RewardConfig, RewardTrainer

    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1,
                                                                                 dtype=torch.float32)
    trainer = RewardTrainer(model=classifier, args=RewardConfig(str(tmp_path), report_to="none"), train_dataset=PAIRS)
    assert isinstance(trainer.model, torchlike.SequenceClassifier)
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        expected = classifier(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(trainer.model(input_ids=ids).logits), expected, rtol=1e-5, atol=1e-6)


def test_the_objects_dtype_is_kept(model_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    trainer = ORPOTrainer(model=model, args=ORPOConfig(str(tmp_path), report_to="none"), train_dataset=PAIRS)
    assert {str(value.dtype) for value in trainer.model.state_dict().values()} == {"bfloat16"}


def test_an_object_that_is_no_model_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="ORPOTrainer's model must be a torchlike causal LM; got Linear"):
        ORPOTrainer(model=torch.nn.Linear(2, 2), args=ORPOConfig(str(tmp_path), report_to="none"),
                    train_dataset=PAIRS)


def test_quantization_of_an_object_is_refused(model_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="quantization_config only applies when the model is loaded from a path"):
        DPOTrainer(model=model, args=DPOConfig(str(tmp_path), report_to="none"), train_dataset=PAIRS,
                   quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True))




def test_create_reference_model_is_a_frozen_copy_a_trainer_takes_as_its_reference(model_dir, loaded, tmp_path):
    from torchlike.trl import create_reference_model

    model = torchlike.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    reference = create_reference_model(model)
    assert reference is not model and reference.num_parameters(only_trainable=True) == 0 and not reference.training
    assert reference.name_or_path == model.name_or_path
    # Changing the model's weights (as training does) leaves the copy's.
    model.load_state_dict({key: value + 1 for key, value in loaded.items()})
    for key, value in reference.state_dict().items():
        np.testing.assert_array_equal(np.asarray(value), loaded[key], err_msg=key)
    # As TRL scripts pass it: the reference columns are those of the model's initial weights.
    fresh = torchlike.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = DPOConfig(str(tmp_path), report_to="none")
    with_copy = DPOTrainer(model=fresh, ref_model=create_reference_model(fresh), args=args, train_dataset=PAIRS)
    without = DPOTrainer(model=str(model_dir), args=args, train_dataset=PAIRS)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        np.testing.assert_array_equal(with_copy.train_dataset[column], without.train_dataset[column])


def test_create_reference_model_refuses_shared_layers_and_adapters(model_dir):
    from torchlike.peft import LoraConfig, get_peft_model
    from torchlike.trl import create_reference_model

    model = torchlike.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    with pytest.raises(ValueError, match="num_shared_layers and pattern are not supported"):
        create_reference_model(model, num_shared_layers=1)
    with pytest.raises(ValueError, match="got a PeftModel"):
        create_reference_model(get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])))


def test_a_transformers_reference_model_scores_as_the_default_reference(model_dir, tmp_path):
    """TRL scripts may pass ``ref_model`` as a transformers model too: its reference columns are those of the initial
    weights, which the default reference scores."""
    args = DPOConfig(str(tmp_path), report_to="none")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    given = DPOTrainer(model=str(model_dir), ref_model=reference, args=args, train_dataset=PAIRS)
    assert isinstance(given.ref_model, torchlike.CausalLM)
    default = DPOTrainer(model=str(model_dir), args=args, train_dataset=PAIRS)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        np.testing.assert_array_equal(given.train_dataset[column], default.train_dataset[column])
    with pytest.raises(ValueError, match="`model` and `ref_model` cannot be the same object"):
        DPOTrainer(model=reference, ref_model=reference, args=args, train_dataset=PAIRS)
