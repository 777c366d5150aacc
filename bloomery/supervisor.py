"""bloomery-serve: parse the flags, bind the port, run the stages, serve HTTP.

The supervisor never imports CuPy and never touches weights. It binds the port
first (so a client sees 503 "Loading model" with the phase, never a refused
connection), then runs fetch, plan and engine as separate processes wired with
ZeroMQ over ipc:// sockets in a private 0700 runtime folder (stage_runner.py).
After the engine's READY it builds the front (tokenizer + chat template from the
GGUF header, the zmq EngineClient, the API App; front.py) and flips the lifecycle
to ready.

Stopping (SIGINT/SIGTERM): the phase goes to draining, so every new request is
answered 503 "Server is shutting down" (the port stays open through the drain);
requests still generating get up to --drain-timeout (25 s) to finish, then end with a 503 error
answer (an error event in a stream) naming the shutdown; then the engine stops
between its calls and the HTTP server closes. A second signal ends at once.
(llama-server ends its loop at once on the first signal; ours is the gentler order.)
"""
from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import uvloop
import zmq
import zmq.asyncio

from bloomery import need, records, workpool, settings as settings_mod
from bloomery.front import Gate, build_front, choice_records, make_app
from bloomery.http.guard import Cors
from bloomery.lifecycle import Lifecycle, Phase
from bloomery.messages.codec import to_plain
from bloomery.records import record
from bloomery.sdnotify import Notifier, pulse
from bloomery.socket_activation import listening_socket
from bloomery.settings import Settings, SettingsError
from bloomery.stage_runner import StageFailed, StageRunner, runtime_dir  # noqa: F401  (runtime_dir: tests)
from bloomery.stages.common import import_numpy_one_blas_thread

EXIT_REFUSED = 1          # a stage refused the start (file, plan) or a flag was refused
EXIT_ENGINE = 70          # the engine died (serving guide 8.3)
VERSION = "0.1.0"
DRAIN_S = 5.0             # the HTTP server's own bound on answers still being written once it closes
ENGINE_STOP_S = 10.0      # then how long the engine gets to end between its calls


def bind_ports(hosts: str, port: int) -> list[socket.socket]:
    """--host a,b: one listening socket per address, all on one port (--port 0: the first's free port)."""
    socks: list[socket.socket] = []
    try:
        for host in [h.strip() for h in hosts.split(",") if h.strip()] or ["127.0.0.1"]:
            socks.append(bind_port(host, port if not socks else socks[0].getsockname()[1]))
    except SettingsError:
        for one in socks:
            one.close()
        raise
    return socks


def bind_port(host: str, port: int) -> socket.socket:
    """Bind before anything loads; --port 0 takes a free port (printed in the listen record)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise SettingsError(f"--host {host} --port {port}: cannot bind ({e.strerror})") from None
    sock.listen(1024)
    return sock


class Supervisor:
    def __init__(self, s: Settings, drain_s: float | None = None):
        self.s = s
        self.drain_s = s.drain_timeout if drain_s is None else drain_s   # how long generations may go on
        self.notifier = Notifier()      # $NOTIFY_SOCKET / $WATCHDOG_USEC, read once
        self.life = Lifecycle(self.notifier, router=s.router)
        self.gate = Gate(self.life, s.api_keys, Cors(s.cors_origins, s.cors_methods, s.cors_headers,
                                                     s.cors_credentials))
        self.client = None
        self.server = None
        self.stop = asyncio.Event()
        self.stop_cause = ""
        self.n_signals = 0
        self.runner: StageRunner | None = None

    # -- HTTP: the gate, then the App --------------------------------------------------------
    def precheck(self, req):
        return self.gate.precheck(req)

    async def dispatch(self, req):
        return await self.gate.dispatch(req)

    # -- signals ---------------------------------------------------------------------------
    def on_signal(self, signame: str) -> None:
        self.n_signals += 1
        if self.n_signals > 1:
            record("stopped", "second signal: ending at once", cause=signame)
            if self.runner is not None:
                self.runner.kill_all()
            os._exit(1)
        self.stop_cause = signame
        record("draining", "stopping", cause=signame)
        self.stop.set()

    # -- the run ---------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig.name)
        rt = runtime_dir()
        ctx = zmq.asyncio.Context()
        tasks: list[asyncio.Task] = []
        self.runner = StageRunner(f"ipc://{rt}/stage", self.stop, lambda: self.life.phase.value)
        try:
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.bind(self.runner.stage_addr)
            tasks.append(asyncio.create_task(self.runner.read_messages(pull)))
            self.notifier.check()       # a NOTIFY_SOCKET/WATCHDOG_USEC we cannot use: refused by name
            tasks.append(asyncio.create_task(pulse(self.notifier, self.life.starting)))   # WATCHDOG, EXTEND_TIMEOUT
            return await self._run(ctx, rt, tasks)
        except StageFailed as e:
            record("stopped", "stage failed", level="error", stage=e.stage, reason=e.reason)
            self.notifier.status(f"failed: {e.stage}: {e.reason}")
            return e.exit_code or (EXIT_ENGINE if e.stage == "engine" else EXIT_REFUSED)
        except SettingsError as e:
            record("start", "refused", level="error", error=str(e))
            self.notifier.status(f"refused: {e}")
            return EXIT_REFUSED
        finally:
            self.runner.kill_all()
            await self.runner.reap()
            if self.client is not None:
                self.client.close()
            for t in tasks:
                t.cancel()
            ctx.destroy(linger=0)
            shutil.rmtree(rt, ignore_errors=True)
            workpool.shutdown()

    async def _run(self, ctx, rt: str, tasks: list) -> int:
        s, runner = self.s, self.runner
        if not s.plan:
            from bloomery.http.server import HttpServer
            from bloomery.zmq_client import ZmqEngineClient

            activated = listening_socket()                                # systemd's LISTEN_FDS socket, else bind
            socks = [activated] if activated else bind_ports(s.host, s.port)
            for sock in socks:
                host, port = sock.getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                record("fetch", "listening", host=host, port=port, url=f"http://{shown}:{port}")
            self.server = HttpServer(self.dispatch, precheck=self.precheck, drain_timeout_s=DRAIN_S,
                                     log=lambda event, **kv: record(self.life.phase.value, event, component="http", **kv))
            tasks.append(asyncio.create_task(self.server.serve(socks)))
            if s.router:      # no model: llama-server's router mode, each model in a child bloomery-serve
                from bloomery.router.serve import run_router
                return await run_router(self)
            self.client = ZmqEngineClient(ctx, f"ipc://{rt}/req", f"ipc://{rt}/out")
            self.client.start()
        if s.hf_token:   # the fetch stage reads it from its environment, never from argv (ps shows argv)
            records.add_secret(s.hf_token)
            os.environ["HF_TOKEN"] = s.hf_token
        hook = None if s.plan else need.resolve_hook(s.need_hook, os.environ)   # a bad hook: refused before fetch
        fetch_args = {"model_file": s.model_file, "hf_repo": s.hf_repo, "hf_file": s.hf_file, "offline": s.offline}
        fetched = await runner.next_outcome("fetch", await runner.start("fetch", fetch_args))
        if fetched is None:
            return await self._stopped()
        self.life.advance(Phase.PLAN)
        plan_args = {"model_file": fetched.path, "seat": s.seat, "ctx_size": s.ctx_size, "slot_ctx": s.slot_ctx,
                     "parallel": s.parallel, "device": s.backend, "card": s.card, "backend_from": s.backend_from,
                     "ngl": s.ngl, "placement_ask": to_plain(s.placement_ask), "cache_ram": s.cache_ram, "ubatch": s.ubatch_size,
                     "ctx_checkpoints": s.ctx_checkpoints}
        planned = await runner.next_outcome("plan", await runner.start("plan", plan_args))
        if planned is None:
            return await self._stopped()
        for rec in planned.records:
            records.emit(rec)
        choice_records(s, planned.facts)
        if s.plan:
            record("plan", "--plan: stopping before any weight is read")
            return 0
        if hook is not None:   # the host broker (or another scheduler) grants the start: phase queued till then
            model_name = s.alias or os.path.basename(fetched.path)
            if not await need.negotiate(hook, need.need_record(planned, fetched, model_name, os.environ),
                                        self.life, self.stop):
                return await self._stopped()
        self.life.advance(Phase.LOAD)
        engine_args = {"model_file": fetched.path, "alias": s.alias, "facts": planned.facts, "warmup": s.warmup,
                       "placement": to_plain(planned.placement),
                       "n_batch": s.batch_size, "threads": s.threads, "verbose": s.verbose,
                       "cache_idle_slots": s.cache_idle_slots, "kv_unified": s.kv_unified, "pooling": s.pooling,
                       "ctx_checkpoints": s.ctx_checkpoints, "checkpoint_min_step": s.checkpoint_min_step,
                       "req_addr": f"ipc://{rt}/req", "out_addr": f"ipc://{rt}/out"}
        engine = await runner.start("engine", engine_args)
        front = asyncio.create_task(asyncio.to_thread(build_front, fetched.path, s))
        ready = await runner.next_outcome("engine", engine)
        if ready is None:
            front.cancel()
            return await self._stopped(engine)
        try:
            tokenizer, template = await front
        except StageFailed:
            raise
        except Exception as e:   # tokenizer / template refused: the server cannot answer; name it
            raise StageFailed("load", f"{type(e).__name__}: {e}") from None
        self.client.info = ready.info
        tokenizer = workpool.ProcessTokenizer(tokenizer, fetched.path)   # long texts: no GIL held on the loop's side
        self.gate.app = make_app(s, tokenizer, template, self.client, ready.info,
                                 log=lambda line: record(self.life.phase.value, line))   # the per-request records
        self.gate.app.residency.start()     # --sleep-idle-seconds: the idle watch
        self.life.advance(Phase.READY, name=ready.info.name, n_ctx=ready.info.n_ctx, slots=ready.info.n_slots)
        return await self._serve(engine)

    async def _serve(self, engine) -> int:
        """Until a signal (exit 0) or the engine's death (exit 70)."""
        death = asyncio.ensure_future(self.runner.next_outcome("engine", engine))
        stop = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({death, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not self.stop.is_set():
            stop.cancel()
            try:
                death.result()
                reason = "the engine sent an unexpected message"
            except StageFailed as e:
                reason = e.reason
            record("stopped", "engine died", level="error", reason=reason)
            self.client.fail_all(reason)        # requests in flight answer 500 naming it
            self.life.advance(Phase.STOPPED, reason=reason)
            await self._close_http()
            return EXIT_ENGINE
        death.cancel()
        return await self._stopped(engine)

    async def _close_http(self) -> None:
        if self.server is None:
            return
        self.server.close()
        try:   # the server's own drain bound (drain_timeout_s) cancels what is left; this is a backstop
            await asyncio.wait_for(self.server.wait_closed(), DRAIN_S + 1.0)
        except asyncio.TimeoutError:
            pass

    async def drain(self) -> None:
        """Requests still generating get drain_s to finish; then they end with finish "shutdown"."""
        deadline = time.monotonic() + self.drain_s
        while self.client.n_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.client.n_in_flight:
            record("draining", "ending requests still generating", n_requests=self.client.n_in_flight,
                   drain_s=self.drain_s)
            self.client.end_all(f"the server is shutting down ({self.stop_cause})")

    async def _stopped(self, engine=None) -> int:
        """SIGINT/SIGTERM: admit nothing new (503), drain, end the engine between its calls, exit 0."""
        self.life.advance(Phase.DRAINING, reason=self.stop_cause)
        if engine is not None and engine.returncode is None:
            await self.drain()
            await self.client.shutdown(self.stop_cause)
            try:
                await asyncio.wait_for(engine.wait(), ENGINE_STOP_S)
            except asyncio.TimeoutError:
                record("draining", f"engine did not stop in {ENGINE_STOP_S:g} s; killed", level="warning")
        self.runner.kill_all()
        if self.client is not None:   # a request that reached the engine after the drain still ends by name
            self.client.end_all(f"the server is shutting down ({self.stop_cause})")
            self.client.fail_all(f"the server is stopping ({self.stop_cause})")   # and nothing new is sent
        await self._close_http()
        self.life.advance(Phase.STOPPED, reason=self.stop_cause)
        return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    records.configure("bloomery-serve")
    try:
        s = settings_mod.parse(argv)
    except SettingsError as e:
        record("start", "refused", level="error", error=str(e))
        sys.exit(EXIT_REFUSED)
    records.add_secret(*s.api_keys)
    try:
        log_file = open(s.log_file, "a", encoding="utf-8") if s.log_file else None   # open for the process's life
    except OSError as e:
        record("start", "refused", level="error", error=f"--log-file {s.log_file}: cannot open it ({e.strerror})")
        sys.exit(EXIT_REFUSED)
    records.configure_format(s.log_format, s.log_prefix, s.log_timestamps, log_file)
    if s.help:
        sys.stdout.write(settings_mod.help_text())
        sys.exit(0)
    if s.version:
        sys.stdout.write(f"bloomery-serve {VERSION}\n")
        sys.exit(0)
    if s.list_devices:       # the census in a child: the supervisor never imports CuPy
        sys.stdout.flush()
        sys.exit(subprocess.call([sys.executable, "-m", "bloomery.census"]))
    for message, kv in s.notes:
        record("start", message, **kv)
    import_numpy_one_blas_thread()      # the front's numpy (the GGUF header, the API) multiplies no matrix
    sys.setswitchinterval(workpool.SWITCH_INTERVAL_S)
    code = uvloop.run(Supervisor(s).run())
    exit_now(code, log_file)


def exit_now(code: int, log_file=None) -> None:
    """The end of a run: every stage is reaped, every socket closed and the helper processes ended
    (Supervisor.run), so the exit handlers run and the streams are flushed, and the interpreter's teardown
    is skipped: freeing the front's tables one object at a time (the tokenizer's vocabulary and merges,
    the templates) took most of a second on a busy 2-core machine, on every stop."""
    atexit._run_exitfuncs()      # multiprocessing's finalizers and the rest, as a normal exit runs them
    for stream in (sys.stdout, sys.stderr, log_file):
        if stream is not None:
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
