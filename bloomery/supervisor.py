"""bloomery-serve: parse the flags, bind the port, run the stages, serve HTTP.

The supervisor never imports CuPy and never touches weights. It binds the port
first (so a client sees 503 "Loading model" with the phase, never a refused
connection), then runs fetch, plan and engine as separate processes wired with
ZeroMQ over ipc:// sockets in a private 0700 runtime folder. After the engine's
READY it builds the front (tokenizer + chat template from the GGUF header, the
zmq EngineClient, the API App) and flips the lifecycle to ready.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

import uvloop
import zmq
import zmq.asyncio

from bloomery import records, settings as settings_mod
from bloomery.lifecycle import Lifecycle, Phase
from bloomery.records import record
from bloomery.messages import stage as sm
from bloomery.settings import Settings, SettingsError

EXIT_REFUSED = 1          # a stage refused the start (file, plan) or a flag was refused
EXIT_ENGINE = 70          # the engine died (serving guide 8.3)
VERSION = "0.1.0"


def runtime_dir() -> str:
    """A private 0700 folder for the ipc sockets: $XDG_RUNTIME_DIR/bloomery-<pid>, else a tempdir."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        path = os.path.join(base, f"bloomery-{os.getpid()}")
        shutil.rmtree(path, ignore_errors=True)   # a stale folder of a dead process with our pid
        os.mkdir(path, 0o700)
    else:
        path = tempfile.mkdtemp(prefix=f"bloomery-{os.getpid()}-")
    os.chmod(path, 0o700)
    return path


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


def choice_records(s: Settings, facts: dict) -> None:
    """One record per choice the start made, after the plan (the ctx/parallel lines come from the plan)."""
    record("start", "model", path=s.model_file, seat=facts.get("arch"), source="--model" if s.seat else "file arch")
    record("start", "backend", backend=facts.get("backend"), device=s.device, source=s.sources.get("device", "default"))
    record("start", "alias", name=s.alias or facts.get("general_name") or os.path.basename(s.model_file or ""),
           source="--alias" if s.alias else "general.name" if facts.get("general_name") else "file name")
    record("start", "n_predict", default=s.n_predict, source=s.sources.get("n_predict", "default"))
    record("start", "api keys", n_keys=len(s.api_keys), public=["/health", "/v1/health"] if s.api_keys else "all")
    record("start", "chat template", source=s.chat_template_file or "the GGUF's tokenizer.chat_template")
    if s.sampling_defaults:   # App takes no request defaults yet: say so rather than pretend
        record("start", "sampling flags read, not applied: requests keep llama-server's defaults",
               **s.sampling_defaults)


FTYPE_NAMES = {0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
               11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small",
               15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 32: "BF16"}


class StageFailed(Exception):
    def __init__(self, stage: str, reason: str):
        super().__init__(f"{stage}: {reason}")
        self.stage, self.reason = stage, reason


class Supervisor:
    def __init__(self, s: Settings):
        self.s = s
        self.life = Lifecycle()
        self.app = None
        self.client = None
        self.server = None
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.outcomes: asyncio.Queue = asyncio.Queue()
        self.stop = asyncio.Event()
        self.stop_cause = ""
        self.n_signals = 0

    # -- HTTP: the loading gate, then the App ---------------------------------------------
    def _gate_response(self):
        from bloomery.http.types import Response

        gate = self.life.gate()
        return None if gate is None else Response.json(gate[1], status=gate[0])

    def precheck(self, req):
        """On headers, before the body: OPTIONS passes, then the loading gate, then the API key (llama-server's order)."""
        from bloomery.http.types import Response

        if req.method == "OPTIONS":
            return None
        early = self._gate_response()
        if early is not None or not self.s.api_keys or req.path in ("/health", "/v1/health"):
            return early
        key = req.headers.get("authorization") or req.headers.get("x-api-key") or ""
        key = key[len("Bearer "):] if key.startswith("Bearer ") else key
        if key in self.s.api_keys:
            return None
        return Response.json({"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}},
                             status=401)

    async def dispatch(self, req):
        early = self._gate_response()
        if early is not None:
            return early
        return await self.app.dispatch(req)

    # -- signals ---------------------------------------------------------------------------
    def on_signal(self, signame: str) -> None:
        self.n_signals += 1
        if self.n_signals > 1:
            record("stopped", "second signal: ending at once", cause=signame)
            self.kill_children()
            os._exit(1)
        self.stop_cause = signame
        record("draining", "stopping", cause=signame)
        self.stop.set()

    def kill_children(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # each stage leads its own process group
                except ProcessLookupError:
                    pass

    # -- stages ----------------------------------------------------------------------------
    async def _read_stage_messages(self, pull) -> None:
        while True:
            data = await pull.recv()
            try:
                msg = sm.decode(data)
            except Exception as e:   # MessageError: a stage bug; say so and go on
                record("serve", "stage message refused", level="error", error=str(e))
                continue
            if isinstance(msg, sm.Record):
                records.emit(msg)
            elif isinstance(msg, sm.Progress):
                record(msg.phase, "progress", component=msg.component, done=msg.done, total=msg.total, unit=msg.unit)
            else:
                self.outcomes.put_nowait(msg)

    async def start_stage(self, name: str, args: dict) -> asyncio.subprocess.Process:
        import json

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", f"bloomery.stages.{name}", self.stage_addr, json.dumps(args),
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)   # own group: Ctrl-C reaches us only
        self.procs[name] = proc
        record(self.life.phase.value, "stage started", stage=name, pid=proc.pid)
        return proc

    async def next_outcome(self, name: str, proc) -> object:
        """The stage's next outcome message; StageFailed when it dies or sends Dead; None on stop."""
        waits = {asyncio.ensure_future(self.outcomes.get()), asyncio.ensure_future(proc.wait()),
                 asyncio.ensure_future(self.stop.wait())}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        got = [w.result() for w in done if w.done() and not w.cancelled()]
        msg = next((g for g in got if isinstance(g, (sm.FetchDone, sm.PlanDone, sm.Ready, sm.Dead))), None)
        if msg is None and proc.returncode is not None:
            try:   # the outcome may still be on its way behind the exit
                msg = await asyncio.wait_for(self.outcomes.get(), 1.0)
            except asyncio.TimeoutError:
                raise StageFailed(name, f"exited with status {proc.returncode} "
                                  f"({_signal_name(proc.returncode)}) before it finished") from None
        if msg is None:
            return None           # stop requested
        if isinstance(msg, sm.Dead):
            raise StageFailed(msg.stage, msg.reason)
        return msg


    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig.name)
        rt = runtime_dir()
        ctx = zmq.asyncio.Context()
        tasks: list[asyncio.Task] = []
        try:
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            self.stage_addr = f"ipc://{rt}/stage"
            pull.bind(self.stage_addr)
            tasks.append(asyncio.create_task(self._read_stage_messages(pull)))
            return await self._run(ctx, rt, tasks)
        except StageFailed as e:
            record("stopped", "stage failed", level="error", stage=e.stage, reason=e.reason)
            return EXIT_ENGINE if e.stage == "engine" else EXIT_REFUSED
        except SettingsError as e:
            record("start", "refused", level="error", error=str(e))
            return EXIT_REFUSED
        finally:
            self.kill_children()
            for proc in self.procs.values():
                if proc.returncode is None:
                    await proc.wait()
            if self.client is not None:
                self.client.close()
            for t in tasks:
                t.cancel()
            ctx.destroy(linger=0)
            shutil.rmtree(rt, ignore_errors=True)

    async def _run(self, ctx, rt: str, tasks: list) -> int:
        s = self.s
        if not s.plan:
            from bloomery.http.server import HttpServer
            from bloomery.zmq_client import ZmqEngineClient

            sock = bind_port(s.host, s.port)
            host, port = sock.getsockname()[:2]
            record("fetch", "listening", host=host, port=port, url=f"http://{host}:{port}")
            self.server = HttpServer(self.dispatch, precheck=self.precheck, log=lambda event, **kv: record(
                self.life.phase.value, event, component="http", **kv))
            tasks.append(asyncio.create_task(self.server.serve(sock)))
            self.client = ZmqEngineClient(ctx, f"ipc://{rt}/req", f"ipc://{rt}/out")
            self.client.start()
        fetched = await self.next_outcome("fetch", await self.start_stage("fetch", {"model_file": s.model_file}))
        if fetched is None:
            return await self._stopped()
        self.life.advance(Phase.PLAN)
        plan_args = {"model_file": fetched.path, "seat": s.seat, "ctx_size": s.ctx_size, "slot_ctx": s.slot_ctx,
                     "parallel": s.parallel, "device": s.device, "ngl": s.ngl}
        planned = await self.next_outcome("plan", await self.start_stage("plan", plan_args))
        if planned is None:
            return await self._stopped()
        for rec in planned.records:
            records.emit(rec)
        choice_records(s, planned.facts)
        if s.plan:
            record("plan", "--plan: stopping before any weight is read")
            return 0
        self.life.advance(Phase.LOAD)
        engine_args = {"model_file": fetched.path, "alias": s.alias, "facts": planned.facts,
                       "req_addr": f"ipc://{rt}/req", "out_addr": f"ipc://{rt}/out"}
        engine = await self.start_stage("engine", engine_args)
        front = asyncio.create_task(asyncio.to_thread(build_front, fetched.path, s))
        ready = await self.next_outcome("engine", engine)
        if ready is None:
            front.cancel()
            return await self._stopped(engine)
        try:
            tokenizer, template, meta = await front
        except StageFailed:
            raise
        except Exception as e:   # tokenizer / template refused: the server cannot answer; name it
            raise StageFailed("load", f"{type(e).__name__}: {e}") from None
        from bloomery.api.app import App

        self.client.info = ready.info
        self.app = App(tokenizer, template, self.client, ready.info, n_predict_default=s.n_predict,
                       alias=s.alias, model_meta=meta)
        self.life.advance(Phase.READY, name=ready.info.name, n_ctx=ready.info.n_ctx, slots=ready.info.n_slots)
        return await self._serve(engine)

    async def _serve(self, engine) -> int:
        """Until a signal (exit 0) or the engine's death (exit 70)."""
        death = asyncio.ensure_future(self.next_outcome("engine", engine))
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
            await self._close_http(5.0)
            return EXIT_ENGINE
        death.cancel()
        return await self._stopped(engine)

    async def _close_http(self, timeout_s: float) -> None:
        if self.server is None:
            return
        self.server.close()
        try:
            await asyncio.wait_for(self.server.wait_closed(), timeout_s)
        except asyncio.TimeoutError:
            pass

    async def _stopped(self, engine=None) -> int:
        """SIGINT/SIGTERM: admit nothing new, end the engine between its calls, exit 0."""
        self.life.advance(Phase.DRAINING, reason=self.stop_cause)
        if self.server is not None:
            self.server.close()              # no new connection; answers in flight go on
        if engine is not None and engine.returncode is None:
            await self.client.shutdown(self.stop_cause)
            try:
                await asyncio.wait_for(engine.wait(), 10.0)
            except asyncio.TimeoutError:
                record("draining", "engine did not stop in 10 s; killed", level="warning")
        self.kill_children()
        if self.client is not None:
            self.client.fail_all(f"the server is stopping ({self.stop_cause})")
        await self._close_http(5.0)
        self.life.advance(Phase.STOPPED, reason=self.stop_cause)
        return 0


def _signal_name(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            pass
    return f"exit {returncode}"


def build_front(path: str, s: Settings):
    """Tokenizer, chat template and model facts from the GGUF header (no weights), in a worker thread."""
    from bloomery.chat_template import ChatTemplate
    from bloomery.gguf_file import open_gguf
    from bloomery.tokenizer import Tokenizer

    with open_gguf(path) as gf:
        md = gf.metadata
        tok = Tokenizer.from_gguf(md)
        if s.chat_template_file:
            source, origin = open(s.chat_template_file, encoding="utf-8").read(), s.chat_template_file
        else:
            source, origin = md.get("tokenizer.chat_template"), "the GGUF's tokenizer.chat_template"
        if not isinstance(source, str):
            raise StageFailed("load", f"{path}: no tokenizer.chat_template; give --chat-template-file")
        template = ChatTemplate(source, bos_token=_piece(tok, tok.bos_id), eos_token=_piece(tok, tok.eos_id),
                                add_bos=bool(tok.add_bos), add_eos=bool(getattr(tok, "add_eos", False)), origin=origin)
        arch = gf.arch()
        ftype = md.get("general.file_type")
        meta = {"n_embd": int(md.get(f"{arch}.embedding_length", 0) or 0),
                "vocab_type": 2 if md.get("tokenizer.ggml.model") == "gpt2" else 1,
                "ftype": FTYPE_NAMES.get(ftype, str(ftype)) if ftype is not None else ""}
    return tok, template, meta


def _piece(tok, token_id) -> str:
    if token_id is None or token_id < 0:
        return ""
    return tok.token_to_piece(token_id).decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    records.configure("bloomery-serve")
    try:
        s = settings_mod.parse(argv)
    except SettingsError as e:
        record("start", "refused", level="error", error=str(e))
        sys.exit(EXIT_REFUSED)
    records.add_secret(*s.api_keys)
    if s.help:
        sys.stdout.write(settings_mod.help_text())
        sys.exit(0)
    if s.version:
        sys.stdout.write(f"bloomery-serve {VERSION}\n")
        sys.exit(0)
    for message, kv in s.notes:
        record("start", message, **kv)
    code = uvloop.run(Supervisor(s).run())
    sys.exit(code)


if __name__ == "__main__":
    main()
