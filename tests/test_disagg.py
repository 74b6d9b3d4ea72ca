"""Disaggregated serving mechanics that the incident tests do not pin down."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.disagg.cluster import DisaggCluster, Guards
from engine.models import load_model
from engine.kv.pool import KVPool
from engine.request import SamplingParams, Status


def _cluster(prefill_tokens: int, decode_tokens: int) -> DisaggCluster:
    model, tok = load_model("recall")
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, 16)
    cfg = lambda tokens, node: EngineConfig(kv_memory_budget=tokens // 16 * pb, page_size=16,  # noqa: E731
                                            context_length=512, node_id=node)
    return DisaggCluster(model, tok, [cfg(prefill_tokens, "p0")], cfg(decode_tokens, "d0"), Guards.policy("hardened"))


def test_prefill_node_waits_while_its_pages_are_still_being_sent():
    """A prefill pool full of KV awaiting transfer means "wait", never "this prompt can never fit"."""
    cl = _cluster(prefill_tokens=160, decode_tokens=1024)
    try:
        a = cl.submit("a" * 100, SamplingParams(max_tokens=2), "t1")
        b = cl.submit("b" * 100, SamplingParams(max_tokens=2), "t2")
        node = cl.prefills[0]
        node.step()                                   # prefills a, hands off: a's pages held until it lands
        assert node.pages_held_outside()
        assert node.step() == [] and not b.is_finished   # b cannot be scheduled yet, and is not failed
        cl.run_until_done()
        assert a.status is Status.FINISHED_LENGTH and b.status is Status.FINISHED_LENGTH
        assert all(n.allocator.num_free == n.allocator.total for n in cl.nodes)
    finally:
        cl.close()


def test_bad_link_and_guard_settings_are_refused_before_any_node_starts():
    import pytest

    from engine.disagg.cluster import LinkConfig
    from engine.errors import InputError
    model, tok = load_model("recall")
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, 16)
    cfg = lambda n: EngineConfig(kv_memory_budget=64 * pb, page_size=16, context_length=512, node_id=n)  # noqa: E731
    with pytest.raises(InputError, match="not shorter than the release timeout of 4"):
        DisaggCluster(model, tok, [cfg("p0")], cfg("d0"), Guards.policy("hardened"),
                      LinkConfig(slots_per_tick=64, batch_slots=256, release_timeout_ticks=4))
    with pytest.raises(InputError, match="link settings must be >= 1"):
        DisaggCluster(model, tok, [cfg("p0")], cfg("d0"), Guards.policy("hardened"), LinkConfig(slots_per_tick=0))
    with pytest.raises(InputError, match=r"unknown guard\(s\) \['chcksum'\]"):
        Guards.only("chcksum")
    with pytest.raises(InputError, match="unknown policy"):
        Guards.policy("paranoid")
    # an unbounded transfer is allowed when the batch-bound guard is off (faults 3 and 7 use it)
    cl = DisaggCluster(model, tok, [cfg("p0")], cfg("d0"), Guards.only("deferred_release"),
                       LinkConfig(slots_per_tick=64, batch_slots=256, release_timeout_ticks=4))
    stranger = cl.decode.new_request("not routed here", SamplingParams(max_tokens=2), "t1")
    with pytest.raises(InputError, match="was not submitted to this cluster"):
        cl.abort(stranger)
    cl.close()
