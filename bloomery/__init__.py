"""bloomery: a drop-in llama-server for mixture-of-experts models larger than the GPU."""

__version__ = "0.1.0"
