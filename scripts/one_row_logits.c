// Logits of tokens decoded one at a time by an unpatched llama.cpp: the reference that the
// kernel exactness checks (tests/kernel_checks.py) hold the patched library's one-row and
// batched decodes to. build_peers.py builds it beside the peers, from the same sources.
//
//   specee-one-row-logits MODEL N_CTX PROMPT NEXT OUT
//
// PROMPT and NEXT are comma-separated token ids, each decoded alone (so that no batched
// kernel, whose rows llama.cpp rounds differently, fills the cache); the logits of each
// token of NEXT (n_vocab float32) are appended to the file OUT. Two threads, llama.cpp's
// default context otherwise.
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int parse_tokens(const char * text, llama_token ** out) {
    int n = 1;
    for (const char * p = text; *p; ++p) {
        n += *p == ',';
    }
    *out = malloc(sizeof(llama_token) * n);
    int k = 0;
    for (const char * p = text; *p;) {
        char * end;
        long v = strtol(p, &end, 10);
        if (end == p) {
            return -1;
        }
        (*out)[k++] = (llama_token) v;
        p = *end == ',' ? end + 1 : end;
    }
    return k;
}

static int decode(struct llama_context * ctx, struct llama_batch * b, const llama_token * toks,
                  int n, int pos) {
    b->n_tokens = n;
    for (int i = 0; i < n; ++i) {
        b->token[i] = toks[i];
        b->pos[i] = pos + i;
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = 0;
        b->logits[i] = i == n - 1;
    }
    return llama_decode(ctx, *b);
}

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL N_CTX PROMPT NEXT OUT\n", argv[0]);
        return 2;
    }
    llama_token * prompt, * next;
    const int n_prompt = parse_tokens(argv[3], &prompt);
    const int n_next = parse_tokens(argv[4], &next);
    if (n_prompt < 1 || n_next < 1) {
        fprintf(stderr, "token ids must be comma-separated integers\n");
        return 2;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (model == NULL) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) atoi(argv[2]);
    cp.n_batch = cp.n_ubatch = 16;   // as the checks' contexts
    cp.n_threads = cp.n_threads_batch = 2;
    cp.no_perf = true;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == NULL) {
        fprintf(stderr, "cannot make a context of %s tokens\n", argv[2]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch b = llama_batch_init(16, 0, 1);
    FILE * out = fopen(argv[5], "wb");
    if (out == NULL) {
        fprintf(stderr, "cannot write %s\n", argv[5]);
        return 1;
    }
    int rc = 0;
    for (int i = 0; i < n_prompt && rc == 0; ++i) {
        rc = decode(ctx, &b, prompt + i, 1, i);
    }
    for (int i = 0; i < n_next && rc == 0; ++i) {
        rc = decode(ctx, &b, next + i, 1, n_prompt + i);
        if (rc == 0 && fwrite(llama_get_logits_ith(ctx, -1), sizeof(float), n_vocab, out)
                != (size_t) n_vocab) {
            rc = -1;
        }
    }
    fclose(out);
    if (rc != 0) {
        fprintf(stderr, "decode failed (%d)\n", rc);
    }
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(prompt);
    free(next);
    return rc == 0 ? 0 : 1;
}
