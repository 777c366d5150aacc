"""plan stage: GGUF header + census -> the Plan (no weight is read).

Opens the header through bloomery.gguf_file (a truncated or corrupt file is
refused by name here), checks the seat against the file's architecture, takes
the census, picks the backend and computes the plan through bloomery.plan.
Sends PlanDone with the plan records (the supervisor prints them; --plan stops
after them) and the facts the engine stage needs, the model facts of
/v1/models and /props among them (stages/meta.py).
"""
from __future__ import annotations

from bloomery import records
from bloomery.messages import codec, stage as sm
from bloomery.placement_flags import PlacementAsk
from bloomery.engine.models.registry import ARCHS as SEATS
from bloomery.stages.common import StageRefusal, import_numpy_one_blas_thread, run_stage
from bloomery.stages.meta import model_meta


def choose_backend(device: str, card_free_bytes: tuple[int, ...], card: int | None = None,
                   named: str = "") -> tuple[str, str]:
    """(backend, why) for --backend cpu|cuda|auto (device) or -dev none|CUDA<card> (named: how it was given)."""
    named = named or f"--backend {device}"
    if device == "cpu":
        return "numpy", named
    if device == "cuda":
        if not card_free_bytes:
            raise StageRefusal(f"{named}: CuPy sees no card (install bloomery[cuda12] or use --backend cpu, -dev none)")
        if card is not None and card >= len(card_free_bytes):
            raise StageRefusal(f"{named}: no such device; CuPy sees {len(card_free_bytes)} card(s): "
                               + ", ".join(f"CUDA{i}" for i in range(len(card_free_bytes))))
        if card not in (None, 0):
            raise StageRefusal(f"{named}: this build runs on the first card (CUDA0) only")
        return "cuda", named
    if card_free_bytes:
        return "cuda", f"auto: CuPy sees {len(card_free_bytes)} card(s)"
    return "numpy", "auto: no card seen through CuPy"


def check_seat(seat: str | None, arch: str, path: str) -> str:
    if arch not in SEATS:
        raise StageRefusal(f"model file {path}: architecture {arch!r} has no seat here (seats: {', '.join(SEATS)})")
    if seat is not None and seat != arch:
        raise StageRefusal(f"--seat {seat}: the file {path} is {arch!r}; the {seat} seat does not serve it "
                           f"(use --seat {arch} or leave it out)")
    return arch


def check_ngl(ngl: str | None, n_layer: int) -> None:
    if ngl is None or ngl in ("all", "auto") or int(ngl) < 0 or int(ngl) >= n_layer + 1:
        return
    raise StageRefusal(f"-ngl {ngl}: a count below the file's layers + 1 ({n_layer + 1}) is refused; "
                       f"every layer runs on the device (use all, auto or a count >= {n_layer + 1}; "
                       f"-ncmoe N or --cpu-moe put routed experts on the host instead)")


def make(args: dict, gf, census):
    """(the Plan for these settings, why this backend); PlanError / StageRefusal name what does not fit.
    --parallel auto is bloomery.plan's own rule (make_plan takes n_parallel="auto")."""
    from bloomery.header_check import HeaderError, check_header
    from bloomery.engine.limits import CTX_CHECKPOINTS
    from bloomery.plan import PlanError, make_plan, model_facts

    try:   # every hyperparameter's range and every tensor's presence, type and shape, before any allocation
        check_header(gf.path, gf.metadata, gf.tensors)
    except HeaderError as e:
        raise StageRefusal(str(e)) from None
    facts = model_facts(gf)
    check_ngl(args.get("ngl"), facts.n_layer)
    backend, why = choose_backend(args.get("device", "auto"), census.card_free_bytes, args.get("card"),
                                  args.get("backend_from", "") if args.get("backend_from") != "default" else "")
    parallel = args.get("parallel", 1)
    n_parallel = "auto" if parallel == "auto" else int(parallel)
    ask = codec.build(PlacementAsk, args.get("placement_ask") or {}, "placement_ask")
    if backend == "cuda" and ask.main_gpu not in (None, 0):
        raise StageRefusal(f"-mg {ask.main_gpu}: this build runs every layer on the first card (CUDA0) only")
    try:
        plan = make_plan(facts, census, backend, args.get("ctx_size") or 0, n_parallel, args.get("slot_ctx") or 0,
                         ask, cache_ram_mib=args.get("cache_ram"),
                         n_ctx_checkpoints=args.get("ctx_checkpoints", CTX_CHECKPOINTS), n_ubatch=args.get("ubatch"))
    except PlanError as e:
        raise StageRefusal(str(e)) from None
    return plan, why


def main(args: dict) -> int:
    import_numpy_one_blas_thread()
    from bloomery.census import take_census
    from bloomery.gguf_file import GGUFError, open_gguf

    path = args["model_file"]
    try:
        gf = open_gguf(path)
    except GGUFError as e:
        raise StageRefusal(str(e)) from None
    try:
        arch = check_seat(args.get("seat"), gf.arch(), path)
        census = take_census()
        plan, backend_why = make(args, gf, census)
        name = gf.get("general.name")
        meta = model_meta(gf)
    except GGUFError as e:    # a header value the reader checks only when it is asked for (general.architecture)
        raise StageRefusal(str(e)) from None
    finally:
        gf.close()
    recs = []
    for message, kv in plan.records():
        if message == "plan":
            kv = {**kv, "backend_from": backend_why}
        recs.append(sm.Record("plan", "plan", message, {k: _scalar(v) for k, v in kv.items()}))
    for level, sentence, kv in plan.explain():
        recs.append(sm.Record("plan", "plan", sentence, kv, level))
    facts = {"n_ctx": plan.n_ctx, "n_ctx_slot": plan.n_ctx_slot, "n_slots": plan.n_slots, "backend": plan.backend,
             "arch": arch, "n_ctx_train": plan.n_ctx_train, "ctx_rule": plan.ctx_rule,
             "general_name": name if isinstance(name, str) else None, "weights_bytes": plan.weights_bytes,
             "parallel_from": plan.parallel_from, **meta}
    records.send(sm.PlanDone(tuple(recs), facts, plan.placement))
    return 0


def _scalar(v):
    return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)


if __name__ == "__main__":
    run_stage("plan", main)
