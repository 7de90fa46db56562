"""headwise on Ray Serve: N engine replicas behind one OpenAI endpoint.

Two deployments. `HeadwiseEngine` holds one LLMEngine per replica, run on a thread exactly
as `headwise serve` runs it (AsyncEngine). `HeadwiseIngress` serves the same FastAPI app as
`headwise serve` (create_app), over a RayEngineClient: the ingress validates and tokenizes,
and sends token ids to an engine replica chosen by PrefixAffinityRouter, which prefers the
replica already holding the prompt's prefix (headwise/server/ray_router.py over the
bookkeeping of headwise/server/routing.py).

    request -> Serve HTTP proxy -> HeadwiseIngress (create_app) -> PrefixAffinityRouter
            -> HeadwiseEngine replica (AsyncEngine -> LLMEngine) -> Updates streamed back

Importable for `serve run headwise.server.ray_serve:app_builder model=... replicas=2`
and for a Serve config file (docs/ray_serve.yaml).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle

from headwise.config import EngineConfig
from headwise.engine.llm_engine import LLMEngine
from headwise.engine.scheduler import QueueFullError
from headwise.sampling import SamplingParams
from headwise.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from headwise.server.async_engine import AsyncEngine
from headwise.server.engine_client import (EngineClient, EngineUnavailableError, RequestStream, ServedModel,
                                           ShuttingDownError, Update)
from headwise.server.ray_router import ROUTERS
from headwise.server.routing import block_hashes

APP_NAME = "headwise"
ENGINE = "HeadwiseEngine"
INGRESS = "HeadwiseIngress"
HEALTH_TIMEOUT_S = 10.0
REPLICA_HEALTH_CHECK_TIMEOUT_S = 30  # Serve's health check of a replica, and of its HTTP proxy
# A replica lost before it admitted a request: the request is sent again (Serve's router
# has dropped the dead replica by then), this many times in all.
ADMIT_ATTEMPTS = 3
# Serve logs every call at INFO (one line per request and per broadcast); warnings only.
QUIET = {"log_level": "WARNING", "enable_access_log": False}
log = logging.getLogger("headwise.ray")


@dataclass
class EngineRequest:
    """What the ingress sends a replica: checked token ids (the router reads block_hashes)."""
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    block_hashes: list[int]


# ---- the engine replica -------------------------------------------------------------

class EngineReplica:
    """One engine per Serve replica (the deployment `HeadwiseEngine`)."""

    def __init__(self, model: str, engine_options: dict[str, Any], max_queue: int | None) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model, engine_options))
        self.aeng = AsyncEngine(self.engine, max_queue)
        self.tag = serve.get_replica_context().replica_id.unique_id

    def info(self) -> ServedModel:
        return self.aeng.model

    async def generate(self, req: EngineRequest):
        """Yields None once the request is admitted (errors before that are raised to the
        caller), then its Updates; cancelled by the caller, it aborts the request."""
        stream = await self.aeng.submit(req.prompt_token_ids, req.params, req.request_id)
        done = False
        try:
            yield None
            while not done:
                u = await stream.queue.get()
                done = u.finished
                yield u
        finally:
            if not done:
                self.aeng.abort(stream)

    async def health(self) -> bool:
        return (await self.aeng.health())[0]

    async def metrics(self) -> tuple[str, str]:
        return self.tag, await self.aeng.metrics_text()

    async def reset_prefix_cache(self) -> int:
        return await self.aeng.reset_prefix_cache()

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose engine thread stopped is replaced."""
        if not self.aeng.alive:
            raise RuntimeError("the engine thread stopped")

    def __del__(self) -> None:
        if hasattr(self, "aeng"):
            self.aeng.close()


# ---- the ingress ----------------------------------------------------------------------

class _RemoteStream(RequestStream):
    def __init__(self, response) -> None:
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.response = response
        self.task: asyncio.Task | None = None


def _lost(e: BaseException) -> bool:
    return isinstance(e, (RayActorError, ActorUnavailableError, RayServeException))


def _failure(e: BaseException) -> Update:
    if _lost(e):
        return Update("", [], [], [], True, "abort", error=f"the engine replica serving this request was lost "
                      f"({type(e).__name__}); retry", error_status=503, error_code="replica_unavailable")
    return Update("", [], [], [], True, "abort", error=f"engine replica error: {type(e).__name__}: {e}")


class RayEngineClient(EngineClient):
    """EngineClient over the HeadwiseEngine deployment's handle."""

    def __init__(self, handle: DeploymentHandle, model: ServedModel, replicas: int) -> None:
        self.handle, self.model, self.replicas = handle, model, replicas
        self._streams = handle.options(stream=True)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> _RemoteStream:
        req = EngineRequest(prompt_ids, params, request_id, block_hashes(prompt_ids))
        for attempt in range(ADMIT_ATTEMPTS):
            response = self._streams.generate.remote(req)
            try:
                await response.__anext__()  # admitted by the replica
                break
            except (QueueFullError, ShuttingDownError):
                raise
            except BackPressureError as e:
                raise QueueFullError(f"every engine replica's queue is full; retry later ({e.message})") from None
            except Exception as e:
                if not _lost(e):
                    raise
                if attempt == ADMIT_ATTEMPTS - 1:  # nothing was computed: another replica may take it
                    raise EngineUnavailableError(_failure(e).error) from None
        stream = _RemoteStream(response)
        stream.task = asyncio.get_running_loop().create_task(self._pump(stream))
        return stream

    async def _pump(self, stream: _RemoteStream) -> None:
        try:
            async for u in stream.response:
                stream.queue.put_nowait(u)
                if u.finished:
                    return
            raise RuntimeError("the replica ended the stream before the request finished")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a replica died mid-request, or a bug there: the request ends with it
            stream.queue.put_nowait(_failure(e))

    def abort(self, stream: _RemoteStream) -> None:
        stream.response.cancel()
        if stream.task is not None:
            stream.task.cancel()

    async def _broadcast(self, method: str) -> list[Any]:
        try:
            return await self.handle.broadcast(method).results_async(timeout_s=HEALTH_TIMEOUT_S,
                                                                     return_exceptions=True)
        except TimeoutError:
            return []

    async def health(self) -> tuple[bool, dict[str, Any]]:
        healthy = sum(r is True for r in await self._broadcast("health"))
        status = "ok" if healthy >= self.replicas else "degraded" if healthy else "unavailable"
        return healthy > 0, {"status": status, "replicas": {"healthy": healthy, "expected": self.replicas}}

    async def metrics_text(self) -> str:
        return merge_metrics([r for r in await self._broadcast("metrics") if isinstance(r, tuple)])

    async def reset_prefix_cache(self) -> int:
        results = await self._broadcast("reset_prefix_cache")
        lost = [r for r in results if not isinstance(r, int)]
        if lost:
            raise EngineUnavailableError(f"{len(lost)} engine replica(s) did not answer; "
                                         f"their prefix caches may remain")
        return sum(results)


def merge_metrics(replicas: list[tuple[str, str]]) -> str:
    """Each replica's Prometheus text, as one exposition with a `replica` label."""
    families: dict[str, Any] = {}
    for tag, text in sorted(replicas):
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, fam)
            if merged is not fam:
                merged.samples += [s._replace(labels={**s.labels, "replica": tag}) for s in fam.samples]
            else:
                fam.samples = [s._replace(labels={**s.labels, "replica": tag}) for s in fam.samples]

    class _Collected:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected())
    return generate_latest(registry).decode()


class IngressBase:
    """The deployment `HeadwiseIngress`: create_app over the engine replicas."""

    def __init__(self, engine: DeploymentHandle, replicas: int, served_model_name: str | None,
                 api_key: str | None, max_request_bytes: int) -> None:
        self.engine, self.replicas = engine, replicas
        self.app_options = dict(served_model_name=served_model_name, api_key=api_key,
                                max_request_bytes=max_request_bytes)

    async def __serve_build_asgi_app__(self):
        model = await self.engine.info.remote()
        return create_app(RayEngineClient(self.engine, model, self.replicas), **self.app_options)


Ingress = serve.ingress()(IngressBase)


# ---- building and running -------------------------------------------------------------

def build_app(model: str, engine_options: dict[str, Any] | None = None, *, replicas: int = 2,
              cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0, max_queue: int = 256,
              routing: str = "prefix", imbalance: int = 4, served_model_name: str | None = None,
              api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              shutdown_timeout: float = 30.0):
    """The Serve application: `replicas` engines behind one ingress. shutdown_timeout: seconds
    a stopping replica gives its running requests."""
    engine_options = dict(engine_options or {})
    cfg = EngineConfig.from_options(model, engine_options)  # bad options fail here, not in N replicas
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if cpus_per_replica < 0 or gpus_per_replica < 0:
        raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0")
    if routing not in ROUTERS:
        raise ValueError(f"routing must be one of {sorted(ROUTERS)}, got {routing!r}")
    if imbalance < 0:
        raise ValueError(f"imbalance must be >= 0, got {imbalance}")
    router_kwargs = {"imbalance": imbalance} if routing == "prefix" else {}
    engine = serve.deployment(EngineReplica, name=ENGINE).options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        # The engine batches and queues itself; Serve only stops a replica past both.
        max_ongoing_requests=cfg.max_num_seqs + max_queue,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[routing],
                                                  request_router_kwargs=router_kwargs),
        health_check_period_s=5, health_check_timeout_s=REPLICA_HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=shutdown_timeout,
        logging_config=QUIET)
    ingress = serve.deployment(Ingress, name=INGRESS).options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000, logging_config=QUIET)
    return ingress.bind(engine.bind(model, engine_options, max_queue), replicas, served_model_name,
                        api_key, max_request_bytes)


def app_builder(args: dict[str, Any]):
    """For `serve run headwise.server.ray_serve:app_builder model=NAME replicas=2 ...` and
    Serve config files (docs/ray_serve.yaml): build_app's options, as strings or YAML values;
    engine options (EngineConfig fields) as a mapping or a JSON string in `engine_options`."""
    known = set(inspect.signature(build_app).parameters)
    unknown = set(args) - known
    if unknown or "model" not in args:
        raise ValueError(f"app_builder needs model=... and takes {sorted(known)}; got {sorted(args)}")
    kinds = {"replicas": int, "max_queue": int, "imbalance": int, "max_request_bytes": int,
             "cpus_per_replica": float, "gpus_per_replica": float, "shutdown_timeout": float}
    opts = {k: kinds.get(k, str)(v) for k, v in args.items() if k not in ("model", "engine_options")}
    engine_options = args.get("engine_options", {})
    if isinstance(engine_options, str):  # `serve run ... engine_options='{"max_model_len": 4096}'`
        engine_options = json.loads(engine_options)
    return build_app(args["model"], engine_options, **opts)


def start_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Join a cluster (`address`) or start one on this machine (node address 127.0.0.1), with
    no dashboard and no usage statistics."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    else:
        # Serve's HTTP proxy shares the cores with CPU engines that keep them all busy: on
        # two loaded cores here it was not ready within Serve's 5 s three times in a row,
        # and Serve killed it (its health checks allow 10 s). It gets as long as the
        # replicas do. (Read by Serve's controller, a process of the Ray started here.)
        for check in ("READY", "HEALTH"):
            os.environ.setdefault(f"RAY_SERVE_PROXY_{check}_CHECK_TIMEOUT_S", str(REPLICA_HEALTH_CHECK_TIMEOUT_S))
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING)


class _Stop(Exception):
    pass


def _stop(*_) -> None:
    raise _Stop


def run(app, host: str, port: int, ray_address: str | None = None) -> None:
    """Deploy `app` on Ray Serve at http://host:port and serve until SIGINT/SIGTERM. Then, on a
    Ray started here, shut Serve and Ray down; on a joined cluster, delete only this
    application (other applications and the cluster keep running)."""
    start_ray(ray_address)
    # After ray.init, which installs its own SIGTERM handler (exit at once, Serve left up).
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _stop)
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config=QUIET)
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"headwise on Ray Serve at http://{host}:{port} (application {APP_NAME!r})", flush=True)
        threading.Event().wait()
    except _Stop:
        pass
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)  # a second signal does not cut the shutdown short
        if ray_address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    print("headwise stopped", flush=True)
