"""Engine throughput, measured side by side in one run (absolute numbers drift on a shared box).

1. kvledger vs transformers generate() on the same tiny Llama and mixed-length batch (greedy).
2. decode tokens/s with the read check on vs off, and with zero_on_free on.
Writes bench/results/engine.json; README figures are generated from it (bench/readme_figures.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import interleaved, tiny_llama_workload, workload_parser, write  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def main() -> None:
    args = workload_parser(__doc__, repeats=5).parse_args()
    model, prompts, g, tmp = tiny_llama_workload(args.batch)
    d = tmp / "tiny"
    lens = [len(p) for p in prompts]
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    new_tokens = args.batch * args.new_tokens

    def ours(**kw):
        # The engine (and its pool) is built once, outside the timed region; each run reuses it.
        cfg = EngineConfig(kv_memory_budget=64 << 20, page_size=16, max_num_seqs=args.batch, **kw)
        eng = LLMEngine(model, None, cfg)
        return lambda: eng.generate(prompts, sp)

    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    width = max(lens)
    ids = torch.zeros(args.batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):      # left padding, as generate() expects for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def theirs():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    t = interleaved({"kvledger": ours(), "transformers": theirs, "check_off": ours(check_reads=False),
                     "zero_on_free": ours(zero_on_free=True)}, args.repeats)
    tps = {k: new_tokens / v for k, v in t.items()}
    res = {"config": {"hidden": 256, "layers": 4, "batch": args.batch, "prompt_lens": lens,
                      "new_tokens": args.new_tokens, "repeats": args.repeats},
           "tokens_per_s": tps,
           "ratio_kvledger_vs_transformers": tps["kvledger"] / tps["transformers"],
           "read_check_cost": 1 - tps["kvledger"] / tps["check_off"],
           "zero_on_free_cost": 1 - tps["zero_on_free"] / tps["kvledger"]}
    out = write("engine", res)
    print(f"tokens/s: kvledger {tps['kvledger']:.0f}, transformers {tps['transformers']:.0f} "
          f"-> ratio {res['ratio_kvledger_vs_transformers']:.2f}x")
    print(f"read check on vs off: {tps['kvledger']:.0f} vs {tps['check_off']:.0f} tokens/s "
          f"(cost {100 * res['read_check_cost']:.1f} %)")
    print(f"zero_on_free: {tps['zero_on_free']:.0f} tokens/s (cost {100 * res['zero_on_free_cost']:.1f} %)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
