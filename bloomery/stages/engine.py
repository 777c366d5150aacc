"""engine stage: load the weights, send READY, then run the engine loop over ZeroMQ.

Threads (vLLM v1's shape):
- input thread: the DEALER socket -> a queue (Generate, Cancel, SlotsQuery, Shutdown, Residency,
  ExpertsQuery, SlotAction);
- busy loop (main thread): drain the queue (add / cancel), engine.step(), one
  Tokens message per step on PUSH; while idle it blocks on the queue (no spin)
  and checks that the supervisor is still its parent. As it turns idle (the step that
  ended the last request), the idle slots' states go to the prompt cache
  (core.Engine.save_idle_now, with --cache-idle-slots), so that copy is off the next
  request's path. A request that wakes it idle waits
  while more of a burst keeps arriving (gather: GATHER_QUIET_S apart, GATHER_MAX_S at most),
  so requests sent together share their first prompt pass and decode from the same step.
A fault in step() fails every request in flight, then sends Dead: the
supervisor answers 500 to them and exits 70.
"""
from __future__ import annotations

import gc
import os
import queue
import sys
import threading
import time
from pathlib import Path

import zmq

from bloomery import records
from bloomery.engine import experts_query, slot_file
from bloomery.engine.types import ModelInfo, TokenOut
from bloomery.messages import engine as em
from bloomery.messages import codec
from bloomery.messages import stage as sm
from bloomery.messages.codec import MessageError
from bloomery.placement import Placement
from bloomery.stages.common import parent_alive, run_stage

IDLE_WAIT_S = 0.5
# A burst at an idle engine (clients sending together): without the wait the first request's prompt ran alone and the
# others' after it, so the first stream decoded alone meanwhile and ended ahead (H200, session 21: 4 streams' prompts
# in passes of 75 and 117 ms, the aggregate 610 tok/s against 4 x 178 for the streams together). A lone request pays
# GATHER_QUIET_S.
GATHER_QUIET_S = 0.002
GATHER_MAX_S = 0.010
INPUT_POLL_MS = 50        # the input thread looks at the stop flag this often: the stop joins it (was 200)
PROGRESS_S = 1.0          # a Progress record about this often while the weights are read
ENGINE_ID = b"engine"


def _input_thread(ctx: zmq.Context, req_addr: str, inbox: queue.Queue, stop: threading.Event) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, ENGINE_ID)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(req_addr)
    sock.send(em.encode(em.Hello(os.getpid())))     # the ROUTER learns our id before READY
    try:
        while not stop.is_set():
            if not sock.poll(INPUT_POLL_MS):
                continue
            data = sock.recv()
            try:
                inbox.put(em.decode_to_engine(data))
            except MessageError as e:   # a front bug: say so, keep serving the others
                records.record("serve", "message refused", component="engine", level="error", error=str(e))
    finally:
        sock.close()


def placement_of(args: dict) -> Placement:
    """The plan's Placement, as the supervisor handed it on: checked field by field (messages/codec.py)."""
    return codec.build(Placement, args["placement"], "placement")


def model_info(args: dict, facts: dict, placement: Placement, model) -> ModelInfo:
    """ModelInfo from the loaded model, its placement and the plan's facts (the GGUF facts of stages/meta.py)."""
    name = args.get("alias") or facts.get("general_name") or Path(args["model_file"]).stem
    return ModelInfo(name=name, arch=str(model.arch), n_ctx=placement.n_ctx, n_ctx_slot=placement.n_ctx_slot,
                     n_slots=placement.n_slots, n_vocab=int(model.n_vocab), n_ctx_train=int(model.n_ctx_train),
                     backend=placement.backend, model_path=args["model_file"],
                     n_params=int(facts.get("n_params", 0)), size_bytes=int(facts.get("size_bytes", 0)),
                     n_embd=int(facts.get("n_embd", 0)), vocab_type=int(facts.get("vocab_type", 0)),
                     ftype=str(facts.get("ftype", "")), pooling=pooling_of(args, model))


# llama.cpp's enum llama_pooling_type, as {arch}.pooling_type stores it
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def pooling_of(args: dict, model) -> str:
    """--pooling as given, else the file's {arch}.pooling_type, else none (llama.cpp's rule)."""
    if args.get("pooling"):
        return str(args["pooling"])
    gf = getattr(model, "gf", None)
    value = gf.get(f"{model.arch}.pooling_type") if gf is not None else None
    return POOLING_TYPES.get(int(value), "none") if isinstance(value, int) else "none"


def anon_bytes() -> int | None:
    """This process's resident anonymous memory (Linux's RssAnon): what it allocated and holds,
    apart from mapped files such as the weights' blocks. None where /proc cannot say."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class LoadProgress:
    """Progress records while the weights are read: about one every `interval_s` (and the last),
    bytes done, total and percent, on the stage's records path to the supervisor."""

    def __init__(self, interval_s: float = PROGRESS_S, send=None, clock=time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.send = send or records.send
        self.sent_at: float | None = None       # when the last record went
        self.finished = False                   # the done == total record went

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if self.finished or (done < total and self.sent_at is not None and now - self.sent_at < self.interval_s):
            return
        self.sent_at, self.finished = now, done >= total
        self.send(sm.Progress("load", "engine", done, total))


def set_residency(engine, msg: em.Residency, load) -> em.ResidencyReply:
    """--sleep-idle-seconds: free the model (weights, KV, and on a card CuPy's cached blocks) or load it again."""
    t0 = time.monotonic()
    try:
        engine.swap_model(None if msg.sleep else load())
        gc.collect()
        if msg.sleep:
            _free_card_pool()
    except Exception as e:
        return em.ResidencyReply(msg.query_id, engine.model is None, error=f"{type(e).__name__}: {e}")
    records.record("serve", "asleep: weights and KV freed" if msg.sleep else "awake: weights loaded again",
                   component="engine", took_s=round(time.monotonic() - t0, 3))
    return em.ResidencyReply(msg.query_id, msg.sleep, round(time.monotonic() - t0, 3))


def _free_card_pool() -> None:
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def gather(inbox: queue.Queue, quiet_s: float = GATHER_QUIET_S, most_s: float = GATHER_MAX_S,
           clock=time.monotonic) -> list:
    """The rest of a burst after a request woke the idle loop: messages arriving no more than quiet_s apart, for at
    most most_s in all."""
    out, end = [], clock() + most_s
    while (left := end - clock()) > 0:
        try:
            out.append(inbox.get(timeout=min(quiet_s, left)))
        except queue.Empty:
            break
    return out


def serve(engine, inbox: queue.Queue, push: zmq.Socket, ppid: int, load=None) -> str:
    """The busy loop; returns why it ended. load: the model again, for a wake after --sleep-idle-seconds."""
    last_slots = None
    # prompt progress leaves as it happens, between the passes of one step
    engine.emit = lambda outs: push.send(em.encode(em.Tokens(tuple(outs))))
    while True:
        msgs = []
        if not engine.has_work():     # idle: sleep on the queue, not a spin
            try:
                msgs.append(inbox.get(timeout=IDLE_WAIT_S))
            except queue.Empty:
                pass
            else:
                if isinstance(msgs[0], em.Generate):
                    msgs += gather(inbox)
        while True:
            try:
                msgs.append(inbox.get_nowait())
            except queue.Empty:
                break
        for msg in msgs:
            if isinstance(msg, em.Generate):
                try:
                    engine.add(msg.req)
                except Exception as e:   # refused by the scheduler: that request ends with its reason
                    push.send(em.encode(em.Tokens((TokenOut(msg.req.req_id, None, "error", error=str(e)),))))
            elif isinstance(msg, em.Cancel):
                engine.cancel(msg.req_id)
            elif isinstance(msg, em.SlotsQuery):
                push.send(em.encode(em.SlotsReply(msg.query_id, tuple(engine.slots()), engine.engine_stats())))
            elif isinstance(msg, em.Shutdown):
                return f"shutdown: {msg.reason}"
            elif isinstance(msg, em.Residency):
                engine.settle()                        # a step launched ahead ends first (core.Engine.settle)
                push.send(em.encode(set_residency(engine, msg, load)))
            elif isinstance(msg, em.ExpertsQuery):     # between steps: a reset rewrites the kernels' tables
                engine.settle()
                ans = experts_query.answer(engine.model, msg.reset)
                if msg.reset and not ans.error:
                    records.record("serve", "routed experts back to the load's placement", component="engine")
                push.send(em.encode(em.ExpertsReply(msg.query_id, ans.report, ans.error, ans.kind)))
            elif isinstance(msg, em.SlotAction):       # between steps: the slot's KV is copied out or in
                engine.settle()
                got = slot_file.answer(engine, msg.action, msg.id_slot, msg.path, msg.filename, msg.model_name)
                push.send(em.encode(em.SlotActionReply(msg.query_id, got.status, got.body, got.error)))
        if not parent_alive(ppid):
            return "the supervisor is gone"
        if not engine.has_work():
            continue
        try:
            outs = engine.step()
        except Exception as e:
            reason = f"engine step failed: {type(e).__name__}: {e}"
            push.send(em.encode(em.Tokens(tuple(engine.abort_all(reason)))))
            raise
        if outs:
            push.send(em.encode(em.Tokens(tuple(outs))))
        slots = engine.slots()
        summary = [(e["id"], e["is_processing"], e.get("req_id")) for e in slots]
        if summary != last_slots:    # client.slots() reads the latest table without a round trip; pushed when
            # a slot takes or ends a request, not per id
            push.send(em.encode(em.SlotsReply("", tuple(slots), engine.engine_stats())))
            last_slots = summary
        if not engine.has_work():     # the last request ended: its slot's state to the prompt cache now, before
            engine.save_idle_now()    # any message that came meanwhile (core.Engine.save_idle_now)


def idle_slots(args: dict, cache_bytes: int, saves_state: bool) -> bool:
    """--cache-idle-slots (on unless --no-cache-idle-slots): whether the engine saves idle slots to the prompt
    cache when a request starts; off, with a record saying why, without a prompt cache to save them to."""
    if not args.get("cache_idle_slots", True):
        return False
    if cache_bytes <= 0 or not saves_state:
        records.record("load", "--cache-idle-slots needs the prompt cache: off", component="engine", level="warning",
                       why="--cache-ram 0 turned the prompt cache off" if cache_bytes <= 0
                       else "this model's slot state is not saved to the prompt cache")
        return False
    tag = {"tag": "__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__"} if args.get("verbose") else {}
    records.record("load", "idle slots are saved to the prompt cache when a request starts"
                   + (" and then emptied (--kv-unified)" if args.get("kv_unified") else ""), component="engine", **tag)
    return True


def checkpoints_of(args: dict, model) -> tuple[int, int | None, int]:
    """--ctx-checkpoints and --checkpoint-min-step for a model whose slot state cannot rewind: (checkpoints a
    slot, the message-start id they are kept at, the least spacing between them), with a record saying which;
    (0, None, 0) for any other model."""
    if model.rewinds or not model.checkpoints:
        return 0, None, 0
    from bloomery.engine.scheduler import MESSAGE_START, message_start_id
    from bloomery.engine.limits import CHECKPOINT_MIN_STEP, CTX_CHECKPOINTS
    n = int(args.get("ctx_checkpoints", CTX_CHECKPOINTS))
    min_step = int(args.get("checkpoint_min_step", CHECKPOINT_MIN_STEP))
    start_id = message_start_id(model.gf.metadata) if model.gf is not None else None
    if n > 0 and start_id is not None:
        records.record("load", "checkpoints at message starts", component="engine", ctx_checkpoints=n,
                       checkpoint_min_step=min_step, token=MESSAGE_START, id=start_id,
                       bytes_each=model.checkpoint_bytes)
    else:
        records.record("load", "no checkpoints: a prompt that parts from what a slot holds is read whole",
                       component="engine", why=f"--ctx-checkpoints {n}" if n <= 0 else
                       f"the vocabulary or the chat template lacks {MESSAGE_START}")
    return max(n, 0), start_id, min_step


def main(args: dict) -> int:
    placement = placement_of(args)
    threads = int(args.get("threads", -1))
    if threads > 0 and placement.backend == "numpy":
        # -t on the CPU backend: its kernels' row threads (read when the quant modules load, just below)
        os.environ["BLOOMERY_NUMPY_THREADS"] = str(threads)
    from bloomery.engine.core import Engine
    from bloomery.engine.loader import load_model
    from bloomery.engine.warmup import warm_up

    ppid = os.getppid()
    facts = args["facts"]
    ctx = zmq.Context.instance()
    inbox: queue.Queue = queue.Queue()
    stop = threading.Event()
    reader = threading.Thread(target=_input_thread, args=(ctx, args["req_addr"], inbox, stop), daemon=True)
    reader.start()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(args["out_addr"])

    t0 = time.monotonic()
    records.record("load", "loading weights", component="engine", backend=placement.backend,
                   slots=placement.n_slots, n_ctx_slot=placement.n_ctx_slot, device=placement.default_device)
    if placement.backend == "numpy":
        from bloomery.engine.quant import formats
        records.record("load", "lever", component="engine", name="BLOOMERY_KERNEL_ORDER",
                       value="on" if formats.KERNEL_ORDER else "off",
                       means="llama.cpp's kernel float order" if formats.KERNEL_ORDER else "exact integer sums, our float order")
        from bloomery.engine.cpu import kernels as cpu_kernels
        records.record("load", "lever", component="engine", name="BLOOMERY_CPU_KERNELS",
                       value="off" if cpu_kernels.lib() is None else "on", means=cpu_kernels.status())
        from bloomery.engine.cpu import recurrent
        records.record("load", "lever", component="engine", name="BLOOMERY_DELTA_CHUNKED",
                       value="on" if recurrent.CHUNKED else "off",
                       means=f"the delta rule's chunked form on spans of {recurrent.CHUNKED_MIN_ROWS}+ rows"
                       if recurrent.CHUNKED else "the delta rule step by step, as llama.cpp's CPU kernel")
        from bloomery.engine.quant import threads as cpu_threads
        records.record("load", "threads", component="engine", threads=cpu_threads.N_THREADS,
                       means="the CPU backend's kernel threads (-t)")
    from bloomery.gguf_file import open_gguf
    anon0 = anon_bytes()

    def load(progress=None):
        """The model as the placement says (again after a --sleep-idle-seconds sleep); the header is
        parsed once per load and the load takes the open file."""
        return load_model(open_gguf(args["model_file"]), placement, progress=progress,
                          threads=max(0, int(args.get("threads", -1))))
    model = load(LoadProgress(float(args.get("progress_s", PROGRESS_S))))
    if placement.backend == "cuda":
        # the kernel modules: the prebuilt ones loaded with the backend, the rest compiling since then
        # (engine/cuda/kernels.py); which came which way, and how long the load still waited for them
        t_k = time.monotonic()
        got = model.ops.k.wait()
        records.record("load", "cuda kernels", component="engine", waited_s=round(time.monotonic() - t_k, 3), **got)
    if args.get("warmup", True):
        # As llama-server's warmup, and each path a request can take (engine/warmup.py): nothing is
        # compiled or captured on a request's path. The slots' bookkeeping stays empty (the engine
        # is made after), so nothing reuses what this wrote.
        t_warm = time.monotonic()
        parts = warm_up(model, placement.n_slots)
        records.record("load", "warmup", component="engine", took_s=round(time.monotonic() - t_warm, 3),
                       parts="; ".join(f"{name} {took} s" for name, took in parts))
        host = placement.device("host")
        anon1 = anon_bytes()
        if placement.backend == "numpy" and host is not None and anon0 is not None and anon1 is not None:
            # what the plan counted beside the mapped file (decoded forms + KV) against what this
            # process now holds; experts no warmup id routed to are decoded by later requests
            records.record("load", "held after warmup", component="engine", held_bytes=anon1 - anon0,
                           counted_bytes=host.terms.decoded + host.terms.kv)
    host = placement.device("host")
    cache_bytes = host.terms.prompt_cache if host is not None else 0
    idle = idle_slots(args, cache_bytes, model.saves_state)
    n_checkpoints, start_id, min_step = checkpoints_of(args, model)
    engine = Engine(model, placement.n_slots, placement.n_ctx_slot, n_batch=args.get("n_batch", 2048),
                    prompt_cache_bytes=cache_bytes, cache_idle_slots=idle,
                    clear_idle=idle and bool(args.get("kv_unified")), test_tags=bool(args.get("verbose")),
                    n_ctx_checkpoints=n_checkpoints, message_start_id=start_id,
                    checkpoint_min_step=min_step)
    info = model_info(args, facts, placement, model)
    del model                 # the engine holds the only reference: a sleep frees it
    load_s = round(time.monotonic() - t0, 3)
    records.record("load", "model loaded", component="engine", load_s=load_s, n_params=info.n_params)
    records.send(sm.Ready(info, {"load_s": load_s, "pid": os.getpid()}))
    try:
        why = serve(engine, inbox, push, ppid, load)
    finally:
        stop.set()
        reader.join(2)
    records.record("stopped", "engine loop ended", component="engine", why=why)
    push.close(linger=1000)
    return 0


if __name__ == "__main__":
    run_stage("engine", main)
