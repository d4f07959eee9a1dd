"""Greedy tokens from vLLM for a checkpoint, optionally with a PEFT LoRA adapter: the vLLM side of
``tests/test_vllm_serving.py``.

Run with the python of a venv that has vLLM (``TORCHLIKE_VLLM_PYTHON``); it imports only vLLM, torch and the standard
library, never torchlike. The job is a JSON object, given as the first argument or on standard input::

    {"model": "/path/to/checkpoint", "prompts": [[5, 6, 7], [8, 9]], "max_new_tokens": 8,
     "adapters": {"lora": "/path/to/adapter"}, "max_lora_rank": 8, "dtype": "float32", "max_model_len": 128}

``adapters`` (optional) names PEFT adapter folders; with any, vLLM starts with ``enable_lora=True``. The prompts are
generated greedily (temperature 0, ``ignore_eos``) once on the checkpoint alone (under the key ``"base"``) and once
with each adapter as a ``LoRARequest`` (under its name). The last line printed is the answer, JSON::

    {"vllm": "0.32.0", "tokens": {"base": [[...], [...]], "lora": [[...], [...]]}}
"""

from __future__ import annotations

import json
import os
import sys

# Python puts this script's folder first on sys.path, and tests/helpers has modules named like vLLM's dependencies
# (tokenizers.py, data.py): drop it, so that ``import tokenizers`` finds the package.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _HERE]


def run(job: dict) -> dict:
    """Starts vLLM on ``job["model"]`` and returns its greedy tokens for each prompt, without and with each adapter."""
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = job.get("adapters") or {}
    options = dict(model=job["model"], dtype=job.get("dtype", "float32"), skip_tokenizer_init=True,
                   enforce_eager=True, max_model_len=job.get("max_model_len", 128), max_num_seqs=8, seed=0,
                   kv_cache_memory_bytes=job.get("kv_cache_memory_bytes", 64 << 20))
    if adapters:
        options.update(enable_lora=True, max_lora_rank=job.get("max_lora_rank", 8), max_loras=len(adapters))
    llm = vllm.LLM(**options)
    sampling = vllm.SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=True,
                                   detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in job["prompts"]]
    requests = {"base": None, **{name: LoRARequest(name, index + 1, path)
                                 for index, (name, path) in enumerate(adapters.items())}}
    tokens = {}
    for name, request in requests.items():
        outputs = llm.generate(prompts, sampling, lora_request=request, use_tqdm=False)
        tokens[name] = [list(output.outputs[0].token_ids) for output in outputs]
    return {"vllm": vllm.__version__, "tokens": tokens}


def main() -> None:
    job = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    answer = run(job)
    sys.stdout.flush()
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
