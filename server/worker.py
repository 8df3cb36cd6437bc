"""The model's thread: one continuous batch that every request joins.

HTTP handlers run on the event loop; the model runs here, on a thread of its own, so a decode
step never blocks the server from accepting, streaming or refusing requests. Handlers hand a Job
in (submit) and take it out (cancel, when the client goes away); the thread picks both up between
steps, and sends each job its text, piece by piece, through the job's asyncio queue.
"""

import asyncio
import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cli import AnswerText
from engine.logit_rules import TokenLogprobs
from engine.scheduler import ContinuousBatch, Request
from errors import UserError
from server.metrics import Metrics

log = logging.getLogger("serve")


@dataclass
class Finished:
    """A job's last event: why it ended, and what it cost."""

    finish_reason: str  # "stop" (EOS or a stop string) or "length" (its max_tokens)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt's, found in the prefix cache


@dataclass
class Piece:
    """Some of the answer's text, and the log-probabilities of the tokens since the last piece (if asked)."""

    text: str
    logprobs: list[TokenLogprobs]


@dataclass
class Failed:
    """The job could not be answered."""

    message: str
    status: int  # what a whole answer's HTTP status is: 400 (the request cannot run), 500 (the engine failed), 504 (past --timeout)


@dataclass
class Job:
    request: Request
    text: AnswerText
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Pieces, then a Finished or a Failed
    key: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of the tokens whose text is held back
    started: float = field(default_factory=time.perf_counter)
    last_token: float = 0.0  # when its latest token came out
    cached_tokens: int = 0  # of its prompt's, found in the prefix cache (known once it is admitted)

    def send(self, event: Piece | Finished | Failed) -> None:
        """From the model's thread: hand the event to the handler on the event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Busy(Exception):
    """Too many requests waiting: the client should retry later (429)."""


class NotReady(Exception):
    """The model is still loading, or has failed (503)."""


class Worker:
    """Owns the model's thread and its continuous batch. `start_batch` runs on that thread and
    returns the batch (it loads the model, which can take a while); until it has, requests get 503."""

    def __init__(
        self,
        start_batch: Callable[[Callable], ContinuousBatch],
        max_running: int,
        max_waiting: int,
        on_failed: Callable[[], None],
        metrics: Metrics,
        timeout_s: float | None = None,
    ):
        """on_failed: called from the model's thread if it fails (to stop the server); timeout_s: how
        long a request may run or wait before it is ended (None: no limit)."""
        self.start_batch, self.limit, self.on_failed, self.metrics = start_batch, max_running + max_waiting, on_failed, metrics
        self.timeout_s = timeout_s
        self.batch: ContinuousBatch | None = None
        self.state = "starting"  # then "ready", or "failed"
        self.error: Exception | None = None
        self.jobs: dict[int, Job] = {}  # accepted and not ended
        self.inbox: list[tuple[str, Job]] = []  # ("add" | "cancel", job), for the thread to pick up between steps
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = False
        self.keys = itertools.count()
        self.served = self.cancelled = self.timed_out = self.prefix_hits = 0
        self.thread = threading.Thread(target=self._run, name="model", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Let the running jobs finish, then end the thread."""
        self.stopping = True
        self.wake.set()
        self.thread.join()

    def _ready_batch(self) -> ContinuousBatch:
        if self.batch is None or self.state != "ready":
            raise NotReady("the model is still loading" if self.state == "starting" else "the model failed; see the server's log")
        return self.batch

    def room(self, prompt_length: int) -> int:
        """The most new tokens a prompt of this length may ask for (< 1: none)."""
        return self._ready_batch().most_new_tokens(prompt_length)

    def check(self, request: Request) -> None:
        """A UserError if the request can never run (too long for a row, the pool or the model)."""
        self._ready_batch().check(request)

    def submit(self, job: Job) -> None:
        with self.lock:
            self._ready_batch()
            if len(self.jobs) >= self.limit:
                raise Busy(f"{len(self.jobs)} requests are running or waiting, the most this server takes; retry later")
            job.key = next(self.keys)
            self.jobs[job.key] = job
            self.inbox.append(("add", job))
        self.wake.set()

    def cancel(self, job: Job) -> None:
        """The client went away: the job leaves its row (or the queue) before the next step."""
        with self.lock:
            if job.key in self.jobs:
                self.inbox.append(("cancel", job))
        self.wake.set()

    def stats(self) -> dict:
        batch = self.batch
        running = 0 if batch is None else len(batch.running())
        return {
            "state": self.state,
            "running": running,
            "waiting": len(self.jobs) - running,
            "free_blocks": 0 if batch is None else batch.session.cache.blocks.n_free,
            "pool_blocks": 0 if batch is None else batch.pool_blocks,
            "kv_peak_bytes": 0 if batch is None else batch.session.session.kv_peak_bytes,
            "most_running": 0 if batch is None else batch.most_rows,
            "served": self.served,
            "cancelled": self.cancelled,
            "timed_out": self.timed_out,
            "prefix_cache_hit_tokens": self.prefix_hits,
        }

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                self.batch = self.start_batch(self._on_tokens)
                self.state = "ready"
                log.info("ready")
                self._loop()
        except UserError as e:  # the checkpoint or an option is wrong: one line, as the other scripts say it
            self.state, self.error = "failed", e
            self.on_failed()
        except Exception as e:
            self.state, self.error = "failed", e
            log.error("the model's thread failed:\n%s", traceback.format_exc())
            self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
            self.on_failed()

    def _loop(self) -> None:
        batch = self.batch
        while True:
            self._pick_up()
            if self.timeout_s is not None:
                self._expire()
            if not batch.busy():
                if self.stopping:
                    return
                self.wake.wait(timeout=1.0)
                self.wake.clear()
                continue
            batch.step()

    def _pick_up(self) -> None:
        with self.lock:
            inbox, self.inbox = self.inbox, []
        for kind, job in inbox:
            if kind == "add":
                try:
                    self.batch.add(job.key, job.request)
                except UserError as e:  # checked before submit; the batch says the same
                    self._end(job, Failed(str(e), 400))
            elif job.key in self.jobs:
                self._take_out(job)
                with self.lock:
                    self.jobs.pop(job.key, None)
                self.cancelled += 1
                self.metrics.finished("cancelled")
                log.info("request %d cancelled after %d tokens: the client went away", job.key, job.completion_tokens)

    def _take_out(self, job: Job) -> None:
        """The job leaves its row, or the queue, unfinished."""
        self.batch.cancel(job.key)
        self.batch.cached_tokens.pop(job.key, None)

    def _expire(self) -> None:
        """End the jobs that have run or waited past the time limit, before the next step."""
        now = time.perf_counter()
        with self.lock:
            late = [job for job in self.jobs.values() if now - job.started > self.timeout_s]
        for job in late:
            self._take_out(job)
            self.timed_out += 1
            self.metrics.finished("timeout")
            log.info("request %d timed out after %.1f s and %d tokens", job.key, now - job.started, job.completion_tokens)
            self._end(job, Failed(f"the request ran past the server's time limit of {self.timeout_s:g} s (--timeout) after {job.completion_tokens} tokens; ask for fewer", 504))

    def _on_tokens(self, news: dict[int, int | None]) -> list[int]:
        """The batch's news: each job's next piece of text, or its end. Returns the jobs a stop string ended."""
        stopped = []
        wanting = {key: token for key, token in news.items() if token is not None and key in self.jobs and self.jobs[key].request.rules.top_logprobs is not None}
        logprobs = self.batch.logprobs(wanting) if wanting else {}
        for key, token in news.items():
            job = self.jobs.get(key)
            if job is None:
                continue
            if token is None:
                self._finish(job)
                continue
            self._count(job)
            job.completion_tokens += 1
            if key in logprobs:
                job.logprobs.append(logprobs[key])
            self._send_text(job, job.text.push(token))
            if job.text.stopped:
                stopped.append(key)
        return stopped

    def _count(self, job: Job) -> None:
        now, metrics = time.perf_counter(), self.metrics
        if job.completion_tokens == 0:
            self._admitted(job)
            metrics.ttft.observe(now - job.started)
        else:
            metrics.inter_token.observe(now - job.last_token)
        metrics.generated_tokens.inc()
        job.last_token = now

    def _admitted(self, job: Job) -> None:
        """Its prompt is in the cache: count it, and what the prefix cache held of it."""
        job.cached_tokens = self.batch.cached_tokens.pop(job.key, 0)
        self.metrics.prompt_tokens.inc(len(job.request.prompt))
        self.metrics.prefix_hits.inc(job.cached_tokens)
        self.prefix_hits += job.cached_tokens

    def _send_text(self, job: Job, text: str, last: bool = False) -> None:
        """Send a piece of text with the log-probabilities of every token since the last piece
        (the last piece: whatever is left, even with no text)."""
        if text or (last and job.logprobs):
            job.send(Piece(text, job.logprobs))
            job.logprobs = []

    def _finish(self, job: Job) -> None:
        if job.completion_tokens == 0:  # it ended with its first token
            self._admitted(job)
        self._send_text(job, job.text.flush(), last=True)
        limit_reached = job.completion_tokens == job.request.max_new_tokens and not job.text.stopped
        self.served += 1
        seconds = time.perf_counter() - job.started
        log.info("request %d: %d prompt tokens, %d new tokens in %.1f s", job.key, len(job.request.prompt), job.completion_tokens, seconds)
        finish_reason = "length" if limit_reached else "stop"
        self.metrics.finished(finish_reason)
        self._end(job, Finished(finish_reason, len(job.request.prompt), job.completion_tokens, job.cached_tokens))

    def _end(self, job: Job, event: Finished | Failed) -> None:
        with self.lock:
            self.jobs.pop(job.key, None)
        job.send(event)

    def _fail_all(self, message: str) -> None:
        with self.lock:
            jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            job.send(Failed(message, 500))
