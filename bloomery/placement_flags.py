"""llama-server's placement flags, read with llama-server's meaning (common/arg.cpp), into one PlacementAsk.

Pure parsing: raw strings in, a typed ask and one record per flag out ("how it was read"); a value
llama-server would refuse, or one this build cannot honour, is a PlacementFlagError naming the flag.
What needs the census or the file (a card that is not there, a -ts list of the wrong length, a -fitt
margin that leaves no usable byte, a count at or above the layers) is checked by bloomery.offload.

  --cpu-moe / -cmoe                every routed expert tensor on the host (llama-server: the
                                   `\\.ffn_(up|down|gate|gate_up)_(ch|)exps` override to CPU)
  --n-cpu-moe / -ncmoe N           the routed experts of layers 0 .. N-1 on the host; N >= 0
  --override-tensor / -ot P=B,...  tensors whose name P matches (a search, as std::regex_search) go to
                                   buffer type B: CPU or CUDA<N>; the first matching rule wins
  --fit / -fit on|off              llama.cpp's truthy/falsey words; off: the plan never moves experts
                                   to the host by itself (a model over the card is refused)
  --fit-target / -fitt MiB[,...]   the margin kept free per card (one value: every card); split on , and /
  --fit-ctx / -fitc N              the smallest context the fitted rule may choose
  --tensor-split / -ts N0,N1,...   one share per card: the cards other than the main one take the routed
                                   experts the main card does not hold in these shares (0: the card is left out)
  --main-gpu / -mg I               the card that runs every layer (default: the largest)
  --split-mode / -sm none|layer    none: one card only; row and tensor are refused (not served)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

EXPS_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"     # llama.cpp's LLM_FFN_EXPS_REGEX
FIT_TARGET_MIB = 1024                                        # llama-server's -fitt default
FIT_CTX = 4096                                               # llama-server's -fitc default
TRUTHY, FALSEY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")
_BUFT = re.compile(r"CPU|CUDA(0|[1-9][0-9]*)")
_LIST_SPLIT = re.compile(r"[,/]+")


class PlacementFlagError(ValueError):
    """A placement flag's value refused; the message names the flag, the value and the rule."""


@dataclass(frozen=True)
class Override:
    pattern: str        # searched in the tensor's name
    buft: str           # "CPU" or "CUDA<N>"

    @property
    def device(self) -> str:
        return "host" if self.buft == "CPU" else f"cuda:{self.buft[4:]}"


@dataclass(frozen=True)
class PlacementAsk:
    """What the placement flags asked; the defaults are llama-server's."""
    cpu_moe: bool = False
    n_cpu_moe: int | None = None
    overrides: tuple[Override, ...] = ()
    fit: bool = True
    fit_target_mib: tuple[int, ...] = (FIT_TARGET_MIB,)
    fit_ctx: int = FIT_CTX
    tensor_split: tuple[float, ...] = ()
    main_gpu: int | None = None
    split_mode: str = "layer"

    @property
    def explicit(self) -> bool:
        """A flag placed tensors itself (the plan's own choice then gives way)."""
        return self.cpu_moe or self.n_cpu_moe is not None or bool(self.overrides)

    def margin_bytes(self, card: int) -> int:
        t = self.fit_target_mib
        return (t[0] if len(t) == 1 else t[card] if card < len(t) else FIT_TARGET_MIB) << 20

    def device_of(self, tensor: str) -> tuple[str, str] | None:
        """(device, why) the flags give this tensor, or None: the plan chooses. The rules in
        llama-server's order of precedence here: -ot rules first, then --cpu-moe, then -ncmoe."""
        for o in self.overrides:
            if re.search(o.pattern, tensor):
                return o.device, f"-ot {o.pattern}={o.buft}"
        if self.cpu_moe and re.search(EXPS_PATTERN, tensor):
            return "host", "--cpu-moe"
        if self.n_cpu_moe:
            m = re.match(r"blk\.(\d+)\.", tensor)
            if m and int(m.group(1)) < self.n_cpu_moe and re.search(EXPS_PATTERN, tensor):
                return "host", f"-ncmoe {self.n_cpu_moe}"
        return None


def _int(flag: str, text: str, low: int = 0) -> int:
    try:
        v = int(text.strip(), 10)
    except ValueError:
        raise PlacementFlagError(f"{flag} {text!r}: takes an integer") from None
    if v < low:
        raise PlacementFlagError(f"{flag} {v}: must be >= {low}")
    return v


def parse_overrides(flag: str, text: str) -> tuple[Override, ...]:
    out = []
    for item in text.split(","):
        pattern, eq, buft = item.partition("=")
        if not eq:
            raise PlacementFlagError(f"{flag} {item!r}: each rule is <tensor name pattern>=<buffer type>")
        if not pattern:
            raise PlacementFlagError(f"{flag} {item!r}: the tensor name pattern is empty")
        try:
            re.compile(pattern)
        except re.error as e:
            raise PlacementFlagError(f"{flag} {item!r}: the pattern {pattern!r} is not a regular expression "
                                     f"({e})") from None
        if not _BUFT.fullmatch(buft):
            raise PlacementFlagError(f"{flag} {item!r}: unknown buffer type {buft!r} (buffer types: CPU, "
                                     f"CUDA0, CUDA1, ...)")
        out.append(Override(pattern, buft))
    return tuple(out)


def _numbers(flag: str, text: str, kind):
    items = [x for x in _LIST_SPLIT.split(text.strip())]
    if not items or any(not x.strip() for x in items):
        raise PlacementFlagError(f"{flag} {text!r}: a list of numbers split by , or /, with no empty item")
    try:
        vals = tuple(kind(x.strip()) for x in items)
    except ValueError:
        raise PlacementFlagError(f"{flag} {text!r}: every item must be a number") from None
    if any(v < 0 or v != v for v in vals):
        raise PlacementFlagError(f"{flag} {text!r}: no item may be negative")
    return vals


# flag (long name) -> the PlacementAsk field it sets and how its text is read
def _fit(flag: str, text: str) -> bool:
    if text in TRUTHY:
        return True
    if text in FALSEY:
        return False
    raise PlacementFlagError(f"{flag} {text!r}: takes on or off")


def _split_mode(flag: str, text: str) -> str:
    if text in ("none", "layer"):
        return text
    if text in ("row", "tensor"):
        raise PlacementFlagError(f"{flag} {text}: splitting one layer's weights over cards is not served "
                                 f"(none or layer)")
    raise PlacementFlagError(f"{flag} {text!r}: takes none or layer")


def _tensor_split(flag: str, text: str) -> tuple[float, ...]:
    vals = _numbers(flag, text, float)
    if not any(vals):
        raise PlacementFlagError(f"{flag} {text!r}: every share is 0; at least one card must take a share")
    return vals


READERS = {
    "--cpu-moe": ("cpu_moe", lambda flag, v: bool(v)),
    "--n-cpu-moe": ("n_cpu_moe", _int),
    "--override-tensor": ("overrides", parse_overrides),
    "--fit": ("fit", _fit),
    "--fit-target": ("fit_target_mib", lambda flag, t: _numbers(flag, t, lambda x: int(x, 10))),
    "--fit-ctx": ("fit_ctx", _int),
    "--tensor-split": ("tensor_split", _tensor_split),
    "--main-gpu": ("main_gpu", _int),
    "--split-mode": ("split_mode", _split_mode),
}


def _said(field: str, v) -> str:
    if field == "cpu_moe":
        return "every routed expert tensor on the host" if v else "off"
    if field == "n_cpu_moe":
        return ("no layer's routed experts on the host" if not v else "layer 0's routed experts on the host"
                if v == 1 else f"the routed experts of layers 0 .. {v - 1} on the host (all, where the file has fewer)")
    if field == "overrides":
        return "; ".join(f"tensors matching {o.pattern!r} on {o.device}" for o in v)
    if field == "fit":
        return "the plan fits the card (experts to the host where needed)" if v else \
            "no fitting: a model over the card is refused"
    if field == "fit_target_mib":
        return ("every card keeps " if len(v) == 1 else "cards keep ") + ", ".join(f"{m} MiB" for m in v) + " free"
    if field == "fit_ctx":
        return f"the fitted context goes no lower than {v}"
    if field == "tensor_split":
        return ("the other cards' shares of the routed experts the main card does not hold "
                + ":".join(f"{x:g}" for x in v) + " (the main card's own share is what its bytes hold)")
    if field == "main_gpu":
        return f"CUDA{v} runs every layer"
    return "one card only" if v == "none" else "layers on one card, routed experts over the others"


def read(given: dict[str, tuple[str, object]]) -> tuple[PlacementAsk, list[tuple[str, dict]]]:
    """{long name: (spelling as given, raw value)} -> (the ask, one record per flag saying how it was read)."""
    kw: dict = {}
    notes = []
    for long, (name, raw) in given.items():
        field, reader = READERS[long]
        v = reader(name, raw if isinstance(raw, bool) else str(raw))
        if field == "overrides":
            v = kw.get("overrides", ()) + v
        kw[field] = v
        notes.append(("placement flag read", {"flag": name, "as": long, "value": raw, "read": _said(field, v)}))
    return PlacementAsk(**kw), notes
