"""The OpenAI server on Ray Serve: N engine replicas behind one ingress, prefix-affine routing.

    Ray's HTTP proxy -> Ingress (Starlette, webapp.ray_ingress: auth, parse, admission, SSE,
                        metrics, errors: the single-process server's functions)
                     -> EngineReplica x N (one Engine each; streams its events back)

Why an ASGI ingress and not the Flask app behind a WSGI adapter: Ray's proxy speaks ASGI, the
ingress awaits a DeploymentHandle per request, and thousands of open streams then cost one
event loop rather than a thread each (a WSGI adapter would park a thread per stream in a
blocking ``.result()``). The protocol itself is not written twice: both front-ends call
webapp.protocol (parsing), webapp.generation (auth, admission, ids, bodies), webapp.sse (the
chunks), webapp.errors and webapp.metrics.

Why two deployments rather than the proxy talking to the engine replicas directly: the proxy
routes before the body is read, so it cannot see the prompt; the ingress parses it and routes
through the engine deployment's handle, whose request router (webapp.ray_router) sees the
parsed request. It is also where a replica's failure becomes an in-band SSE error.

An engine replica is built from an ``EngineSpec`` (an importable factory and its keyword
arguments), never from a pickled engine: each replica loads its own model.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
from dataclasses import dataclass, field

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from . import embeddings, errors, generation
from .errors import APIError
from .ray_ingress import build_app
from .ray_messages import StreamEnd, StreamHead

log = logging.getLogger("webapp")

ROUTING_STATS_PERIOD_S = 1.0  # how often Ray polls each replica's engine stats (routing, /metrics)
HEALTH_CHECK_PERIOD_S = 2.0
CONSTRUCTOR_RETRIES = 1  # a replica whose model will not load fails the deployment, no restart loop
# A replica sends a stream's events at most once per this interval (the first at once): each Ray
# streaming item costs ~0.5-1 ms of CPU per hop, more than a token of a host-bound model.
# A real model's tokens are further apart than this, so they still travel one by one.
STREAM_INTERVAL_S = 0.01
INGRESS_EXTRA_REQUESTS = 8  # ingress slots beyond the generation bound: /health, /metrics, 429s
INGRESS_QUEUE = 64  # requests the proxy holds for a busy ingress before its own 429


@dataclass(frozen=True)
class EngineSpec:
    """How a replica builds its engine: ``factory`` ("module:function") called with ``kwargs``."""

    factory: str = "webapp.ray_serve:pretrained_engine"
    kwargs: dict = field(default_factory=dict)
    model_name: str = "default"

    def build(self):
        module_name, _, attr = self.factory.partition(":")
        if not module_name or not attr:
            raise ValueError(f"factory must be 'module:function', got {self.factory!r}")
        return getattr(importlib.import_module(module_name), attr)(**self.kwargs)


def pretrained_engine(model: str | None = None, **options):
    """The default factory: ``Engine.from_pretrained(model, **options)``."""
    import engine

    return engine.Engine.from_pretrained(model, **options)


class EngineReplica:
    """One Engine. ``generate`` streams webapp.ray_messages: a StreamHead (or an APIError), then
    lists of StreamEvents that arrived together (streamed requests) or one list of Completions (the
    engine's fold), then a StreamEnd; an APIError instead when the engine fails mid-way."""

    def __init__(self, spec: EngineSpec, stream_interval_s: float = 0.0):
        self.engine = spec.build()
        self.stream_interval_s = stream_interval_s
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        log.info("replica %s ready: %r", self.replica_id, self.engine)

    def info(self) -> dict:
        return {"max_model_len": self.engine.max_model_len, "replica_id": self.replica_id}

    async def generate(self, req):
        try:
            stream = generation.asubmit(self.engine, req)
        except APIError as err:
            yield err
            return
        try:
            yield StreamHead(stream.request_id, generation.num_prompt_tokens(stream, req.params.n),
                             generation.echo_texts(self.engine.tokenizer, req), self.replica_id)
            if not req.is_stream:
                yield await stream.collect_choices()
                yield StreamEnd(stream.queue_time)
                return
            loop = asyncio.get_running_loop()
            sent_at = None
            async for event in stream:
                if sent_at is not None and self.stream_interval_s > 0:  # coalesce: one Ray item per interval
                    wait_s = sent_at + self.stream_interval_s - loop.time()
                    if wait_s > 0:
                        await asyncio.sleep(wait_s)
                later = stream.ready_events()
                yield [event, *later] if later else [event]
                sent_at = loop.time()
            yield StreamEnd(stream.queue_time)
        except Exception as exc:  # the engine failed mid-stream: the ingress writes it in-band
            yield errors.from_exception(exc)
        finally:
            stream.close()  # a cancelled request (the client left) is aborted here

    def tokenize(self, body: dict) -> dict | APIError:
        try:
            return generation.tokenize_body(self.engine.tokenizer, body, self.engine.max_model_len)
        except APIError as err:
            return err

    async def embeddings(self, body: dict, kind: str, model_name: str) -> dict | APIError:
        """/v1/embeddings, /v1/rerank, /score on this replica's engine (webapp.embeddings)."""
        try:
            return await embeddings.arespond(self.engine, body, kind, model_name)
        except APIError as err:
            return err
        except Exception as exc:
            return errors.from_exception(exc)

    def detokenize(self, body: dict) -> dict | APIError:
        try:
            return generation.detokenize_body(self.engine.tokenizer, body)
        except APIError as err:
            return err

    def is_alive(self) -> bool:
        return self.engine.is_alive()

    def check_health(self) -> None:
        """Ray calls this every HEALTH_CHECK_PERIOD_S: a dead engine thread gets the replica replaced."""
        if not self.engine.is_alive():
            raise RuntimeError(f"engine thread of {self.replica_id} stopped")

    def record_routing_stats(self) -> dict:
        """Polled by Ray every ROUTING_STATS_PERIOD_S; the ingress sums them into /metrics."""
        return {**self.engine.stats(), "is_alive": self.engine.is_alive(), "replica_id": self.replica_id}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


@serve.ingress()
class Ingress:
    """The HTTP side (an ASGI app built on the replica: webapp.ray_ingress.build_app)."""

    def __init__(self, engine_handle, options: dict):
        self.engine_handle = engine_handle
        self.options = options

    def __serve_build_asgi_app__(self):
        return build_app(self.engine_handle, **self.options)


def build_deployment(spec: EngineSpec, num_replicas: int = 1, max_ongoing_requests: int | None = None,
                     max_queued_requests: int | None = None, num_cpus_per_replica: float = 1.0,
                     api_key: str | None = None, max_concurrent_requests: int | None = None,
                     prefix_routing: bool = True, stream_interval_s: float = STREAM_INTERVAL_S):
    """The Ray Serve application (pass it to ``serve.run``).

    Per replica, ``max_ongoing_requests`` (default: the engine's max_num_seqs) run at once;
    ``max_queued_requests`` (default: as many again per replica) more wait in the ingress's
    router; one beyond that is a 429 with Retry-After, as is one beyond the ingress's own
    ``max_concurrent_requests`` (the single-process server's bound; default: running + queued,
    so the replicas' limits bind first).
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"ray replicas must be a positive integer, got {num_replicas!r}")
    if max_ongoing_requests is None:
        from engine.config import EngineConfig

        max_ongoing_requests = int(spec.kwargs.get("max_num_seqs") or EngineConfig().max_num_seqs)
    if max_queued_requests is None:
        max_queued_requests = max_ongoing_requests * num_replicas
    if max_concurrent_requests is None:
        max_concurrent_requests = max_ongoing_requests * num_replicas + max_queued_requests
    # By import path: Ray ships the class to the ingress. prefix_routing=False keeps the router (its
    # least-loaded fallback and the replicas' stats for /metrics) without the affinity.
    router_config = RequestRouterConfig(request_router_class="webapp.ray_router.PrefixAffinityRouter",
                                        request_router_kwargs={"is_affine": prefix_routing},
                                        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    engines = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests, max_queued_requests=max_queued_requests,
        ray_actor_options={"num_cpus": num_cpus_per_replica},
        health_check_period_s=HEALTH_CHECK_PERIOD_S, max_constructor_retry_count=CONSTRUCTOR_RETRIES,
        request_router_config=router_config,
    ).bind(spec, stream_interval_s)
    options = {"model_name": spec.model_name, "api_key": api_key, "max_concurrent_requests": max_concurrent_requests}
    ingress = serve.deployment(
        Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_concurrent_requests + INGRESS_EXTRA_REQUESTS, max_queued_requests=INGRESS_QUEUE,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        max_constructor_retry_count=CONSTRUCTOR_RETRIES,
    )
    return ingress.bind(engines, options)


APP_NAME = "llm-engine"


class DeployError(RuntimeError):
    """The application did not come up (a replica could not load its model, ...)."""


def deploy(spec: EngineSpec, host: str, port: int, app_name: str = APP_NAME, **options) -> None:
    """Start Serve's HTTP proxy on host:port (on a running Ray) and deploy the app; returns once it
    serves. A replica that fails to start fails the deployment (one retry): DeployError, not a hang."""
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(build_deployment(spec, **options), name=app_name, route_prefix=f"/{app_name}"
                  if app_name != APP_NAME else "/")
    except RuntimeError as exc:
        message = _failure_message(app_name) or str(exc)
        serve.delete(app_name)
        raise DeployError(message) from None


def _failure_message(app_name: str) -> str | None:
    """The failed deployment's status carries the replica's traceback: keep the line a user can act on
    (the exception's type and message)."""
    app = serve.status().applications.get(app_name)
    for name, deployment in (app.deployments.items() if app else ()):
        lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
        raised = [line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))]
        if raised:
            return f"{name} replica failed to start: {raised[-1]}"
    return None


def serve_on_ray(spec: EngineSpec, host: str, port: int, num_replicas: int, address: str | None = None,
                 **options) -> None:
    """``python -m webapp --ray-replicas N`` (a local Ray, started and stopped here) or
    ``--ray-address ADDR`` (an existing cluster: the app is deleted on exit, the cluster stays). Blocks."""
    import os
    import time

    import ray

    num_cpus_per_replica = float(spec.kwargs.get("num_threads") or 1)
    is_local = address is None
    if is_local:  # room for every replica, even on a small machine (they then share its cores)
        num_cpus = max(os.cpu_count() or 1, int(num_replicas * num_cpus_per_replica + 0.999))
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    else:
        ray.init(address=address)
    try:
        deploy(spec, host, port, num_replicas=num_replicas, num_cpus_per_replica=num_cpus_per_replica, **options)
        log.warning("serving on http://%s:%s (Ray Serve, %d engine replicas)", host, port, num_replicas)
        while True:
            time.sleep(3600)
    finally:
        if is_local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
