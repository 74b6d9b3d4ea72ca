"""What the hardened guards cost: decode throughput of a disaggregated cluster with every guard on
(`hardened`) vs every guard off (`vulnerable`), the same workload, interleaved in one run.

The workload has no over-pool prompt and no fault trigger, so both policies do the same work and
produce the same tokens (checked); the difference is the guards' own cost: the router's limit
check, the checksum over every transfer (computed by prefill, verified by decode), the landed-set
check, deferred release bookkeeping, bounded transfer calls, the double-free check, and the read
check failing readers (the read check *runs* in both: recording is on in both policies).
Writes bench/results/guards.json.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import interleaved, tiny_llama_workload, workload_parser, write  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.disagg.cluster import DisaggCluster, Guards, LinkConfig  # noqa: E402
from engine.kv.pool import KVPool  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def main() -> None:
    args = workload_parser(__doc__, repeats=9).parse_args()
    model, prompts, _, tmp = tiny_llama_workload(args.batch)
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, 16)

    def run(policy: str) -> list[list[int]]:
        cfg = lambda node: EngineConfig(kv_memory_budget=256 * pb, page_size=16, context_length=1024,  # noqa: E731
                                        node_id=node, max_num_seqs=args.batch)
        cl = DisaggCluster(model, None, [cfg("prefill0")], cfg("decode0"), Guards.policy(policy), LinkConfig())
        reqs = [cl.submit(p, sp, tenant=f"t{i % 3}") for i, p in enumerate(prompts)]
        cl.run_until_done()
        cl.close()
        return [r.output_ids for r in reqs]

    same = run("hardened") == run("vulnerable")
    # wall time is what throughput means, but this machine is shared: the process's CPU time
    # (all its threads) is measured beside it, and is far less disturbed by neighbours
    cpu: dict[str, list[float]] = {"hardened": [], "vulnerable": []}

    def timed(policy: str):
        c0 = time.process_time()
        run(policy)
        cpu[policy].append(time.process_time() - c0)

    t = interleaved({"hardened": lambda: timed("hardened"), "vulnerable": lambda: timed("vulnerable")}, args.repeats)
    tokens = args.batch * args.new_tokens
    tps = {k: tokens / v for k, v in t.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    res = {"config": {"model": "tiny llama hidden 256, 4 layers", "batch": args.batch, "new_tokens": args.new_tokens,
                      "prompt_lens": [len(p) for p in prompts], "repeats": args.repeats, "nodes": "1 prefill + 1 decode"},
           "tokens_per_s": tps, "cpu_seconds": cpu_med, "same_tokens": same,
           "guard_cost": 1 - tps["hardened"] / tps["vulnerable"],
           "guard_cost_cpu": cpu_med["hardened"] / cpu_med["vulnerable"] - 1, "goal_cost": 0.01}
    out = write("guards", res)
    print(f"cluster tokens/s: hardened {tps['hardened']:.0f} vs vulnerable {tps['vulnerable']:.0f} "
          f"(guard cost {100 * res['guard_cost']:+.1f} % by wall time, {100 * res['guard_cost_cpu']:+.1f} % by CPU "
          f"time; goal <= 1 %); same tokens: {same}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
