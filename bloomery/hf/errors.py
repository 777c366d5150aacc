"""The fetch refusals, each naming the repo, the file, the value and what to do."""
from __future__ import annotations


class HfError(Exception):
    """Any --hf-repo refusal; str() is the whole message."""


class SpecError(HfError):
    """The --hf-repo value itself is malformed."""


class UnknownRepo(HfError):
    """The hub has no such repo (or it is private and no token reaches it)."""


class UnknownRevision(HfError):
    """@rev names no branch, tag or commit of the repo."""


class NoSuchQuant(HfError):
    """No GGUF of the asked quant (the message lists the quants the repo has)."""


class NoSuchFile(HfError):
    """--hf-file names a file the repo does not hold."""


class Gated(HfError):
    """401/403: a gated or private repo and no (or a refused) token."""


class NetworkDown(HfError):
    """The hub cannot be reached and the cache holds nothing for this spec."""


class NotCached(HfError):
    """Offline (HF_HUB_OFFLINE / --offline) and the cache holds nothing for this spec."""


class ChecksumMismatch(HfError):
    """A downloaded file's hash is not the hub's; the bad bytes were removed."""


class DownloadFailed(HfError):
    """A download that kept failing (connection cut without progress, bad answers)."""


class DiskFull(HfError):
    """The cache's disk cannot hold what the download still needs."""
