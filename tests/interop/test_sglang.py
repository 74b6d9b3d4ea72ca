"""SGLang's own KV event publisher (``sglang.srt.disaggregation.kv_events.ZmqEventPublisher``, sglang
0.5.23 from the peers' environment) into ``kvledger collect``: its connect-form endpoint (collect
binds), its ``cache_salt`` as a scope, its signed int64 hashes as it computes them, and a restart
of the publisher on the same endpoint (a new epoch, nothing dropped)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from forensics.queries.duckdb import Forensics
from tests.interop.peers import Collect, build_vllm_model, free_port, peer_env

pytestmark = pytest.mark.interop

# runs in the peers' environment: SGLang's classes publish, SGLang's functions compute the hashes
PUBLISH = r"""
import json, sys, time
from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
    ZmqEventPublisher, kv_event_namespace_seed, namespaced_block_hash)
endpoint, salt, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
seed = kv_event_namespace_seed(extra_key=None, cache_salt=salt)
hashes = [namespaced_block_hash(h, namespace_seed=seed) for h in (101, 202, 303)]
for run in range(runs):                  # each run is a new engine process: its sequence starts at 0 again
    pub = ZmqEventPublisher(attn_dp_rank=0, endpoint=endpoint, topic="kv")
    time.sleep(1.0)                      # the SUB side's slow joiner
    t = time.time()
    pub.publish(KVEventBatch(ts=t, events=[BlockStored(block_hashes=hashes[:2], parent_block_hash=None,
        token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU", cache_salt=salt, session_id="sess-9")]))
    pub.publish(KVEventBatch(ts=t, events=[BlockStored(block_hashes=hashes[2:], parent_block_hash=hashes[1],
        token_ids=list(range(16)), block_size=16, lora_id=None, medium="GPU")]))
    pub.publish(KVEventBatch(ts=t, events=[BlockRemoved(block_hashes=hashes[:1], medium="GPU"), AllBlocksCleared()]))
    time.sleep(1.0)                      # shutdown closes with linger 0: let the batches leave first
    pub.shutdown()
print(json.dumps(hashes))
"""


def test_sglang_publisher_connects_collect_binds_salt_scopes_hashes_and_restarts(peers_python, tmp_path):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"          # a concrete host: SGLang connects, so collect must bind
    collect = Collect(tmp_path / "store", ["--kv-events", f"{endpoint},bind,name=sglang-0"], tmp_path / "collect.log")
    salt = "tenant-a-salt-7f3e"
    try:
        pub = subprocess.run([str(peers_python), "-c", PUBLISH, endpoint, salt, "2"], env=peer_env(),
                             capture_output=True, text=True, timeout=180)
    finally:
        summary = collect.stop()
    assert pub.returncode == 0, pub.stderr[-3000:]
    hashes = json.loads(pub.stdout.strip().splitlines()[-1])
    assert all(-(2**63) <= h < 2**63 for h in hashes)     # int64 namespaced hashes, as SGLang computes them
    assert collect.proc.returncode == 0, summary
    assert "sglang-0: 6 batches" in summary and "1 restart(s)" in summary and "0 unreadable" in summary, summary
    fx = Forensics(tmp_path / "store")
    rows = fx.con.sql("SELECT epoch, seq, kind, block_hashes, parent_hash, scope_h, lora FROM kv_events "
                      "WHERE instance = 'sglang-0' ORDER BY epoch, seq, kind").fetchall()
    assert [(e, s) for e, s, *_ in rows] == [(0, 0), (0, 1), (0, 2), (0, 2), (1, 0), (1, 1), (1, 2), (1, 2)]
    first = rows[0]
    assert first[3] == [str(h) for h in hashes[:2]] and first[4] is None      # the engine's own signed decimal
    child = rows[1]
    assert child[3] == [str(hashes[2])] and child[4] == str(hashes[1])
    assert first[5] is not None and child[5] == first[5]                       # the salt's scope, inherited
    assert all(r[6] is None for r in rows)                                      # no salt in the lora column
    gaps = fx.con.sql("SELECT items, filled, note FROM telemetry_gaps WHERE instance = 'sglang-0'").fetchall()
    assert len(gaps) == 1 and gaps[0][:2] == (0, True) and "went back, from 2 to 0" in gaps[0][2]
    raw = b"".join(f.read_bytes() for f in (tmp_path / "store").rglob("*") if f.is_file())
    assert salt.encode() not in raw and b"sess-9" not in raw


# SGLang's own canary reporter (pure Python, CPU) renders the violation; the checksum line is an
# f-string inside the decode scheduler (srt/disaggregation/decode.py), which only a GPU build runs:
# it is written here in that f-string's exact words. The log prefix is configure_logger's.
REPORT = r"""
import sys
from sglang.kernels.ops.kv_canary.consts import FailReason
from sglang.kernels.ops.kv_canary.verify import CanaryLaunchTag
from sglang.srt.kv_canary.runner.violation_reporter import _format_violation
msg = _format_violation(row=[int(CanaryLaunchTag.HEAD_K_FULL), 88213, 17, 5, 7, 123, 456,
                             int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)], total=1, ring_overflow=False, step_when_pumped=9)
print("[2026-12-02 04:20:00 TP0] " + msg)
print("[2026-12-02 04:20:01 TP0] " + f"KV checksum mismatch req=4f2c bootstrap_room=771 expected={0x9c1f0e2a:#x} got={0:#x}")
print("[2026-12-02 04:20:02 TP0] Decode batch. #running-req: 1, #token: 64, token usage: 0.00")
"""


def test_sglang_detector_lines_as_its_sources_write_them_are_ingested(peers_python, tmp_path):
    from engine.commands.main import main
    out = subprocess.run([str(peers_python), "-c", REPORT], env=peer_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    log = tmp_path / "sglang.log"
    log.write_text(out.stdout)
    assert "kv_canary violation: launch_tag=HEAD_K_FULL" in out.stdout          # SGLang's own words
    assert main(["ingest-logs", str(log), "--engine", "sglang", "--store", str(tmp_path / "store"),
                 "--instance", "sglang-0"]) == 0
    got = Forensics(tmp_path / "store").query("canary").select("instance", "kind", "line_no").rows()
    assert got == [("sglang-0", "kv_canary", 1), ("sglang-0", "kv_checksum", 8)]    # one event per violation


# SGLang's own /server_info body, built by its own code (ServerArgs.resolved_dict via build_server_info,
# plus what http_server.server_info adds) for a prefill node; the scheduler's handshake numbers are the
# incident's. Served on loopback with the stdlib: SGLang's HTTP server itself needs a GPU build.
SERVER_INFO = r"""
import http.server, json, sys
import sglang
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import build_server_info
model, port, version = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = ServerArgs(model_path=model, device="cpu", disaggregation_mode="prefill")
info = {**build_server_info(args, {"status": "ready", "max_total_num_tokens": 681280, "max_req_input_len": 1048570}),
        "internal_states": [], "version": version or sglang.__version__, "frontend": "python"}
bodies = {"/server_info": info, "/health": {},
          "/v1/models": {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 1048576}]}}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = bodies.get(self.path)
        data = json.dumps(body, default=str).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
print("ready", flush=True)
srv.serve_forever()
"""


@pytest.mark.parametrize("version,finding", [("", False), ("0.5.21", True)])
def test_preflight_reads_sglangs_own_server_info_for_a_prefill_node(peers_python, tmp_path, version, finding):
    import httpx

    from tests.interop.peers import ROOT
    model = build_vllm_model(tmp_path / "m")          # ServerArgs reads the model's config
    port = free_port()
    srv = subprocess.Popen([str(peers_python), "-c", SERVER_INFO, str(model), str(port), version], env=peer_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready", srv.stderr.read()[-2000:]
        info = httpx.get(f"http://127.0.0.1:{port}/server_info").json()
        assert info["context_length"] is None and info["disaggregation_mode"] == "prefill"    # SGLang's own nulls
        r = subprocess.run([sys.executable, "-m", "engine.commands", "preflight", "--endpoint",
                            f"http://127.0.0.1:{port}/v1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "200"})
    finally:
        srv.kill()
    out = " ".join(r.stdout.split())
    assert r.returncode == 1, r.stdout + r.stderr                     # 681,280 < 1,048,576: the incident's numbers
    assert "681,280" in out and "1,048,576" in out and "prefill node" in out, out   # context from /v1/models
    assert ("without the incident's admission fixes" in out) is finding and ("release" in out) is finding, out
    assert ("without the incident's admission fixes" in r.stderr) is finding, r.stderr
