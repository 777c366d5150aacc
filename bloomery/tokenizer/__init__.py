"""llama.cpp-compatible tokenizer built from a GGUF file's vocabulary (BPE and SPM)."""
from .stream import StreamDecoder
from .tokenizer import Tokenizer
from .errors import TokenizerError

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError"]
