"""Batched generation with a KV cache on a transformers causal LM, run by one background thread.

Why the design is this way:
- Requests are grouped by current sequence length, so prompts are never padded: every row of a batch
  sits at the same positions, and cached decoding then gives exactly the logits of a full forward.
- One worker thread owns the model for generation; `exclusive()` gives weight loading the model with
  no forward pass in flight (and, when not paused, waits for in-flight requests like SGLang's writer lock).
- Pause modes follow SGLang: `abort` finishes everything with an abort reason, `retract` re-queues
  running requests (recomputed from prompt + output so far after continue), `in_place` freezes the
  running batch with its cache. Requests submitted while paused are held, untouched by aborts.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dsv4rl.config.choices import choice
from dsv4rl.config.sglang_choices import PauseMode
from dsv4rl.engine.capture import ChoiceCapture
from dsv4rl.engine.sampling import SamplingParams, edit_logits, sample
from dsv4rl.faults import heartbeat
from dsv4rl.wire.seed import mix_seed

_DONE_LOCK = threading.Lock()  # GenRequest.done is made by a waiter and set by the generator thread

log = logging.getLogger("dsv4rl.engine")

ABORT_RUNNING = "Aborted"
ABORT_WAITING = "Abort in waiting queue"
# A new batch waits until requests have stopped arriving for this long (at most BATCH_SETTLE_MAX_S): calls
# sent together then start together (`Generator._settling`).
BATCH_SETTLE_S = 0.02
BATCH_SETTLE_MAX_S = 0.1
DEFAULT_DETERMINISTIC_SEED = 42  # SGLang's seed for requests without sampling_seed (sampling_batch_info.py)


@dataclass
class GenRequest:
    """One sequence to generate; the worker fills the output fields and calls the listeners."""

    input_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False  # SGLang's return_routed_experts / routed_experts_start_len
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    captured: dict[str, list] = field(default_factory=dict)  # choices per forward (dsv4rl.engine.capture)
    internal: bool = False  # health checks: no rid bookkeeping in the seed counter
    submission: int = 0  # the submit() call that queued it, and how many requests it queued
    submission_size: int = 1
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict | None = None
    weight_spans: list[list] = field(default_factory=list)  # [[version, start, end], ...]
    num_retractions: int = 0
    started: bool = False  # reached a running batch (decides the abort message and meta shape)
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    listeners: list[Callable[[], None]] = field(default_factory=list)
    _done: threading.Event | None = field(default=None, repr=False, compare=False)
    _abort: bool = False
    _generator: torch.Generator | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def done(self) -> threading.Event:
        """Set once the request has finished. Made on first use: only in-process callers (the warmup, the
        health check, benches) wait on it, and an event per sequence is a cost every large request paid."""
        with _DONE_LOCK:
            if self._done is None:
                self._done = threading.Event()
                if self.finished:
                    self._done.set()
            return self._done

    def _set_done(self) -> None:
        """After `finish_reason` is set: wake whoever waits on `done`."""
        with _DONE_LOCK:
            if self._done is not None:
                self._done.set()

    def sequence(self) -> list[int]:
        return self.input_ids + self.output_ids

    def notify(self) -> None:
        for listener in list(self.listeners):
            listener()


class Generator:
    """The request queue and the worker thread that runs prefill and decode on `model`."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 256,
        random_seed: int = 0,
        weight_version: str = "default",
        context_length: int | None = None,
        decode_text: Callable[[list[int], bool], str] | None = None,
        deterministic: bool = False,
        capture: ChoiceCapture | None = None,
    ) -> None:
        self.model = model
        self.capture = capture  # --enable-return-routed-experts / --enable-return-indexer-topk
        self.deterministic = deterministic
        self.max_batch_size = max_batch_size
        self.random_seed = random_seed
        self.weight_version = weight_version
        config = model.config
        eos = config.eos_token_id
        self.eos_ids: list[int] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.vocab_size: int = config.vocab_size
        self.context_length: int = context_length or config.max_position_embeddings
        self.decode_text = decode_text
        self._cond = threading.Condition()
        self._model_lock = threading.RLock()
        self._held: list[GenRequest] = []
        self._waiting: deque[GenRequest] = deque()
        self._running: list[GenRequest] = []
        self._rids: dict[str, GenRequest] = {}
        self._paused = False
        self._frozen = False  # the worker holds a batch, paused in place between two steps
        self._pause_mode: PauseMode | None = None
        self._writers = 0
        self._counter = 0
        self._submissions = 0  # submit() calls: the requests of one share its number
        self._split_calls = False  # a client sends concurrent calls: let them settle into one batch
        self._stop = False
        self.steps = 0  # forward passes run; health checks watch it move
        # Why no request may run now (the engine's memory is released), or None: submit refuses, queued
        # requests wait (`wake()` once it changes).
        self.admission: Callable[[], str | None] = lambda: None
        self._thread = threading.Thread(target=self._loop, name="dsv4rl-generator", daemon=True)
        self._thread.start()

    # ---- submission and control (any thread) ----

    def submit(self, requests: list[GenRequest]) -> None:
        """Queue requests (held while paused or while a weight update waits); rids must be new."""
        with self._cond:
            refused = self.admission()
            if refused:
                raise ValueError(refused)
            fresh: set[str] = set()
            for request in requests:
                if request.rid in self._rids or request.rid in fresh:
                    raise ValueError(f"Duplicate request ID: the rid {request.rid!r} is already in flight.")
                fresh.add(request.rid)
            self._submissions += 1
            for request in requests:
                request.submission, request.submission_size = self._submissions, len(requests)
                if not request.internal:
                    self._counter += 1
                request._generator = torch.Generator().manual_seed(self._seed(request))
                self._rids[request.rid] = request
                if self._paused or self._writers:
                    self._held.append(request)
                else:
                    self._waiting.append(request)
            self._cond.notify_all()

    def _seed(self, request: GenRequest) -> int:
        """SGLang's rule: without deterministic inference `sampling_seed` is ignored (a stream from the
        server seed); with it a request draws from its seed alone (42 when unset), so the `n` samples of
        one request, which share it, come out identical."""
        if not self.deterministic:
            return mix_seed(self.random_seed, self._counter)
        seed = request.params.sampling_seed
        return mix_seed(DEFAULT_DETERMINISTIC_SEED if seed is None else seed)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def frozen(self) -> bool:
        """Whether an in-place pause holds a running batch between two steps (no step is in flight)."""
        with self._cond:
            return self._frozen

    def pause(self, mode: PauseMode | str = PauseMode.abort) -> None:
        """Stop taking work; `abort` returns once the running batch has ended."""
        mode = choice(PauseMode, mode, "pause mode")
        with self._cond:
            self._paused = True
            self._pause_mode = mode
            if mode == PauseMode.abort:
                self._abort_matching(lambda r: True)
                self._cond.wait_for(lambda: not self._running)
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._pause_mode = None
            self._release_held()
            self._cond.notify_all()

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort queued and running requests whose rid starts with `rid` (all with abort_all)."""
        if not rid and not abort_all:
            return
        with self._cond:
            self._abort_matching(lambda r: abort_all or r.rid.startswith(rid))

    @property
    def model_lock(self) -> threading.RLock:
        """Held by every forward pass; hold it to read or write weights consistently."""
        return self._model_lock

    def set_weight_version(self, version: str) -> None:
        with self._model_lock:
            self.weight_version = version

    def busy(self) -> bool:
        """Whether requests hold cache state (flush refused): a live batch or queued, non-retracted work."""
        with self._cond:
            if self._running:
                return True
            return bool(self._waiting) and self._pause_mode != PauseMode.retract

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self.busy(), timeout=timeout)

    def num_requests(self) -> dict[str, int]:
        with self._cond:
            return {"held": len(self._held), "waiting": len(self._waiting), "running": len(self._running)}

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The model with no forward in flight; when not paused, first drain in-flight requests."""
        with self._cond:
            self._writers += 1
            self._cond.wait_for(lambda: self._paused or (not self._waiting and not self._running))
        try:
            with self._model_lock:
                yield
        finally:
            with self._cond:
                self._writers -= 1
                self._release_held()
                self._cond.notify_all()

    @contextmanager
    def idle_exclusive(self) -> Iterator[bool]:
        """Yields whether the generator is idle by SGLang's rule (no running batch; queued requests count
        only when not paused); when it is, no batch starts and no forward runs until the block ends."""
        with self._cond:
            idle = not self._running and (self._paused or not self._waiting)
            if idle:
                self._writers += 1  # new requests are held, as during a weight update
        if not idle:
            yield False
            return
        try:
            with self._model_lock:
                yield True
        finally:
            with self._cond:
                self._writers -= 1
                self._release_held()
                self._cond.notify_all()

    def wake(self) -> None:
        """Re-check `admission` for queued requests."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._abort_matching(lambda r: True)
            for request in self._held:
                self._finish(request, self._abort_reason(request))
            self._held.clear()
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # ---- internals (hold self._cond unless noted) ----

    def _release_held(self) -> None:
        if not self._paused and not self._writers and self._held:
            self._waiting.extend(self._held)
            self._held.clear()

    @staticmethod
    def _abort_reason(request: GenRequest) -> dict:
        if request.started:
            return {"type": "abort", "message": ABORT_RUNNING, "status_code": None, "err_type": None}
        return {"type": "abort", "message": ABORT_WAITING}

    def _abort_matching(self, match: Callable[[GenRequest], bool]) -> None:
        for request in [r for r in self._waiting if match(r)]:
            self._waiting.remove(request)
            self._finish(request, self._abort_reason(request))
        for request in self._running:
            if match(request):
                request._abort = True
        self._cond.notify_all()

    def _finish(self, request: GenRequest, reason: dict) -> None:
        request.finish_reason = reason
        request.finished_at = time.monotonic()
        self._rids.pop(request.rid, None)
        if request in self._running:
            self._running.remove(request)
        request._set_done()
        request.notify()
        self._cond.notify_all()

    def _settling(self) -> bool:
        """Whether to wait a moment before starting a batch (holding the lock's condition): batched calls
        that arrive together (a trainer scoring each group as it lands sends a step's work as several)
        start as one batch, not one batch each, since a batch runs to its end before the next starts. The
        wait lasts until no such call came for `BATCH_SETTLE_S`, at most `BATCH_SETTLE_MAX_S` after the
        first, and only once a client has been seen splitting its work so: a client that sends one call
        at a time, or one sequence per call (a judge's chat requests), never waits."""
        batched = [r for r in self._waiting if not r.internal and r.submission_size > 1]
        if not batched:
            return False
        if not self._split_calls:
            self._split_calls = len({r.submission for r in batched}) > 1
            if not self._split_calls:
                return False
        now = time.monotonic()
        newest = max(r.created for r in batched)
        oldest = min(r.created for r in batched)
        if now - newest >= BATCH_SETTLE_S or now - oldest >= BATCH_SETTLE_MAX_S:
            return False
        self._cond.wait(timeout=BATCH_SETTLE_S - (now - newest))
        return True

    def _take_batch(self) -> list[GenRequest]:
        length = len(self._waiting[0].sequence())
        batch = [r for r in self._waiting if len(r.sequence()) == length][: self.max_batch_size]
        for request in batch:
            self._waiting.remove(request)
            request.started = True
        self._running = list(batch)
        return batch

    # ---- the worker ----

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stop or (self._waiting and not self._paused and not self.admission())
                )
                if self._stop:
                    return
                if self._settling():
                    continue
                batch = self._take_batch()
            # The hang watchdog sees a batch in progress; health checks and warmup are no generate batch.
            # A generate batch's step is the weight version it samples with (the trainer's step whose
            # weights these are), so an injected fault can name one: `engine-1:generate:20`.
            work = "generate" if any(not r.internal for r in batch) else "health_check"
            version = self.weight_version
            step = int(version) if work == "generate" and version.isdigit() else None
            try:
                with heartbeat.busy(work, step):
                    self._run_batch(batch)
            except Exception as error:  # a crash must not strand the callers: end their requests
                log.exception("generation failed")
                with self._cond:
                    for request in batch:
                        if not request.finished:
                            self._finish(
                                request,
                                {
                                    "type": "abort",
                                    "message": f"Generation failed: {error}",
                                    "status_code": 500,
                                    "err_type": type(error).__name__,
                                },
                            )
            finally:
                with self._cond:
                    self._running = []
                    self._cond.notify_all()

    def _forward(
        self,
        batch: list[GenRequest],
        input_ids: torch.Tensor,
        cache: DynamicCache,
        keep: int = 1,
        prefill: bool = False,
    ) -> tuple[torch.Tensor, str]:
        """Logits of the last `keep` positions, and the weight version they were computed with."""
        with self._model_lock, torch.no_grad():
            output = self.model(
                input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=keep
            )
            version = self.weight_version
            if self.capture is not None:
                self.capture.after_forward(batch, prefill)
        self.steps += 1
        return output.logits.float(), version

    def _run_batch(self, batch: list[GenRequest]) -> None:
        cache = DynamicCache(config=self.model.config)
        need_input = [
            r.return_logprob and r.logprob_start_len >= 0 and r.input_logprobs is None for r in batch
        ]
        ids = torch.tensor([r.sequence() for r in batch], dtype=torch.long)
        length = ids.shape[1]
        # Input logprobs need the logits from the earliest requested start on (not the whole prompt).
        first = min(
            (r.logprob_start_len for r, need in zip(batch, need_input, strict=True) if need), default=None
        )
        keep = 1 if first is None else max(length - first, 1)
        logits, version = self._forward(batch, ids, cache, keep, prefill=True)
        for row, request in enumerate(batch):
            if need_input[row]:
                request.input_logprobs = self._input_logprobs(
                    logits[row], length - keep, request.input_ids, request.logprob_start_len
                )
        self._step(batch, logits[:, -1], version)
        while True:
            batch = self._drop_finished(self._control(batch), cache)
            if not batch:
                return
            ids = torch.tensor([[r.output_ids[-1]] for r in batch], dtype=torch.long)
            logits, version = self._forward(batch, ids, cache)
            self._step(batch, logits[:, -1], version)

    def _control(self, batch: list[GenRequest]) -> list[GenRequest]:
        """Apply aborts and pauses between steps; returns the batch to go on with ([] ends it)."""
        with self._cond:
            while True:
                for request in batch:
                    if request._abort and not request.finished:
                        self._finish(request, self._abort_reason(request))
                live = [r for r in batch if not r.finished]
                if not live or self._stop:
                    return []
                if self._paused and self._pause_mode == PauseMode.retract:
                    for request in reversed(live):
                        request.num_retractions += 1
                        request.started = False
                        self._waiting.appendleft(request)
                    self._running = []
                    self._cond.notify_all()
                    return []
                if self._paused and self._pause_mode == PauseMode.in_place:
                    self._frozen = True
                    self._cond.wait()
                    self._frozen = False
                    continue
                return batch

    @staticmethod
    def _drop_finished(batch: list[GenRequest], cache: DynamicCache) -> list[GenRequest]:
        """Remove finished rows from the batch and the cache (index_select on every cache layer)."""
        keep = [row for row, r in enumerate(batch) if not r.finished]
        if not keep:
            return []
        if len(keep) == len(batch):
            return batch
        cache.reorder_cache(torch.tensor(keep, dtype=torch.long))
        return [batch[row] for row in keep]

    @staticmethod
    def _input_logprobs(
        logits: torch.Tensor, offset: int, input_ids: list[int], start: int
    ) -> list[float | None]:
        """[None, log p(x[start+1] | x[:start+1]), ...]; `logits` [T, V] start at position `offset`."""
        if start >= len(input_ids):
            return []
        targets = torch.tensor(input_ids[start + 1 :], dtype=torch.long)
        logprobs = torch.log_softmax(logits[start - offset : len(input_ids) - 1 - offset], dim=-1)
        values = logprobs.gather(1, targets[:, None]).squeeze(1).tolist() if len(targets) else []
        return [None, *values]

    def _step(self, batch: list[GenRequest], logits: torch.Tensor, version: str) -> None:
        """Sample one token for every request in the batch and finish those that stop."""
        finished: list[tuple[GenRequest, dict]] = []
        live = [(row, r) for row, r in enumerate(batch) if r.params.max_new_tokens > len(r.output_ids)]
        for request in batch:
            if request.params.max_new_tokens <= len(request.output_ids):
                finished.append((request, {"type": "length", "length": request.params.max_new_tokens}))
        if live:
            rows = torch.tensor([row for row, _ in live], dtype=torch.long)
            picked = logits.index_select(0, rows)
            for index, (_, request) in enumerate(live):
                if request.params.needs_logit_edits:
                    edit_logits(picked[index], request.params, request.output_ids, self._stop_ids(request))
            tokens, logprobs = sample(picked, [r.params for _, r in live], [r._generator for _, r in live])
            for (_, request), token, logprob in zip(live, tokens.tolist(), logprobs.tolist(), strict=True):
                self._append(request, token, logprob, version)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    finished.append((request, reason))
        if finished:
            with self._cond:
                for request, reason in finished:
                    self._finish(request, reason)
        for _, request in live:
            if not request.finished:
                request.notify()

    def _stop_ids(self, request: GenRequest) -> list[int]:
        ids = list(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            ids += self.eos_ids
        return ids

    @staticmethod
    def _append(request: GenRequest, token: int, logprob: float, version: str) -> None:
        index = len(request.output_ids)
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        spans = request.weight_spans
        if spans and spans[-1][0] == version:
            spans[-1][2] = index + 1
        else:
            spans.append([version, index, index + 1])

    def _stop_reason(self, request: GenRequest, token: int) -> dict | None:
        params = request.params
        if len(request.output_ids) >= params.min_new_tokens:
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
                return {"type": "stop", "matched": token}
            if (params.stop or params.stop_regex) and self.decode_text is not None:
                text = self.decode_text(request.output_ids, params.skip_special_tokens)
                for stop in params.stop:
                    if stop and stop in text:
                        return {"type": "stop", "matched": stop}
                for pattern in params.stop_regex:
                    match = re.search(pattern, text)
                    if match:
                        return {"type": "stop", "matched": match.group(0)}
        if len(request.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        return None
