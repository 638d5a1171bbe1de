"""One settings object for every process, read from the environment (MMPIPE_*) or a .env file.

Nothing below this module reads the environment: stages, models and the store get a Settings
instance (or the part of it they need) passed in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, SecretStr, field_serializer, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from mmpipe.schemas.events import HIGH_PRIORITY, PRIORITY_LEVELS

BatchMode = Literal["dynamic", "static", "off"]


class BatchingSettings(BaseModel):
    """The two independent batching limits, plus the policy, for one model."""

    mode: BatchMode = "dynamic"
    max_batch_size: int = Field(8, ge=1, le=1024)
    max_wait_ms: float = Field(10.0, ge=0.0)
    # Static mode waits for a full batch; this is the safety valve for a lone item.
    static_timeout_ms: float = Field(1000.0, ge=0.0)
    # Bound of items waiting in the batcher (admission control inside the stage).
    max_queue: int = Field(256, ge=1)
    # Items of this priority or higher (0 = highest) skip the wait for a fuller batch: when the
    # model is free they run at once, in a batch of their own level unless a full batch is queued
    # (then that one, urgent items first, so no throughput is lost at saturation). None batches
    # every level alike.
    expedite_priority: int | None = Field(HIGH_PRIORITY, ge=0, le=PRIORITY_LEVELS - 1)
    # Those items run on a second model thread whenever it is free: beside a running batch, not
    # after it or inside a full one (streams/batching.py: the urgent slot), for models whose
    # predict allows two threads.
    urgent_slot: bool = True
    # The urgent slot's thread runs this many nice steps above the main model thread, so an
    # urgent batch beside a running batch gets most of the core they share instead of half
    # (needs CAP_SYS_NICE or RLIMIT_NICE room; without, an even split, logged). 0: even split.
    urgent_precedence_nice: int = Field(10, ge=0, le=20)


class SchedulingSettings(BaseModel):
    """Priority aging (streams/priority.py) and lag-aware routing onto `ready` (streams/routing.py)."""

    # One priority level is worth this much waiting: an item of priority p is overtaken only by
    # work that arrived less than (p - q) * aging_s after it (the starvation bound).
    aging_s: float = Field(1.0, gt=0)
    # Priority lanes: the highest level travels in topics of its own (events.high, decoded.high,
    # ready.high; streams/topics.py) so that it never queues behind a backlog in a FIFO topic.
    # Stages always read both lanes; False makes publishers use the main topics for every level.
    priority_lanes: bool = True
    # Routing: preprocess places each work item on the ready partition with the lowest expected
    # wait instead of the job ID's hash partition.
    routing: bool = False
    # Simulated over a replica slowed by t(4) per batch (mmpipe/harness/bench/simulate.py), a
    # 1 s window with a 3x escape let a choice run to 3x the best wait: p99 1.9x healthy at 16-20
    # jobs/s against 1.6x with these, which are no worse than no stickiness at all.
    route_sticky_s: float = Field(0.25, ge=0)  # keep a choice at least this long ...
    route_escape_ratio: float = Field(1.5, gt=1)  # ... unless another one is expected to wait this many times less
    route_hysteresis: float = Field(0.3, ge=0)  # switch only to a partition this much (relative) better
    route_min_gain_s: float = Field(0.05, ge=0)  # ... and at least this much (absolute)
    route_max_share: float = Field(0.75, gt=0, le=1)  # of the recent decisions, per partition
    route_share_window: int = Field(64, ge=1)  # decisions the share is measured over
    # Inference workers publish their state (partitions, readiness, models, service time) this
    # often; a state older than worker_state_stale_s counts as not ready.
    worker_state_interval_s: float = Field(0.5, gt=0)
    worker_state_stale_s: float = Field(3.0, gt=0)


class ContinuousSettings(BaseModel):
    """Iteration-level batching of autoregressive models (speech to text): sequences join and
    leave the running set at every decoder step; each reserves its whole KV cache on admission."""

    # continuous: join at every step; request: a batch runs until its longest sequence ends;
    # off: one sequence at a time.
    mode: Literal["continuous", "request", "off"] = "continuous"
    kv_cache_budget_bytes: int = Field(256 * 1024**2, ge=1)
    # On CUDA, when > 0: the budget is this share of the free device memory at start-up.
    kv_cache_gpu_fraction: float = Field(0.0, ge=0.0, le=0.95)
    # Bound of sequences waiting for a reservation; beyond it a sequence is rejected.
    max_queue: int = Field(64, ge=1)
    # Sequences joining at one step share one encoder pass of at most this many.
    max_join_per_step: int = Field(8, ge=1)
    # Most sequences in one decoder step: the cache gets no more slots than this, whatever the budget.
    max_sequences: int = Field(64, ge=1)


class KafkaSecurity(BaseModel):
    """Client security for a secured cluster; PLAINTEXT for the embedded broker."""

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MMPIPE_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
    )

    # Where every process keeps its local state (store, faust data, run logs, weights, reports):
    # the one place relative paths start from. Made absolute when settings load, so a child
    # process started elsewhere sees the same folder.
    state_dir: Path = Path("var")

    # --- Kafka ---------------------------------------------------------------------------
    bootstrap: str = "127.0.0.1:9092"
    topic_prefix: str = "mm"
    # Sent with every Kafka request; a stage process appends its stage name ("mmpipe-decode"),
    # so the broker's request metrics, logs and client quotas tell the stages apart.
    client_id: str = "mmpipe"
    partitions: int = Field(4, ge=1)
    replication: int = Field(1, ge=1)
    security: KafkaSecurity = KafkaSecurity()
    # Short group timeouts: a group joins in ~3 s and rebalances in ~4 s on the embedded broker.
    session_timeout_s: float = 6.0
    heartbeat_interval_s: float = 1.0
    rebalance_timeout_s: float = 5.0
    # The embedded broker holds a fetch for its whole max wait even when data is there,
    # so this bounds per-hop latency when traffic is light.
    fetch_max_wait_ms: int = 20
    # An idle stage consumer (no records for fetch_idle_after_s) doubles that wait per empty
    # fetch up to this, and drops back on the first records: idle stages stop polling 50 times
    # a second, and the first job after a quiet spell pays up to about this much per hop.
    fetch_idle_max_wait_ms: int = Field(500, ge=1)
    fetch_idle_after_s: float = Field(1.0, ge=0.0)
    # Stages fed by other stages on this machine fetch when an upstream stage signals a record
    # (streams/wakeup.py) instead of polling every fetch_max_wait_ms; a consumer that is not
    # signalled fetches after this fallback, and records that arrive unannounced switch it back
    # to polling. Off: plain polling (no gain on Apache Kafka, which long-polls).
    fetch_wakeups: bool = True
    fetch_wake_fallback_ms: int = Field(200, ge=1)
    # faust runs each consumer on a thread with an event loop of its own and hands every fetch
    # across; off, the consumer shares the stage's loop (streams/transport.py, change 7).
    consumer_in_thread: bool = False
    # Each stage process's event loop: uvloop (libuv, in C) spends less CPU per message than
    # asyncio's own loop, written in Python; "asyncio" runs the standard one.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    commit_interval_s: float = 0.5
    max_message_bytes: int = 32 * 1024 * 1024
    # One record per producer batch. The embedded broker (Tansu) answers ListOffsets with the
    # last batch's base offset + 1, so with multi-record batches every lag read-out would be
    # wrong; single-record batches keep it exact. Apache Kafka is right either way: set False
    # there to let producers batch.
    single_record_batches: bool = True
    # Lag read-outs take end offsets from a fetch past each partition's end (its answer carries
    # the high watermark) instead of ListOffsets, which the embedded broker answers by listing
    # every batch the partition ever stored: 0.5 ms of its CPU at 100 records, 18-22 at 30,000
    # (streams/kafka.py high_watermarks). A broker that refuses such a fetch (Apache Kafka) gets
    # ListOffsets after the first try; compose sets it false.
    end_offsets_from_fetch: bool = True
    # Status reports ("decoding", "preprocessing") are a live view, sent coalesced: one record
    # per stage process per this many seconds (streams/status.py), not one per job.
    status_flush_s: float = Field(0.1, ge=0.0)

    # --- Backpressure and admission -----------------------------------------------------
    # In-flight items per assigned partition: pause the partition at `high`, resume at `low`.
    inflight_high_per_partition: int = Field(32, ge=1)
    inflight_low_per_partition: int = Field(8, ge=0)
    # Hard cap of in-flight items per stage process: the agent waits when it is reached.
    max_inflight: int = Field(256, ge=1)
    # Bound on the next stage's lag (messages per partition of this stage's output topic):
    # beyond `high` this stage pauses the matching input partition, below `low` it resumes.
    downstream_lag_high: int = Field(256, ge=1)
    downstream_lag_low: int = Field(64, ge=0)
    # Records handed over per fetch: what still arrives after a partition is paused.
    max_poll_records: int = Field(64, ge=1)
    # Faust's own per-topic buffer; when it fills faust stops fetching the partition.
    stream_buffer_maxsize: int = Field(64, ge=1)
    # Admission at the decode stage: with policy "reject", while more than max_backlog events
    # wait in front of it, it answers the oldest as "rejected" (cheap, no work) so the queue
    # and the latency of admitted jobs stay bounded; with "defer" jobs just wait in Kafka.
    max_backlog: int = Field(10_000, ge=1)
    admission_policy: Literal["reject", "defer"] = "reject"
    memory_budget_bytes: int = 2 * 1024**3

    # --- Retries ------------------------------------------------------------------------
    max_retries: int = Field(3, ge=0)
    retry_backoff_s: float = 0.2
    retry_backoff_max_s: float = 5.0
    # A message whose processing killed its stage this many times (running alone) goes to the
    # dead-letter topic as crashed_stage instead of crash-looping (streams/poison.py).
    poison_max_crashes: int = Field(3, ge=1)

    # --- Input --------------------------------------------------------------------------
    max_payload_bytes: int = 16 * 1024 * 1024
    input_roots: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [Path.cwd()])
    allow_remote_uris: bool = False
    default_deadline_s: float = 300.0

    # --- Decode -------------------------------------------------------------------------
    decode_workers: int = Field(2, ge=1)
    decode_threads: int = Field(1, ge=0)  # codec threads per decode; 1 = predictable CPU use
    # Frames leave decode cut to the model's centre crop where its DecodeHints ask for one
    # (a 256x341 frame travels as 224x224: 43 % fewer bytes on the decoded topic); off, whole
    # scaled frames travel and preprocess crops them (the same pixels either way).
    decode_center_crop: bool = True
    # Decode runs preprocess's transform itself and feeds inference (streams/topology.py:
    # FUSED_PIPELINE): no `decoded` topic hop, no preprocess process. For a host that runs
    # both stages anyway; apart (the default, and compose) each scales on its own.
    fuse_preprocess: bool = False
    # Apart, decode places the parts it already made model-ready (an image or video frame cut
    # to the model's crop: preprocess would only copy it) straight onto `ready`, and only the
    # parts that need the transform (audio windows, text, uncut frames) take the `decoded` hop
    # (streams/topology.py: BYPASS_PIPELINE). Off, every part goes through preprocess.
    preprocess_bypass: bool = True
    video_sample_fps: float = Field(1.0, gt=0)
    video_max_frames: int = Field(16, ge=1)
    audio_max_seconds: float = Field(600.0, gt=0)
    # Untrusted media: what a video may declare or hold, and each decode worker's budget
    # (a process of its own; over the budget the part is refused, the stage stays up).
    video_max_seconds: float = Field(600.0, gt=0)
    video_max_source_frames: int = Field(36_000, ge=1)
    decode_timeout_s: float = Field(30.0, gt=0)
    decode_memory_limit_bytes: int = Field(1024**3, ge=256 * 1024**2)

    # --- Models and inference -----------------------------------------------------------
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    torch_threads: int = Field(0, ge=0)  # 0 = leave torch's default
    # Run models that offer it as a frozen graph (TorchScript) on the CPU: one call that holds
    # no GIL, so the inference stage's event loop cannot stall the model between layers
    # (models/torch_util.py). False keeps every model eager.
    graph_mode: bool = True
    # Cores for the inference stage's model thread alone; every other pipeline thread (the
    # embedded broker, each stage, the inference stage's event loop) runs on the rest.
    # Empty: no pinning. E.g. MMPIPE_MODEL_CPUS=1 on a 2-core machine (see streams/affinity.py).
    model_cpus: Annotated[list[int], NoDecode] = Field(default_factory=list)
    models: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["resnet18", "silero-vad", "all-minilm-l6-v2", "whisper-tiny-en"])
    weights_dir: Path | None = None  # default: <state_dir>/weights
    allow_random_weights: bool = False
    batching: dict[str, BatchingSettings] = Field(default_factory=dict)
    default_batching: BatchingSettings = BatchingSettings()
    continuous: ContinuousSettings = ContinuousSettings()
    inference_workers: int = Field(2, ge=1)  # CPU workers for preprocess
    # Fault injection for benchmarks and tests (a degraded replica): extra time per batch.
    inject_execute_delay_ms: float = Field(0.0, ge=0.0)
    # Named crash points armed for fault runs and tests (streams/faults.py); none in production.
    fault_points: Annotated[list[str], NoDecode] = Field(default_factory=list)
    scheduling: SchedulingSettings = SchedulingSettings()

    # --- Sink ---------------------------------------------------------------------------
    # default: sqlite:///<state_dir>/results.db. May hold a password: a SecretStr (its str()
    # is masked), shown only through redact_url, written out only by write_settings.
    store_url: SecretStr = Field(SecretStr(""), repr=False)

    # --- Observability ------------------------------------------------------------------
    metrics_port: int = 0  # 0 = no metrics server; `up` gives each stage its own port
    # All interfaces by default (a container's port must be reachable from outside it);
    # local tools such as the benchmark bind loopback only.
    metrics_host: str = "0.0.0.0"
    # Lag read-out, downstream bound and admission refresh. Each read-out is a fetch and an
    # OffsetFetch per group read (decode reads three): at 0.5 s they were 0.45 of a job's six
    # requests at saturation (benchmarks/broker_requests.py).
    lag_interval_s: float = 1.0
    # While the stage fetched nothing since a read-out that found no lag anywhere, the lag
    # cannot have grown unseen by more than what the next fetch brings: read it this often.
    lag_idle_interval_s: float = Field(10.0, ge=0.0)
    log_level: str = "warn"

    # --- Job API --------------------------------------------------------------------------
    # None or empty: no auth, and then `mmpipe api` serves loopback only (unless --insecure).
    api_token: SecretStr | None = None
    api_docs: bool = True  # /docs, /redoc and /openapi.json; False turns them off
    api_max_concurrency: int = Field(512, ge=1)  # connections+tasks at once; beyond: 503
    api_max_upload_bytes: int = Field(16 * 1024 * 1024, ge=1)
    # Sync /v1/predict: the wait when a request names none, the most a request may ask for,
    # and how many requests may wait at once (beyond it: 503 + Retry-After, use /v1/jobs).
    api_predict_timeout_s: float = Field(10.0, gt=0)
    api_predict_max_timeout_s: float = Field(60.0, gt=0)
    api_max_sync_waiters: int = Field(256, ge=1)

    @field_validator("input_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.split(":") if p]
        return value

    @field_validator("model_cpus", mode="before")
    @classmethod
    def _split_cpus(cls, value: object) -> object:
        if isinstance(value, str):
            return [int(c) for c in value.replace(" ", "").split(",") if c]
        return value

    @field_validator("models", "fault_points", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value

    @field_serializer("store_url", when_used="json")
    def _store_url_redacted(self, url: SecretStr | str) -> str:
        return redact_url(url)  # JSON dumps are for people; write_settings dumps the real one

    @model_validator(mode="after")
    def _paths_under_state_dir(self) -> Settings:
        self.state_dir = self.state_dir.absolute()
        if self.weights_dir is None:
            self.weights_dir = self.state_dir / "weights"
        if not secret(self.store_url):
            self.store_url = SecretStr(f"sqlite:///{self.state_dir / 'results.db'}")
        return self

    def state_path(self, *parts: str) -> Path:
        """A path under the state directory (not created)."""
        return self.state_dir.joinpath(*parts)

    def batching_for(self, model_name: str) -> BatchingSettings:
        return self.batching.get(model_name, self.default_batching)


SETTINGS_FILE_ENV = "MMPIPE_SETTINGS_FILE"


def load_settings() -> Settings:
    """Settings from MMPIPE_SETTINGS_FILE (JSON, written by a parent process such as `up`),
    else from the environment / .env. Values in the file win over the environment."""
    path = os.environ.get(SETTINGS_FILE_ENV)
    if path:
        return Settings(**json.loads(Path(path).read_text()))
    return Settings()


def write_settings(settings: Settings, path: Path) -> Path:
    """Settings for a child process, secrets included: so the file is made readable by its
    owner only (0600) before anything is written to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_revealed(settings.model_dump(exclude_none=True)), default=str)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # also when the file was there before, with other permissions
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _revealed(value: object) -> object:
    """model_dump output with SecretStr values written out (JSON dumps would mask them)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {key: _revealed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_revealed(item) for item in value]
    return value


def secret(value: SecretStr | str | None) -> str | None:
    """The plain value of an optional secret, for the one place that must use it (a plain str
    comes from model_copy(update=...), which does not validate)."""
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def redact_url(store_url: SecretStr | str) -> str:
    """A connection URL fit for logs and screens: its password replaced by ***."""
    from urllib.parse import urlsplit, urlunsplit

    url = secret(store_url) or ""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))
