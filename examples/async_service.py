"""A small HTTP service (aiohttp) that starts and stops snake training jobs, streams their
progress, and answers /health while they train: snake runs inside the service's own
event loop, heavy work on its executor threads, so the loop stays responsive.

    python examples/async_service.py --port 8080
    curl -X POST localhost:8080/jobs -d '{"steps": 50}'
    curl localhost:8080/jobs/1/events        # streamed progress, one JSON line per step
    curl localhost:8080/health
    curl -X DELETE localhost:8080/jobs/1     # cancel
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from snake import AdamW, Placement, SnakeConfig, SnakeTrainer
from snake.corpus import pydoc_bytes, random_windows
from snake.models import GPT, GPTConfig

JOBS = web.AppKey("jobs", dict)


@dataclass
class Job:
    id: int
    steps: int
    status: str = "running"
    progress: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    task: asyncio.Task[None] | None = None
    updated: asyncio.Event = field(default_factory=asyncio.Event)

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "steps": self.steps, "status": self.status, "done": len(self.progress),
                "last": self.progress[-1] if self.progress else None, "error": self.error}


async def _train(job: Job, params: dict[str, Any]) -> None:
    cfg = GPTConfig(n_layer=int(params.get("layers", 4)), n_head=4, n_embd=int(params.get("embd", 128)),
                    vocab_size=256, block_size=int(params.get("seq", 64)))
    data = random_windows(pydoc_bytes(), batch=int(params.get("batch", 8)), seq=cfg.block_size)
    with tempfile.TemporaryDirectory(prefix="snake-job-") as d:
        config = SnakeConfig(
            micro_batches=int(params.get("micro_batches", 2)), offload_dir=d,
            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.25, optimizer=AdamW(lr=1e-3), device="cpu",
        )

        def on_step(s) -> None:  # type: ignore[no-untyped-def]
            job.progress.append({"step": s.step, "loss": s.loss, "seconds": s.seconds, "tokens": s.tokens})
            job.updated.set()

        try:
            async with SnakeTrainer(GPT(cfg), data=data, config=config) as trainer:
                await trainer.run(job.steps, on_step=on_step)
            job.status = "finished"
        except asyncio.CancelledError:
            job.status = "cancelled"
            raise
        except Exception as e:
            job.status, job.error = "failed", str(e)
        finally:
            job.updated.set()


async def start_job(request: web.Request) -> web.Response:
    params = await request.json() if request.can_read_body else {}
    jobs: dict[int, Job] = request.app[JOBS]
    job = Job(id=len(jobs) + 1, steps=int(params.get("steps", 20)))
    job.task = asyncio.create_task(_train(job, params), name=f"job-{job.id}")
    jobs[job.id] = job
    return web.json_response(job.view(), status=201)


def _job(request: web.Request) -> Job:
    job = request.app[JOBS].get(int(request.match_info["id"]))
    if job is None:
        raise web.HTTPNotFound(text="no such job")
    return job


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(_job(request).view())


async def job_events(request: web.Request) -> web.StreamResponse:
    job = _job(request)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    sent = 0
    while True:
        while sent < len(job.progress):
            await resp.write((json.dumps(job.progress[sent]) + "\n").encode())
            sent += 1
        if job.status != "running":
            await resp.write((json.dumps(job.view()) + "\n").encode())
            break
        job.updated.clear()
        await job.updated.wait()
    await resp.write_eof()
    return resp


async def cancel_job(request: web.Request) -> web.Response:
    job = _job(request)
    if job.task is not None and not job.task.done():
        job.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job.task
    return web.json_response(job.view())


async def health(request: web.Request) -> web.Response:
    running = sum(j.status == "running" for j in request.app[JOBS].values())
    return web.json_response({"ok": True, "running_jobs": running})


async def _cancel_all(app: web.Application) -> None:
    for job in app[JOBS].values():
        if job.task is not None and not job.task.done():
            job.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job.task


def make_app() -> web.Application:
    app = web.Application()
    app[JOBS] = {}
    app.router.add_post("/jobs", start_job)
    app.router.add_get("/jobs/{id}", get_job)
    app.router.add_get("/jobs/{id}/events", job_events)
    app.router.add_delete("/jobs/{id}", cancel_job)
    app.router.add_get("/health", health)
    app.on_shutdown.append(_cancel_all)
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    a = ap.parse_args()
    web.run_app(make_app(), host=a.host, port=a.port)
