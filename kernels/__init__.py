"""bloomery's CUDA kernel sources (*.cu, *.cuh), read by bloomery.engine.cuda.kernels."""
