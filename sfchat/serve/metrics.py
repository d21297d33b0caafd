"""The server's Prometheus metrics (``GET /metrics``), on a registry of their own.

Contract
--------
``ServerMetrics(k)`` holds every series the server exports; the HTTP layer counts requests
(``request(route, code)``), the connection gate and the app's limits what they refuse
(``refused(reason)``), the generation thread reports each round, each finished reply and each
``LinkState`` (``round``, ``reply``, ``link``), and ``render()`` gives the Prometheus text
exposition format. Each instance has its own ``CollectorRegistry``, so that two servers in one
process (the tests) never share figures. prometheus_client is thread-safe: any thread may call.

Series (counters carry the ``_total`` suffix in the output):

* ``sfchat_http_requests_total{route, code}``: every HTTP answer, 429 and 4xx included;
* ``sfchat_http_refused_total{reason}``: connections closed and requests refused by a limit:
  ``idle_timeout``, ``header_timeout``, ``client_connections``, ``connections`` (``gate``),
  ``framing``, ``body_timeout``, ``client_bodies``, ``bodies``, ``client_requests``, ``requests``
  (``app``);
* ``sfchat_generations_total{finish_reason}``: replies by stop / length / cancelled / failed;
* ``sfchat_prompt_tokens_total``, ``sfchat_prompt_cached_tokens_total`` (KV reused),
  ``sfchat_completion_tokens_total``;
* histograms ``sfchat_reply_tokens_per_second``, ``sfchat_time_to_first_token_seconds`` (per
  reply, from the start of its generation), ``sfchat_tokens_per_round`` and
  ``sfchat_round_trip_seconds`` (per speculative round: round time less compute);
* gauges ``sfchat_queue_depth`` (requests waiting), ``sfchat_generating`` (0 or 1),
  ``sfchat_http_requests_in_progress`` (HTTP requests past the key check, not yet answered);
* ``sfchat_link_state`` (an Enum: local, waiting, connected, stalled, reconnecting, closed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, disable_created_metrics, generate_latest

LINK_STATES = ["local", "waiting", "connected", "stalled", "reconnecting", "closed"]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, k: int = 8):
        disable_created_metrics()  # no *_created series beside every counter: noise for a scraper
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sfchat_http_requests", "HTTP requests answered, by route and status code",
                                ["route", "code"], registry=r)
        self.refusals = Counter("sfchat_http_refused", "Connections closed and requests refused by a limit, by reason",
                                ["reason"], registry=r)
        self.generations = Counter("sfchat_generations", "Replies generated, by finish reason",
                                   ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("sfchat_prompt_tokens", "Prompt tokens of generated replies", registry=r)
        self.cached_tokens = Counter("sfchat_prompt_cached_tokens",
                                     "Prompt tokens whose KV cache was reused from the previous request", registry=r)
        self.completion_tokens = Counter("sfchat_completion_tokens", "Tokens generated", registry=r)
        self.tps = Histogram("sfchat_reply_tokens_per_second", "Decode speed of each reply (tokens/s)",
                             buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000), registry=r)
        self.ttft = Histogram("sfchat_time_to_first_token_seconds",
                              "Time from the start of a reply's generation to its first round",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.tokens_per_round = Histogram("sfchat_tokens_per_round", "Tokens committed per speculative round",
                                          buckets=tuple(range(1, max(k, 1) + 2)), registry=r)
        self.rtt = Histogram("sfchat_round_trip_seconds",
                             "Round time less draft, head and tail compute (the link's share)",
                             buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.queue_depth = Gauge("sfchat_queue_depth", "Requests waiting for the generation thread", registry=r)
        self.generating = Gauge("sfchat_generating", "1 while a reply is being generated", registry=r)
        self.in_progress = Gauge("sfchat_http_requests_in_progress", "HTTP requests admitted and not yet answered",
                                 registry=r)
        self.link_state = Enum("sfchat_link_state", "State of the head-tail link", states=LINK_STATES, registry=r)
        self.link_state.state("local")

    def request(self, route: str, code: int) -> None:
        self.requests.labels(route=route, code=str(code)).inc()

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()

    def round(self, committed: int, rtt_ms: float) -> None:
        self.tokens_per_round.observe(committed)
        self.rtt.observe(max(rtt_ms, 0.0) / 1e3)

    def reply(self, finish_reason: str, prompt_tokens: int = 0, cached_tokens: int = 0, completion_tokens: int = 0,
              tps: float | None = None, ttft_s: float | None = None) -> None:
        self.generations.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.completion_tokens.inc(completion_tokens)
        if tps is not None:
            self.tps.observe(tps)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)

    def link(self, state: str) -> None:
        if state in LINK_STATES:
            self.link_state.state(state)

    def render(self) -> bytes:
        return generate_latest(self.registry)
