// Drives llama.cpp's own sampler chain (libllama) over rows of logits, the way
// llama-server's common_sampler_init builds it without a model: logit_bias,
// penalties, top_n_sigma, top_k, typical, top_p, min_p, xtc, temp_ext, dist.
// (dry needs a vocab; at its default multiplier 0 it does nothing.)
// Usage: sampler_golden V SEED TEMP TOP_K TOP_P MIN_P REP FREQ PRES LAST_N N_ROWS HIST_IDS_CSV
// Reads N_ROWS*V float32 from stdin; prints one chosen id per row; accepts each pick.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 12) { fprintf(stderr, "usage: see the header\n"); return 2; }
    const int n_vocab = atoi(argv[1]);
    const uint32_t seed = (uint32_t) strtoul(argv[2], nullptr, 10);
    const float temp = atof(argv[3]);
    const int top_k = atoi(argv[4]);
    const float top_p = atof(argv[5]), min_p = atof(argv[6]);
    const float rep = atof(argv[7]), freq = atof(argv[8]), pres = atof(argv[9]);
    const int last_n = atoi(argv[10]), n_rows = atoi(argv[11]);

    llama_sampler * chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(chain, llama_sampler_init_penalties(n_vocab, last_n, rep, freq, pres));
    llama_sampler_chain_add(chain, llama_sampler_init_top_n_sigma(-1.0f));
    llama_sampler_chain_add(chain, llama_sampler_init_top_k(top_k));
    llama_sampler_chain_add(chain, llama_sampler_init_typical(1.0f, 0));
    llama_sampler_chain_add(chain, llama_sampler_init_top_p(top_p, 0));
    llama_sampler_chain_add(chain, llama_sampler_init_min_p(min_p, 0));
    llama_sampler_chain_add(chain, llama_sampler_init_xtc(0.0f, 0.1f, 0, seed));
    llama_sampler_chain_add(chain, llama_sampler_init_temp_ext(temp, 0.0f, 1.0f));
    llama_sampler_chain_add(chain, llama_sampler_init_dist(seed));
    llama_sampler_reset(chain);   // what llama-server's init_sampler does first

    if (argc > 12) {
        std::stringstream ss(argv[12]);
        std::string item;
        while (std::getline(ss, item, ',')) if (!item.empty()) llama_sampler_accept(chain, atoi(item.c_str()));
    }
    std::vector<float> logits(n_vocab);
    std::vector<llama_token_data> cur(n_vocab);
    for (int r = 0; r < n_rows; r++) {
        if (fread(logits.data(), sizeof(float), n_vocab, stdin) != (size_t) n_vocab) return 3;
        for (int i = 0; i < n_vocab; i++) cur[i] = llama_token_data{i, logits[i], 0.0f};
        llama_token_data_array arr = {cur.data(), (size_t) n_vocab, -1, false};
        llama_sampler_apply(chain, &arr);
        const llama_token id = arr.data[arr.selected].id;
        llama_sampler_accept(chain, id);
        printf("%d\n", id);
    }
    llama_sampler_free(chain);
    return 0;
}
