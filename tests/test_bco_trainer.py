"""torchlike.trl.experimental.bco: TRL 1.0.0's BCO trainer step for step against the real
``trl.experimental.bco.BCOTrainer`` (TRL 1.0.0, run in a child process: TRL 1.16 no longer ships it), with and without
underlying distribution matching, its checkpointed running reward mean, and TRL 1.0.0's config fields and errors."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import torchlike
from tests.helpers.bco import DATA, EVAL_DATA, prompt_features
from tests.helpers.legacy_trl import require_legacy_trl, run_legacy_trl
from tests.helpers.logs import evaluated, logged
from tests.helpers.models import with_config
from torchlike.field_support import field_table
from torchlike.training_args import TrainingArguments
from torchlike.trl.experimental.bco import BCOConfig, BCOTrainer

SETTINGS = dict(max_length=12, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                gradient_accumulation_steps=2, max_steps=6, learning_rate=1e-2, warmup_steps=2, weight_decay=0.1,
                max_grad_norm=0.05, adam_epsilon=1e-4, logging_steps=1, seed=0, bf16=False, beta=0.1,
                report_to="none", save_strategy="steps", save_steps=3)
"""Both trainers' settings: gradient accumulation, truncation to max_length=12 (several completions are cut), three
epochs of DATA (so the running delta takes in rewards of many micro-batches), a warmup, weight decay, clipping
(max_grad_norm below every step's norm), an Adam epsilon above float noise, and a checkpoint at step 3.

bf16 off: comparisons step for step run in float32 on both sides, the project's convention (TRL's bf16 is torch
autocast, torchlike casts the weights; their bf16 roundings differ far above the tolerance compared here)."""

UDM_SETTINGS = {**SETTINGS, "max_steps": 3, "save_strategy": "no"}
"""The UDM comparison's settings: three steps (the first two score the initial weights, the third moves delta)."""

#: The settings of each case both trainers run: ``"moe"`` trains a Qwen3-MoE whose config asks for its router loss
#: (TRL 1.0.0's BCOTrainer adds ``router_aux_loss_coef * aux_loss`` when the config sets ``output_router_logits``),
#: three steps as UDM's.
CASES = {"plain": SETTINGS, "udm": UDM_SETTINGS, "moe": UDM_SETTINGS}

#: Every metric TRL 1.0.0's BCOTrainer logs, beside loss, grad_norm and learning_rate.
METRICS = ("delta", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "logits/chosen", "logits/rejected")
#: The logits metrics sum every logit of TRL's padded batch (thousands of values of either sign), so their float noise
#: is absolute, not relative to a sum that may lie near 0.
LOGITS_ATOL = 2e-3

#: TRL 1.0.0's side: each case trains on DATA (UDM with the shared embedding function), evaluates on EVAL_DATA and
#: writes its log history, evaluation metrics, final weights as saved and the running.json of its checkpoint; then the
#: config's fields and defaults.
TRL_SCRIPT = """
import dataclasses, json, os, sys
import numpy as np, torch, datasets, transformers
from safetensors.numpy import load_file
from trl.experimental.bco import BCOConfig, BCOTrainer
from tests.helpers.bco import DATA, EVAL_DATA, prompt_features

arguments = json.loads(sys.argv[1])
found = []


def compute_metrics(prediction):
    found.append([np.asarray(prediction.predictions).tolist(), np.asarray(prediction.label_ids).tolist()])
    return {"logits/sum": float(np.sum(prediction.predictions))}


for case, settings in arguments["cases"].items():
    output_dir = os.path.join(arguments["output_dir"], case)
    tokenizer = transformers.AutoTokenizer.from_pretrained(arguments["tokenizer"])
    udm = {"embedding_func": prompt_features, "embedding_tokenizer": tokenizer} if case == "udm" else {}
    trainer = BCOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(arguments["models"][case], dtype=torch.float32),
        args=BCOConfig(output_dir=output_dir, use_cpu=True, **settings),
        train_dataset=datasets.Dataset.from_list(DATA), eval_dataset=datasets.Dataset.from_list(EVAL_DATA),
        processing_class=tokenizer, compute_metrics=compute_metrics if case == "plain" else None, **udm)
    trainer.train()
    metrics = {key: value for key, value in trainer.evaluate().items()
               if key not in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch")}
    running_file = os.path.join(output_dir, "checkpoint-3", "running.json")
    running = json.load(open(running_file)) if os.path.isfile(running_file) else None
    json.dump({"history": trainer.state.log_history, "eval": metrics, "running": running,
               "predictions": found[-1] if case == "plain" else None},
              open(os.path.join(output_dir, "run.json"), "w"))
    trainer.model.save_pretrained(os.path.join(output_dir, "model"))  # a MoE's experts one by one, as torchlike's
    np.savez(os.path.join(output_dir, "weights.npz"),
             **load_file(os.path.join(output_dir, "model", "model.safetensors")))
config = BCOConfig(output_dir=arguments["output_dir"], use_cpu=True)
json.dump({"fields": [item.name for item in dataclasses.fields(BCOConfig)],
           "values": {item.name: repr(getattr(config, item.name)) for item in dataclasses.fields(BCOConfig)
                      if item.name in arguments["compared_fields"]}},
          open(os.path.join(arguments["output_dir"], "fields.json"), "w"))
"""

#: The fields TRL 1.0.0's BCOConfig declares or changes the default of.
BCO_FIELDS = ("learning_rate", "logging_steps", "gradient_checkpointing", "bf16", "max_length",
              "max_completion_length", "beta", "disable_dropout", "generate_during_eval", "is_encoder_decoder",
              "precompute_ref_log_probs", "model_init_kwargs", "dataset_num_proc", "prompt_sample_size",
              "min_density_ratio", "max_density_ratio")


@pytest.fixture(scope="module")
def case_models(tiny_checkpoints, tmp_path_factory) -> dict:
    """The checkpoint each case of :data:`CASES` trains: Qwen2, and for ``"moe"`` a Qwen3-MoE whose config sets
    ``output_router_logits`` with ``router_aux_loss_coef`` 0.5 (far above its default, so that dropping it shows)."""
    moe = with_config(tiny_checkpoints.path("qwen3_moe"), tmp_path_factory.mktemp("bco-moe") / "model",
                      output_router_logits=True, router_aux_loss_coef=0.5)
    return {"plain": tiny_checkpoints.path("qwen2"), "udm": tiny_checkpoints.path("qwen2"), "moe": moe}


@pytest.fixture(scope="module")
def trl_child(case_models, pad_tokenizer_dir, tmp_path_factory):
    """TRL 1.0.0's runs of :data:`CASES` and its config's fields, started in a child process that works while
    torchlike's runs do (``None`` without TRL 1.0.0: the tests that read it skip)."""
    try:
        require_legacy_trl()
    except pytest.skip.Exception:
        yield None
        return
    output_dir = tmp_path_factory.mktemp("trl_bco")
    arguments = {"models": {case: str(path) for case, path in case_models.items()},
                 "tokenizer": str(pad_tokenizer_dir), "output_dir": str(output_dir), "cases": CASES,
                 "compared_fields": BCO_FIELDS}
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor.submit(run_legacy_trl, TRL_SCRIPT, arguments), output_dir


@pytest.fixture(scope="module")
def our_runs(trl_child, case_models, pad_tokenizer_dir, tmp_path_factory):
    """torchlike's runs of :data:`CASES` (the checkpoint-3 of ``"plain"`` and ``"udm"`` serve the resume tests)."""
    return {"plain": run_torchlike(case_models["plain"], pad_tokenizer_dir, tmp_path_factory.mktemp("plain"),
                                   SETTINGS, with_metrics=True),
            "udm": run_torchlike(case_models["udm"], pad_tokenizer_dir, tmp_path_factory.mktemp("udm"),
                                 {**UDM_SETTINGS, "save_strategy": "steps"}, udm=True),
            "moe": run_torchlike(case_models["moe"], pad_tokenizer_dir, tmp_path_factory.mktemp("moe"),
                                 CASES["moe"])}


@pytest.fixture(scope="module")
def trl_runs(trl_child, our_runs):
    """TRL 1.0.0's runs of :data:`CASES` (history, evaluation metrics, weights, checkpointed running moments) and
    its config's fields (``"fields"``), once its child process is done."""
    require_legacy_trl()
    future, output_dir = trl_child
    future.result()
    runs = {}
    for case in CASES:
        run = json.loads((output_dir / case / "run.json").read_text())
        with np.load(output_dir / case / "weights.npz") as weights:
            runs[case] = {**run, "params": dict(weights)}
    return {**runs, "fields": json.loads((output_dir / "fields.json").read_text())}


def bco_trainer(path, tokenizer_path, output_dir, settings: dict, udm: bool = False,
                compute_metrics: Callable | None = None) -> BCOTrainer:
    """torchlike's BCOTrainer on DATA (evaluating on EVAL_DATA), with UDM by :func:`prompt_features` when asked."""
    tokenizer = torchlike.AutoTokenizer.from_pretrained(tokenizer_path)
    extra = {"embedding_func": prompt_features, "embedding_tokenizer": tokenizer} if udm else {}
    return BCOTrainer(model=str(path), args=BCOConfig(output_dir=str(output_dir), **settings), train_dataset=DATA,
                      eval_dataset=EVAL_DATA, processing_class=tokenizer, compute_metrics=compute_metrics, **extra)


def run_torchlike(path, tokenizer_path, output_dir, settings: dict, udm: bool = False,
                  with_metrics: bool = False) -> dict:
    """torchlike's run: log history, evaluation metrics and final parameters as exported (HF names); with
    ``with_metrics``, what ``compute_metrics`` received in the last evaluation (as TRL_SCRIPT's records it)."""
    from safetensors.numpy import load_file

    found = []

    def compute_metrics(prediction):
        found.append([np.asarray(prediction.predictions).tolist(), np.asarray(prediction.label_ids).tolist()])
        return {"logits/sum": float(np.sum(prediction.predictions))}

    trainer = bco_trainer(path, tokenizer_path, output_dir, settings, udm, compute_metrics if with_metrics else None)
    trainer.train()
    metrics = evaluated(trainer)
    trainer.model.save_pretrained(output_dir / "model")
    return {"history": trainer.state.log_history, "eval": metrics, "trainer": trainer,
            "params": load_file(output_dir / "model" / "model.safetensors"),
            "predictions": found[-1] if found else None}


def assert_run_matches(ours: dict, theirs: dict, steps: int) -> None:
    """The same logged steps and metric names, loss, grad norm, learning rate and :data:`METRICS` within rtol 1e-4
    (logits within :data:`LOGITS_ATOL`), and the same final parameters and evaluation metrics."""
    expected = {entry["step"]: entry for entry in theirs["history"] if "loss" in entry}
    found = {entry["step"]: entry for entry in ours["history"] if "loss" in entry}
    assert list(found) == list(expected) == list(range(1, steps + 1))
    assert all(set(found[step]) == set(expected[step]) for step in found)
    assert all(entry["grad_norm"] > SETTINGS["max_grad_norm"] for entry in expected.values())  # clipping is on
    for key in ("loss", "grad_norm", "learning_rate", *METRICS):
        atol = LOGITS_ATOL if key.startswith("logits/") else 1e-6
        np.testing.assert_allclose(logged(ours["history"], key), logged(theirs["history"], key), rtol=1e-4,
                                   atol=atol, err_msg=key)
    assert set(ours["eval"]) == set(theirs["eval"])
    for key, value in theirs["eval"].items():
        atol = LOGITS_ATOL if key.startswith("eval_logits/") else 1e-6
        np.testing.assert_allclose(ours["eval"][key], value, rtol=1e-4, atol=atol, err_msg=key)
    assert set(ours["params"]) == set(theirs["params"])
    for name, value in theirs["params"].items():
        np.testing.assert_allclose(ours["params"][name], value, rtol=1e-4, atol=5e-6, err_msg=name)


# --- step for step against trl.experimental.bco.BCOTrainer (TRL 1.0.0) ----------------------------------------------

@pytest.mark.parametrize("case", ["plain", "moe"])
def test_losses_metrics_evaluation_and_weights_match_trl_1_0_step_for_step(trl_runs, our_runs, case):
    assert_run_matches(our_runs[case], trl_runs[case], CASES[case]["max_steps"])
    assert logged(our_runs[case]["history"], "delta")[-1] != 0.0  # the running mean has moved


def test_compute_metrics_gets_what_trl_1_0s_prediction_step_gives(trl_runs, our_runs):
    """Each eval batch's sums of the chosen and the rejected rows' logits, each only when the batch holds such rows:
    EVAL_DATA's first batch has both, its short last batch one rejected example (3 values); zeros as labels."""
    sums, labels = our_runs["plain"]["predictions"]
    expected_sums, expected_labels = trl_runs["plain"]["predictions"]
    assert len(expected_sums) == 3
    assert labels == expected_labels
    np.testing.assert_allclose(sums, expected_sums, rtol=1e-4, atol=LOGITS_ATOL)


def test_running_json_of_a_checkpoint_matches_trl(trl_runs, our_runs):
    with open(f"{our_runs['plain']['trainer'].args.output_dir}/checkpoint-3/running.json", encoding="utf-8") as file:
        saved = json.load(file)
    assert set(saved) == {"mean", "std", "var", "count"}
    for key, value in trl_runs["plain"]["running"].items():
        np.testing.assert_allclose(saved[key], value, rtol=1e-4, err_msg=key)


def test_underlying_distribution_matching_matches_trl_1_0_step_for_step(trl_runs, our_runs):
    weights = [row["udm_weight"] for row in our_runs["udm"]["trainer"].train_dataset if not row["label"]]
    inside = [weight for weight in weights if 0.5 < weight < 10.0]  # not at TRL's default clamps
    assert len(set(np.round(inside, 4))) > 1  # the classifier weighs the undesirable examples differently
    assert_run_matches(our_runs["udm"], trl_runs["udm"], UDM_SETTINGS["max_steps"])


def test_the_comparisons_are_sharp_for_the_udm_weights(trl_runs):
    """A trainer that ignored the UDM weights would make the run without UDM, whose every loss differs from TRL's
    run with UDM beyond the tolerance compared."""
    plain, udm = logged(trl_runs["plain"]["history"], "loss"), logged(trl_runs["udm"]["history"], "loss")
    assert all(abs(ours - theirs) > 1e-3 for ours, theirs in zip(plain, udm, strict=False))


def test_ignoring_the_running_delta_fails_the_comparison(trl_runs, tiny_checkpoints, pad_tokenizer_dir, tmp_path,
                                                         monkeypatch):
    """The comparison is sharp: a trainer whose delta stays 0 is caught (the delta first moves at step 3, after the
    warmup's step at learning rate 0)."""
    from torchlike.adapters.losses import bco as bco_losses

    monkeypatch.setattr(bco_losses.RunningMoments, "update", lambda self, values: None)
    ours = run_torchlike(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, tmp_path,
                         {**SETTINGS, "max_steps": 3, "save_strategy": "no"})
    assert logged(trl_runs["plain"]["history"], "delta")[2] > 0.01
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(logged(ours["history"], "loss"), logged(trl_runs["plain"]["history"], "loss")[:3],
                                   rtol=1e-4)


# --- checkpoints ----------------------------------------------------------------------------------------------------

def test_resuming_restores_the_running_moments_and_continues_as_a_straight_run(our_runs, tiny_checkpoints,
                                                                                pad_tokenizer_dir):
    our_run = our_runs["plain"]
    folder = f"{our_run['trainer'].args.output_dir}/checkpoint-3"
    trainer = bco_trainer(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, our_run["trainer"].args.output_dir,
                          {**SETTINGS, "save_strategy": "no"})
    trainer.train(resume_from_checkpoint=folder)
    straight = {entry["step"]: entry for entry in our_run["history"] if "loss" in entry}
    resumed = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    for step in (4, 5, 6):
        assert set(resumed[step]) == set(straight[step])
        for key, value in straight[step].items():
            np.testing.assert_allclose(resumed[step][key], value, rtol=1e-6, atol=1e-7, err_msg=f"{key} {step}")
    assert trainer.running.count == our_run["trainer"].running.count
    np.testing.assert_allclose(dataclasses.astuple(trainer.running), dataclasses.astuple(our_run["trainer"].running),
                               rtol=1e-6)
    for name, value in trainer.model.state_dict().items():
        np.testing.assert_allclose(np.asarray(value), np.asarray(our_run["trainer"].model.state_dict()[name]),
                                   rtol=1e-6, atol=1e-7, err_msg=name)


def test_resuming_with_udm_restores_the_saved_classifier_and_its_weights(our_runs, tiny_checkpoints,
                                                                        pad_tokenizer_dir):
    """TRL reloads ``clf.pkl`` on resume: a classifier saved there (here the fitted one, reversed) replaces the one the
    trainer fitted, and the undesirable examples are weighed by it."""
    import joblib

    output_dir = our_runs["udm"]["trainer"].args.output_dir
    saved = joblib.load(f"{output_dir}/checkpoint-3/clf.pkl")
    np.testing.assert_array_equal(saved.coef_, our_runs["udm"]["trainer"].clf.coef_)
    saved.coef_, saved.intercept_ = -saved.coef_, -saved.intercept_
    joblib.dump(saved, f"{output_dir}/checkpoint-3/clf.pkl", compress=True)
    trainer = bco_trainer(tiny_checkpoints.path("qwen2"), pad_tokenizer_dir, output_dir, UDM_SETTINGS, udm=True)
    fitted = [row["udm_weight"] for row in trainer.train_dataset]
    trainer.train(resume_from_checkpoint=f"{output_dir}/checkpoint-3")
    np.testing.assert_array_equal(trainer.clf.coef_, saved.coef_)
    reversed_weights = [row["udm_weight"] for row in trainer.train_dataset]
    assert all(weight == 1.0 for weight, row in zip(reversed_weights, DATA, strict=True) if row["label"])
    assert reversed_weights != fitted
    np.testing.assert_allclose(dataclasses.astuple(trainer.running),
                               dataclasses.astuple(our_runs["udm"]["trainer"].running), rtol=1e-6)


# --- TRL 1.0.0's config and errors ----------------------------------------------------------------------------------

def test_every_trl_1_0_bco_config_field_exists_with_its_default_and_is_classified(trl_runs, tmp_path):
    theirs = trl_runs["fields"]
    ours = BCOConfig(output_dir=str(tmp_path), use_cpu=True)
    our_fields = {item.name for item in dataclasses.fields(BCOConfig)}
    assert set(theirs["fields"]) <= our_fields
    assert {name: repr(getattr(ours, name)) for name in theirs["values"]} == theirs["values"]
    assert set(theirs["fields"]) <= set(field_table(BCOConfig))


def refusal_case(name: str, tiny_checkpoints, pad_tokenizer_dir, tmp_path) -> dict:
    """The constructor arguments of each TRL 1.0.0 validation error."""
    path = str(tiny_checkpoints.path("qwen2"))
    tokenizer = torchlike.AutoTokenizer.from_pretrained(pad_tokenizer_dir)
    arguments = {"model": path, "args": BCOConfig(output_dir=str(tmp_path)), "train_dataset": DATA,
                 "processing_class": tokenizer}
    if name == "TrainingArguments":
        arguments["args"] = TrainingArguments(output_dir=str(tmp_path))
    elif name == "no train_dataset":
        arguments["train_dataset"] = None
    elif name == "ref_model is model":
        arguments["model"] = arguments["ref_model"] = torchlike.AutoModelForCausalLM.from_pretrained(path)
    elif name == "model_init_kwargs with a loaded model":
        arguments["model"] = torchlike.AutoModelForCausalLM.from_pretrained(path)
        arguments["args"] = BCOConfig(output_dir=str(tmp_path), model_init_kwargs={"dtype": "float32"})
    elif name == "no processing_class":
        arguments["processing_class"] = None
    return arguments


TRL_ERRORS = {
    "TrainingArguments": "Please use `BCOConfig` instead `TrainingArguments`.",
    "no train_dataset": "`train_dataset` is required",
    "ref_model is model": "`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the same "
                          "as `model`, you must mass a copy of it, or `None` if you use peft.",
    "model_init_kwargs with a loaded model": "You passed model_kwargs to the BCOTrainer. But your model is already "
                                             "instantiated.",
    "no processing_class": "max_length or a processing_class must be specified when using the default "
                           "DPODataCollatorWithPadding",
}


@pytest.mark.parametrize("case", list(TRL_ERRORS))
def test_trl_1_0_validation_errors_word_for_word(case, tiny_checkpoints, pad_tokenizer_dir, tmp_path):
    with pytest.raises(ValueError) as raised:
        BCOTrainer(**refusal_case(case, tiny_checkpoints, pad_tokenizer_dir, tmp_path))
    assert str(raised.value) == TRL_ERRORS[case]


def test_udm_without_scikit_learn_is_trls_import_error(tiny_checkpoints, pad_tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    arguments = refusal_case("none", tiny_checkpoints, pad_tokenizer_dir, tmp_path)
    with pytest.raises(ImportError) as raised:
        BCOTrainer(**arguments, embedding_func=prompt_features, embedding_tokenizer=arguments["processing_class"])
    assert str(raised.value) == ("BCOTrainer with UDM requires the scikit-learn and joblib libraries. Please install "
                                 "it with `pip install scikit-learn joblib`.")
