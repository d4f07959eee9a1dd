"""vLLM's greedy tokens for checkpoints, optionally with PEFT LoRA adapters: the vLLM side of
``tests/test_vllm_serving.py``.

Run with the python of a venv that has vLLM (``TORCHLIKE_VLLM_PYTHON``); it imports only vLLM, torch and the standard
library, never torchlike. The job is a JSON object, or a list of them served one after the other in this one process,
given as the first argument or on standard input::

    {"model": "/path/to/checkpoint", "prompts": [[5, 6, 7], [8, 9]], "max_new_tokens": 8,
     "adapters": {"lora": "/path/to/adapter"}, "max_lora_rank": 8, "dtype": "float32", "max_model_len": 128}

vLLM starts on ``model`` (no tokenizer, eager, float32 unless ``dtype`` says otherwise), with ``enable_lora=True``
when ``adapters`` (names of PEFT adapter folders) is given. Each prompt is generated greedily (temperature 0,
``ignore_eos``) once on the checkpoint alone, under the name ``"base"``, and once with each adapter as a
``LoRARequest``, under the adapter's name. The last line printed is the answer, JSON, one entry per job::

    {"vllm": "0.32.0", "transformers": "5.19.0",
     "jobs": [{"base": {"tokens": [[...], ...], "logprobs": [[...], ...]}, "lora": {...}}]}

``logprobs`` are vLLM's raw log-probabilities of the generated tokens. A job that fails has
``{"error": "<type>: <message>"}`` instead (its traceback goes to standard error); a job with adapters that fails is
served again without them, so that it keeps its ``"base"`` answer and each adapter gets the error (vLLM 0.32.0's CPU
build cannot run mixture-of-experts models with LoRA enabled). (No prompt log-probabilities: with ``enable_lora``,
vLLM 0.32.0's CPU LoRA logits path fails on them for tied-embedding models, ``einsum(): subscript b has size 3 ...``.)
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

# Python puts this script's folder first on sys.path, and tests/helpers has modules named like vLLM's dependencies
# (tokenizers.py, data.py): drop it, so that ``import tokenizers`` finds the package.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _HERE]
# The engine in this process (no engine-core and worker processes to start: each would import vLLM again), no hub.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _chosen_logprobs(steps: list, tokens: list[int]) -> list[float]:
    """The log-probability of each chosen token from vLLM's per-step ``{token: Logprob}`` dictionaries."""
    return [step[token].logprob for step, token in zip(steps, tokens, strict=True)]


def serve(job: dict) -> dict:
    """Starts vLLM on ``job["model"]`` and returns, per request name, its greedy tokens and log-probabilities."""
    import vllm
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = job.get("adapters") or {}
    options = dict(model=job["model"], dtype=job.get("dtype", "float32"), skip_tokenizer_init=True,
                   enforce_eager=True, max_model_len=job.get("max_model_len", 128), max_num_seqs=8, seed=0,
                   kv_cache_memory_bytes=job.get("kv_cache_memory_bytes", 64 << 20))
    if adapters:
        options.update(enable_lora=True, max_lora_rank=job.get("max_lora_rank", 8), max_loras=len(adapters))
    llm = None
    try:
        llm = vllm.LLM(**options)
        sampling = vllm.SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=True,
                                       detokenize=False, logprobs=0)
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in job["prompts"]]
        requests = {"base": None, **{name: LoRARequest(name, index + 1, path)
                                     for index, (name, path) in enumerate(adapters.items())}}
        results = {}
        for name, request in requests.items():
            outputs = llm.generate(prompts, sampling, lora_request=request, use_tqdm=False)
            results[name] = {
                "tokens": [list(output.outputs[0].token_ids) for output in outputs],
                "logprobs": [_chosen_logprobs(output.outputs[0].logprobs, output.outputs[0].token_ids)
                             for output in outputs],
            }
        return results
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _serve_or_error(job: dict) -> dict:
    """:func:`serve`, or ``{"error": "<type>: <message>"}`` (traceback on standard error) when vLLM fails."""
    try:
        return serve(job)
    except Exception as error:  # reported per job, so that one family's failure leaves the others' answers
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(error).__name__}: {error}"}


def serve_job(job: dict) -> dict:
    """:func:`_serve_or_error`; when a job with adapters fails, the checkpoint is served again without them, so that
    its ``"base"`` answer survives an engine that cannot start or run with LoRA, and each adapter gets the error."""
    from vllm.distributed import cleanup_dist_env_and_memory

    answer = _serve_or_error(job)
    # A failed engine (held by the exception's traceback until the error was reported) must be collected and the
    # process groups torn down before the next engine starts: otherwise the next job fails with "pipeline model
    # parallel group is not initialized".
    gc.collect()
    cleanup_dist_env_and_memory()
    if "error" in answer and job.get("adapters"):
        base = serve_job({key: value for key, value in job.items() if key != "adapters"})
        answer = {"base": base.get("base", base), **{name: answer for name in job["adapters"]}}
    return answer


def main() -> None:
    job = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    import transformers
    import vllm

    answers = [serve_job(one) for one in (job if isinstance(job, list) else [job])]
    sys.stdout.flush()
    print(json.dumps({"vllm": vllm.__version__, "transformers": transformers.__version__, "jobs": answers}),
          flush=True)


if __name__ == "__main__":
    main()
