"""A grammar program: a table of nodes, and the byte-level pushdown automaton that runs it.

Nodes (each a tuple, referenced by index; index 0 is the root):
  ("lit", text)            exactly these UTF-8 bytes
  ("seq", (a, b, ...))     one after the other; () matches nothing (epsilon)
  ("alt", (a, b, ...))     any one of them (several may be alive at once)
  ("star", a)              zero or more a
  ("str", max_chars, no_lt, raw)  a JSON string with no escapes ("..."), or raw (no quotes,
                           one line, ends where the text after it begins); at most max_chars
                           characters (None: unbounded); no_lt forbids '<'
  ("num", integer_only)    a JSON number (or integer)

A state is the frozenset of live stacks; each stack is a tuple of frames (node, sub),
top last, and every stack in a state has a terminal (lit, str, num) on top or is
empty (the program is complete). States are interned to small ints and each (state,
byte) transition is memoised, so a program becomes a lazily built DFA: after warm-up
a token costs one dict lookup per byte. The program is plain JSON (to_json /
from_json) so it travels to the engine inside SamplingParams.
"""
from __future__ import annotations

import json

# the JSON number lexer: state -> {byte class -> state}; accepting states end a number
_DIGITS = frozenset(b"0123456789")
_ACCEPT = frozenset({2, 3, 5, 8})


def _num_step(st: int, b: int, integer_only: bool) -> int:
    d = b in _DIGITS
    if st == 0:
        return 1 if b == 0x2D else 2 if b == 0x30 else 3 if d else -1
    if st == 1:
        return 2 if b == 0x30 else 3 if d else -1
    if st in (2, 3, 5):
        if st != 2 and d:
            return st
        if integer_only:
            return -1
        if b == 0x2E and st != 5:
            return 4
        return 6 if b in (0x65, 0x45) else -1
    if st == 4:
        return 5 if d else -1
    if st == 6:
        return 7 if b in (0x2B, 0x2D) else 8 if d else -1
    if st in (7, 8):
        return 8 if d else -1
    return -1


class ProgramError(ValueError):
    """A node table that is not a program (a front bug, or a damaged message)."""


class Program:
    def __init__(self, nodes: list[tuple]):
        if not nodes:
            raise ProgramError("a grammar program needs at least one node")
        self.nodes = [tuple(n) for n in nodes]
        self._lits = {}
        for i, n in enumerate(self.nodes):
            kind = n[0]
            if kind == "lit":
                self._lits[i] = n[1].encode("utf-8")
                if not self._lits[i]:
                    raise ProgramError(f"node {i}: an empty literal")
            elif kind in ("seq", "alt"):
                self.nodes[i] = (kind, tuple(int(c) for c in n[1]))
            elif kind not in ("star", "str", "num"):
                raise ProgramError(f"node {i}: unknown kind {kind!r}")
        self._ids: dict[frozenset, int] = {}
        self._states: list[frozenset] = []
        self._trans: list[dict[int, int]] = []
        self.start = self._intern(self._expand_all([((0, self._init(0)),)]))

    # -- JSON form ---------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(self.nodes, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "Program":
        try:
            return cls(json.loads(text))
        except (TypeError, ValueError, IndexError) as e:
            raise ProgramError(f"grammar program does not decode: {e}") from None

    # -- the automaton -----------------------------------------------------
    def _init(self, nid: int):
        kind = self.nodes[nid][0]
        if kind == "str":
            return (0, 0) if self.nodes[nid][3] else (-1, 0)   # raw strings have no opening quote
        return 0

    def _expand(self, stack: tuple, out: set) -> None:
        while True:
            if not stack:
                out.add(stack)
                return
            nid, sub = stack[-1]
            node = self.nodes[nid]
            kind = node[0]
            if kind == "lit" or (kind == "str" and not node[3]):
                out.add(stack)
                return
            if kind == "str":               # raw: may end here or go on
                out.add(stack)
                stack = stack[:-1]
                continue
            if kind == "num":
                out.add(stack)
                if sub not in _ACCEPT:
                    return
                stack = stack[:-1]
                continue
            if kind == "seq":
                stack = stack[:-1] + tuple((c, self._init(c)) for c in reversed(node[1]))
                continue
            if kind == "alt":
                base = stack[:-1]
                for c in node[1]:
                    self._expand(base + ((c, self._init(c)),), out)
                return
            # star: stop here, or one more item above the star
            self._expand(stack[:-1], out)
            stack = stack + ((node[1], self._init(node[1])),)

    def _expand_all(self, stacks) -> frozenset:
        out: set = set()
        for s in stacks:
            self._expand(s, out)
        return frozenset(out)

    def _intern(self, state: frozenset) -> int:
        sid = self._ids.get(state)
        if sid is None:
            sid = len(self._states)
            self._ids[state] = sid
            self._states.append(state)
            self._trans.append({})
        return sid

    def _step_stack(self, stack: tuple, b: int):
        nid, sub = stack[-1]
        node = self.nodes[nid]
        kind = node[0]
        if kind == "lit":
            lit = self._lits[nid]
            if lit[sub] != b:
                return None
            return stack[:-1] if sub + 1 == len(lit) else stack[:-1] + ((nid, sub + 1),)
        if kind == "num":
            st = _num_step(sub, b, node[1])
            return None if st < 0 else stack[:-1] + ((nid, st),)
        # str
        n_chars, pending = sub
        max_chars, no_lt, raw = node[1], node[2], node[3]
        if n_chars < 0:
            return stack[:-1] + ((nid, (0, 0)),) if b == 0x22 else None
        if pending:
            return stack[:-1] + ((nid, (n_chars, pending - 1)),) if 0x80 <= b <= 0xBF else None
        if b == 0x22 and not raw:
            return stack[:-1]
        if b < 0x20 or b == 0x5C or b == 0x7F or (b == 0x3C and no_lt):
            return None
        if b < 0x80:
            more = 0
        elif 0xC2 <= b <= 0xDF:
            more = 1
        elif 0xE0 <= b <= 0xEF:
            more = 2
        elif 0xF0 <= b <= 0xF4:
            more = 3
        else:
            return None
        if max_chars is None:
            return stack[:-1] + ((nid, (0, more)),)     # unbounded: no count, so one state for all lengths
        if n_chars + 1 > max_chars:
            return None
        return stack[:-1] + ((nid, (n_chars + 1, more)),)

    def step(self, sid: int, b: int) -> int:
        """The state after byte b from state sid; -1 when b is not allowed there."""
        got = self._trans[sid].get(b)
        if got is not None:
            return got
        nxt = []
        for stack in self._states[sid]:
            if stack:
                s = self._step_stack(stack, b)
                if s is not None:
                    nxt.append(s)
        got = self._intern(self._expand_all(nxt)) if nxt else -1
        if got >= 0 and not self._states[got]:
            got = -1
        self._trans[sid][b] = got
        return got

    def walk(self, sid: int, data: bytes) -> int:
        trans = self._trans
        for b in data:
            got = trans[sid].get(b)
            sid = self.step(sid, b) if got is None else got
            if sid < 0:
                return -1
        return sid

    def complete(self, sid: int) -> bool:
        """The text so far is a whole document."""
        return () in self._states[sid]

    def done(self, sid: int) -> bool:
        """Complete, and nothing may follow."""
        return self._states[sid] == frozenset({()})

    @property
    def n_states(self) -> int:
        return len(self._states)
