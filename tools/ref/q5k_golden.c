// tools/ref/make_q5k_golden.py's reference: ggml's own mul_mat of a Q5_K weight [K, N] by f32 activations
// [K, T] on the CPU (ggml_vec_dot_q5_K_q8_K under 8 columns, the tiled K-quant matmul from 8), one thread.
// usage: q5k_golden K N T w.bin x.bin out.bin (out: [T, N] f32)
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
#include "ggml-cpu.h"
int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: K N T w.bin x.bin out.bin\n"); return 2; }
    int K = atoi(argv[1]), N = atoi(argv[2]), T = atoi(argv[3]);
    struct ggml_init_params ip = { (size_t)512 << 20, NULL, false };
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_tensor *w = ggml_new_tensor_2d(ctx, GGML_TYPE_Q5_K, K, N);
    struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, T);
    FILE *f = fopen(argv[4], "rb"); if (fread(w->data, 1, ggml_nbytes(w), f) != ggml_nbytes(w)) return 3; fclose(f);
    f = fopen(argv[5], "rb"); if (fread(x->data, 1, ggml_nbytes(x), f) != ggml_nbytes(x)) return 4; fclose(f);
    struct ggml_tensor *y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    if (ggml_graph_compute_with_ctx(ctx, gf, 1) != GGML_STATUS_SUCCESS) return 5;
    f = fopen(argv[6], "wb"); fwrite(y->data, 1, ggml_nbytes(y), f); fclose(f);
    ggml_free(ctx);
    return 0;
}
