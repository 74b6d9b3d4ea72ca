"""The public entry point: ``LLMEngine``.

    engine = LLMEngine(model, tokenizer, EngineConfig(kv_memory_budget=64 << 20))
    reqs = engine.generate(["The secret is"], SamplingParams(max_tokens=16))
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time
from typing import Callable, Iterable

import torch

from engine.kv.allocator import PageAllocator
from engine.kv.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InputError, ReadCheckViolation
from engine.kv.host import HostTier
from engine.kv.pool import KVPool
from engine.kv.prefix_cache import PrefixCache
from engine.osutil import freeze_heap, keep_freed_buffers
from engine.kv.preflight import preflight
from engine.recorder import NULL_RECORDER, Recorder
from engine.request import Request, SamplingParams, Status
from engine.runner import ModelRunner, StepOutput
from engine.sampling import sample
from engine.scheduler import Scheduler
from engine.tags import TagChain, scope_key

# none: one global scope, every tenant shares the prefix cache (what an engine without per-tenant
# salts does) - never a default; it exists so the probe's side-channel checks can be shown to find it
ISOLATION_LEVELS = ("user", "tenant", "org", "none")
StepObserver = Callable[["LLMEngine", StepOutput], None]


def _check_backend(name: str) -> None:
    if name not in ("torch", "triton"):
        raise InputError(f"attention_backend must be 'torch' or 'triton', got {name!r}")
    if name == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise InputError("attention_backend='triton' needs a CUDA GPU, or TRITON_INTERPRET=1 set before Triton is "
                         "imported (the CPU interpreter)")


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, recorder: Recorder | None = None):
        self.cfg = cfg = config or EngineConfig()
        self.model, self.tokenizer = model, tokenizer
        dtype = getattr(model, "dtype", torch.float32)
        _check_backend(cfg.attention_backend)
        if cfg.isolation_level not in ISOLATION_LEVELS:
            raise InputError(f"isolation_level must be one of {ISOLATION_LEVELS}, got {cfg.isolation_level!r}")
        if cfg.keep_freed_buffers:
            keep_freed_buffers()
        self.preflight = preflight(model, cfg)          # before the pool is allocated
        self.pool = KVPool(model.num_layers, model.kv_dim, cfg.page_size, cfg.kv_memory_budget,
                           dtype=dtype, zero_on_free=cfg.zero_on_free, shared_path=cfg.shared_pool_path)
        self.allocator = PageAllocator(self.pool, detect_double_free=cfg.detect_double_free)
        self.host = HostTier(self.pool, cfg.host_memory_budget)
        self.blocks = BlockManager(self.allocator, self.host, cfg.page_size, cfg.deferred_release)
        self.prefix_cache = PrefixCache(self.allocator, cfg.page_size) if cfg.prefix_cache else None
        if self.prefix_cache is not None:
            self.allocator.on_allocate = self.prefix_cache.evict
            self.blocks.prefix_cache = self.prefix_cache
        self.scheduler = Scheduler(cfg, self.blocks)
        self.runner = ModelRunner(model, self.pool, cfg.check_reads, cfg.attention_backend, cfg.exact_mass)
        self.observers: list[StepObserver] = []
        # disaggregated prefill nodes hand a request's KV off here instead of decoding it
        self.on_prefill_done: Callable[[Request], None] | None = None
        # a disaggregated prefill node's transfers: transfer key -> the request whose pages are being
        # sent, and the node's transfer sequence numbers (the cluster fills and drains ``sending``)
        self.sending: dict = {}
        self.transfer_seq = itertools.count(1)
        self.requests: dict[int, Request] = {}      # unfinished requests only (see _track)
        self.steps = 0
        self._clock = itertools.count(1)   # logical clock: every step and every landed transfer batch ticks it
        self.lclock = 0
        self.rec = recorder or NULL_RECORDER
        self.blocks.on_release = lambda req, pages, *a: self.rec.pages_released(self, req, pages, *a)
        self.blocks.on_hold = lambda req, pages, why: self.rec.pages_held(self, req, pages, why)
        self.blocks.on_move = lambda req, path, pages, pos: self.rec.pages_moved(self, req, path, pages, pos)
        self.rec.node_started(self)
        if cfg.freeze_gc:                   # last: the model, the pool and the recorder are built
            freeze_heap()

    def pages_held_outside(self) -> bool:
        """Pages held by requests outside the scheduler (KV still being sent): while any are, an empty
        schedule means "wait", not "this request can never fit"."""
        return bool(self.sending)

    # ---- admission: every check runs before any page is taken ------------------------------
    def scope_for(self, tenant: str, user: str = "", salt: str = "") -> str:
        """The cache scope, derived here from the tenant and the configured isolation level (a
        client names its tenant and user, never its scope).

        Injective by construction: the scope is a JSON array of tagged components, so no choice of
        names can make two different (level, tenant, user, org, salt) tuples equal - an unmapped
        tenant named "acme-corp" is ["tenant", "acme-corp"], never org "acme-corp"'s
        ["org", "acme-corp"]; tenant "acme" + user "bob/carol" never meets tenant "acme/bob" + user
        "carol". A client ``salt`` only narrows a scope: it is one more component of that scope."""
        level = self.cfg.isolation_level
        if level == "user":
            if not user:
                raise InputError("isolation level 'user' needs a user id with every request")
            parts = ["user", tenant, user]
        elif level == "org" and tenant in self.cfg.orgs:
            parts = ["org", self.cfg.orgs[tenant]]
        elif level == "none":
            parts = ["global"]
        else:                        # level 'tenant', or a tenant that no org mapping names
            parts = ["tenant", tenant]
        if salt:
            parts += ["salt", salt]
        return json.dumps(parts, ensure_ascii=True, separators=(",", ":"))

    def validate(self, prompt_ids: list[int], sp: SamplingParams) -> None:
        limit = self.cfg.context_length
        if not prompt_ids:
            raise InputError("empty prompt: at least one token is required")
        if len(prompt_ids) > limit:
            raise InputError(f"prompt is {len(prompt_ids)} tokens, longer than the context length {limit}")
        if sp.max_tokens <= 0:
            raise InputError(f"max_tokens must be >= 1, got {sp.max_tokens}")
        if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
            raise InputError(f"temperature must be a finite number >= 0, got {sp.temperature}")
        if not 0.0 < sp.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {sp.top_p}")
        if sp.seed is not None and not 0 <= sp.seed < 1 << 63:
            raise InputError(f"seed must be in [0, 2**63), got {sp.seed}")
        vocab = getattr(self.model, "vocab_size", None) or self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def check_fits_pool(self, num_tokens: int) -> None:
        if num_tokens > self.pool.capacity_tokens:
            raise InputError(f"prompt is {num_tokens} tokens, larger than node {self.cfg.node_id}'s KV pool of "
                             f"{self.pool.capacity_tokens} tokens")

    def new_request(self, prompt: str | list[int], sampling: SamplingParams | None = None, tenant: str = "default",
                    rid: str = "", incarnation: int | None = None, user: str = "", cache_salt: str = "") -> Request:
        """Validate and build a request; takes no page and queues nothing."""
        sp = sampling or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("a text prompt needs a tokenizer; pass token ids instead")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"the prompt is not valid UTF-8 text (undecodable byte at character {e.start})") from None
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        self.validate(prompt_ids, sp)
        scope = self.scope_for(tenant, user, cache_salt)
        chain = TagChain(scope_key(self.cfg.scope_secret, scope, self.cfg.kv_format_version), self.cfg.kv_format_version)
        chain.extend(prompt_ids)
        req = Request(prompt_ids, sp, tenant, scope, chain, rid=rid, prompt_tokens_billed=len(prompt_ids),
                      user=user, cache_salt=cache_salt)
        if incarnation is not None:
            req.incarnation = incarnation
        return req

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None, tenant: str = "default",
                    rid: str = "") -> Request:
        req = self.new_request(prompt, sampling, tenant, rid)
        self.check_fits_pool(len(req.prompt_ids))
        self.enqueue(req)
        return req

    def enqueue(self, req: Request) -> None:
        self.rec.request_arrived(self, req)
        self._track(req)
        self.scheduler.add(req)

    def enqueue_running(self, req: Request) -> None:
        """Disaggregated decode: a request whose KV already landed joins the running batch."""
        self._track(req)
        self.scheduler.running.append(req)

    def _track(self, req: Request) -> None:
        """``requests`` holds the requests this node has not finished, and only those: a finished one
        is handed back to its caller and forgotten here (a long-running server stays bounded)."""
        if req.incarnation not in self.requests:
            self.requests[req.incarnation] = req
            req.on_finish.append(lambda r: self.requests.pop(r.incarnation, None))

    def tick(self) -> int:
        """Advance this node's logical clock for a step (engine thread): self.lclock is that step's."""
        self.lclock = next(self._clock)
        return self.lclock

    def next_lclock(self) -> int:
        """A clock value for an event off the engine thread (a landed transfer batch); the counter
        is shared, so events stay ordered, and self.lclock keeps naming the current step."""
        return next(self._clock)

    # ---- the step loop ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        try:
            return self._step()
        finally:
            self.host.drain()            # offload copies complete at the end of the step (DMA)

    def _step(self) -> list[Request]:
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_work() and not self.pages_held_outside() and not self.blocks.held:
                stuck = (self.scheduler.waiting or self.scheduler.swapped)[0]
                self._finish(stuck, error=InputError(
                    f"request {stuck.incarnation} needs more KV pages than the pool can ever free "
                    f"({self.allocator.total} pages of {self.cfg.page_size} tokens)"))
                return [stuck]
            return []
        now = time.perf_counter()
        for req, n in batch:
            if req.num_computed < len(req.prompt_ids):       # prompt positions this node computes itself
                req.prefill_started_at = req.prefill_started_at or now
                req.prefilled_tokens = max(req.prefilled_tokens,
                                           min(req.num_computed + n, len(req.prompt_ids)) - req.cached_tokens)
        self.tick()
        out = self.runner.run(batch)
        self.steps += 1
        self.rec.step(self, out)
        for obs in self.observers:
            obs(self, out)
        if out.read_check is not None:
            bad = out.read_check.bad_slots
            failing = [] if out.read_check.any_failed is False else torch.nonzero(bad.sum(1)).flatten().tolist()
            if self.cfg.fail_on_violation:
                self.rec.guard_checked(self, "read_check", failed=False, count=len(batch) - len(failing))
                if failing:
                    self.rec.guard_checked(self, "read_check", failed=True, count=len(failing))
            for b in failing:
                req = batch[b].req
                if self.cfg.fail_on_violation:
                    pages = [req.block_table[c] for c in torch.nonzero(bad[b]).flatten().tolist()]
                    self._finish(req, error=ReadCheckViolation(req.incarnation, pages, int(bad[b].sum())))
        finished = [s.req for s in batch if s.req.is_finished]
        for s in batch:
            if not s.req.is_finished:
                s.req.num_computed += s.num_tokens
                if self.prefix_cache is not None and s.req.num_computed - s.num_tokens < len(s.req.prompt_ids):
                    self.prefix_cache.register(s.req, self.pool.tags)
        if out.sampling:
            reqs = [batch[b].req for b in out.sampling]
            toks = sample(out.logits, reqs)
            now = time.perf_counter()
            for req, tok in zip(reqs, toks):
                if req.is_finished:
                    continue
                req.output_ids.append(tok)
                req.chain.append(tok)
                if req.status is Status.PREFILLING:
                    req.first_token_at = now
                    if self.on_prefill_done is not None:      # disaggregated: hand off, keep pages
                        self.scheduler.remove(req)
                        req.transition(Status.TRANSFERRING)
                        self.on_prefill_done(req)
                        continue
                    req.transition(Status.DECODING)
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    self._finish(req, status=reason)
                    finished.append(req)
        return finished

    def _stop_reason(self, req: Request, tok: int) -> Status | None:
        eos = getattr(self.model, "eos_token_id", None)
        if eos is not None and tok == eos and not req.sampling.ignore_eos:
            return Status.FINISHED_STOPPED
        if len(req.output_ids) >= req.sampling.max_tokens or req.seq_len >= self.cfg.context_length:
            return Status.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: Status | None = None, error: BaseException | None = None) -> None:
        self.scheduler.remove(req)
        self.blocks.release(req)
        if error is not None:
            req.fail(error)
        else:
            req.transition(status)

    def abort(self, req: Request, reason: str = "aborted by client") -> None:
        if not req.is_finished:
            self.scheduler.remove(req)
            self.blocks.release(req)
            req.error = InputError(reason)
            req.transition(Status.FINISHED_ABORTED)

    # ---- engine.server.loop.Backend: what a server steps (one node here; DisaggCluster: many) ------
    @property
    def nodes(self) -> list["LLMEngine"]:
        return [self]

    def admit(self, prompt_ids: list[int], sp: SamplingParams, tenant: str, user: str = "",
              cache_salt: str = "") -> Request:
        """A server's request: over the pool is refused (InputError) before any page is taken."""
        req = self.new_request(prompt_ids, sp, tenant, user=user, cache_salt=cache_salt)
        self.check_fits_pool(len(req.prompt_ids))
        self.enqueue(req)
        return req

    def has_work(self) -> bool:
        return self.has_unfinished()

    def forget_finished(self) -> None:
        """Nothing kept after a request ends (the cluster keeps its halves until told)."""

    def close(self) -> None:
        """Nothing to stop (a cluster stops its link and processes)."""

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def run_until_done(self, progress: Callable[[int], None] | None = None) -> None:
        while self.has_unfinished():
            done = self.step()
            if progress and done:
                progress(len(done))

    def generate(self, prompts: Iterable[str | list[int]], sampling: SamplingParams | None = None,
                 tenant: str = "default") -> list[Request]:
        reqs = [self.add_request(p, sampling, tenant) for p in prompts]
        self.run_until_done()
        return reqs

    def text(self, req: Request) -> str:
        return self.tokenizer.decode(req.output_ids) if self.tokenizer else ""
