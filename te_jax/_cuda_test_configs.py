"""The cases of tests/test_cuda_attention.py, here so `python -m te_jax.aot --set tests` can precompile exactly the
kernels the GPU tests use. Each case: dtype, b, sq, skv, h, hkv, d, dv, mask, window, softcap, alibi, ragged."""

CASES = [
    # name,                   dtype,      b, sq,  skv, h, hkv, d,   dv,  mask,                          window,  cap,  alibi, ragged
    ("plain_d64",             "bfloat16", 2, 128, 128, 4, 4,   64,  64,  "no_mask",                     (-1, -1), 0.0, False, False),
    ("causal_d128",           "bfloat16", 2, 200, 200, 4, 2,   128, 128, "causal",                      (-1, -1), 0.0, False, False),
    ("causal_br_d128",        "bfloat16", 2, 70,  190, 4, 1,   128, 128, "causal_bottom_right",         (-1, -1), 0.0, False, False),
    ("causal_br_sq_gt_skv",   "bfloat16", 1, 150, 60,  2, 2,   64,  64,  "causal_bottom_right",         (-1, -1), 0.0, False, False),
    ("padding_ragged_fp16",   "float16",  3, 130, 150, 4, 2,   64,  64,  "padding",                     (-1, -1), 0.0, False, True),
    ("padding_causal_ragged", "bfloat16", 3, 160, 160, 2, 2,   128, 128, "padding_causal",              (-1, -1), 0.0, False, True),
    ("padding_causal_br",     "float16",  3, 100, 180, 4, 4,   64,  64,  "padding_causal_bottom_right", (-1, -1), 0.0, False, True),
    ("window_causal",         "bfloat16", 2, 300, 300, 4, 2,   64,  64,  "causal",                      (40, 0),  0.0, False, False),
    ("window_both",           "float16",  2, 200, 260, 2, 1,   128, 128, "no_mask",                     (17, 33), 0.0, False, False),
    ("softcap_d128",          "bfloat16", 2, 150, 150, 4, 4,   128, 128, "causal",                      (-1, -1), 30.0, False, False),
    ("alibi_d64",             "float16",  2, 140, 140, 4, 2,   64,  64,  "causal",                      (-1, -1), 0.0, True, False),
    ("softcap_alibi_window",  "bfloat16", 2, 180, 180, 4, 4,   64,  64,  "padding_causal",              (32, -1), 20.0, True, True),
    ("mqa_d_ne_dv",           "bfloat16", 2, 100, 120, 8, 1,   40,  72,  "no_mask",                     (-1, -1), 0.0, False, False),
    ("d_ne_dv_causal_fp16",   "float16",  1, 90,  90,  2, 2,   96,  32,  "causal",                      (-1, -1), 0.0, False, False),
    ("d8",                    "bfloat16", 2, 64,  64,  2, 2,   8,   8,   "causal",                      (-1, -1), 0.0, False, False),
    ("d256",                  "bfloat16", 1, 200, 200, 2, 2,   256, 256, "causal",                      (-1, -1), 0.0, False, False),
    ("d256_fp16_padding",     "float16",  2, 96,  96,  2, 1,   256, 256, "padding",                     (-1, -1), 0.0, False, True),
    ("d_ne_dv_big",           "bfloat16", 1, 100, 100, 2, 2,   256, 128, "no_mask",                     (-1, -1), 0.0, False, False),
    ("d192_softcap_alibi_win", "bfloat16", 2, 150, 170, 4, 2,  192, 128, "padding_causal_bottom_right", (48, -1), 20.0, True, True),
    ("d256_gqa_window_fp16",  "float16",  2, 260, 300, 8, 2,   256, 256, "no_mask",                     (70, 50), 0.0, False, False),
]

# Decode-shaped cases (Sq <= 16: the decode kernels, cpp/cuda/kernels/decode/), tests/test_cuda_decode.py: GQA packing
# of 1-80 query heads per K/V head with 1-16 positions (the kernels of one and four row tiles, padding rows, several
# row blocks), split-KV (b x Hkv small against long keys), every mask and variant, ragged lengths. One row tile takes
# the shallow ring when its CTAs fit in one wave of it (on an H200, up to 396 CTAs at d <= 128), else the deep one:
# dec_many_ctas_deep_ring has 448.
DECODE_CASES = [
    # name,                   dtype,      b, sq, skv,   h,  hkv, d,   dv,  mask,                          window,   cap,  alibi, ragged
    ("dec_sq1_gqa4_ragged",   "bfloat16", 3, 1,  3000,  8,  2,   128, 128, "padding_causal_bottom_right", (-1, -1), 0.0,  False, True),
    ("dec_sq1_mha_fp16",      "float16",  2, 1,  700,   4,  4,   64,  64,  "no_mask",                     (-1, -1), 0.0,  False, False),
    ("dec_sq4_gqa8_variants", "bfloat16", 2, 4,  1500,  16, 2,   128, 128, "causal_bottom_right",         (300, 0), 20.0, True,  False),
    ("dec_sq16_gqa4",         "bfloat16", 2, 16, 2000,  8,  2,   128, 128, "causal_bottom_right",         (-1, -1), 0.0,  False, False),
    ("dec_sq16_g12_ragged",   "bfloat16", 2, 16, 600,   12, 1,   64,  64,  "padding_causal_bottom_right", (-1, -1), 0.0,  False, True),
    ("dec_mqa_g80",           "bfloat16", 1, 2,  500,   80, 1,   64,  64,  "no_mask",                     (-1, -1), 0.0,  False, False),
    ("dec_d256",              "bfloat16", 2, 1,  1000,  4,  1,   256, 256, "causal_bottom_right",         (-1, -1), 0.0,  False, False),
    ("dec_d_ne_dv_fp16",      "float16",  2, 3,  400,   6,  3,   192, 128, "causal",                      (-1, -1), 0.0,  True,  False),
    ("dec_sq_gt_skv",         "bfloat16", 1, 9,  5,     4,  2,   64,  64,  "causal_bottom_right",         (-1, -1), 0.0,  False, False),
    ("dec_d8",                "bfloat16", 2, 2,  300,   2,  1,   8,   8,   "no_mask",                     (-1, -1), 5.0,  False, False),
    ("dec_window_both_fp16",  "float16",  2, 5,  900,   4,  2,   64,  64,  "no_mask",                     (100, 20), 0.0, False, False),
    ("dec_many_ctas_deep_ring", "bfloat16", 56, 1, 700, 16, 8,  128, 128, "padding_causal_bottom_right", (-1, -1), 0.0,  False, True),
    ("dec_long_splits",       "bfloat16", 1, 1,  20000, 8,  1,   128, 128, "causal_bottom_right",         (-1, -1), 0.0,  False, False),
]

# Packed-sequence cases (segment ids and positions: the kernels built with tokens), tests/test_cuda_packed.py: the
# case as above and the kind of tokens (ids from random document lengths, unsorted random ids, ids + positions, random
# positions, decode-style q positions). Lengths of several key and query tiles (64).
PACKED_CASES = [
    # name,                     dtype,      b, sq,  skv, h, hkv, d,   dv,  mask,      window,   cap,  alibi, ragged  tokens
    (("pk_ids_causal_d128",     "bfloat16", 4, 500, 500, 4, 2,   128, 128, "causal",  (-1, -1), 0.0,  False, False), "ids"),
    (("pk_ids_nomask_d64_fp16", "float16",  4, 300, 300, 4, 4,   64,  64,  "no_mask", (-1, -1), 0.0,  False, False), "ids"),
    (("pk_pos_causal_window",   "bfloat16", 4, 400, 400, 4, 2,   64,  64,  "causal",  (50, -1), 0.0,  False, False), "ids+positions"),
    (("pk_pos_window_both",     "float16",  4, 260, 260, 2, 1,   128, 128, "no_mask", (30, 20), 0.0,  False, False), "ids+positions"),
    (("pk_softcap_alibi",       "bfloat16", 4, 300, 300, 4, 4,   64,  64,  "causal",  (-1, -1), 20.0, True,  False), "ids+positions"),
    (("pk_random_ids_skv",      "bfloat16", 4, 200, 330, 4, 2,   64,  64,  "causal",  (-1, -1), 0.0,  False, False), "random_ids"),
    (("pk_random_positions",    "float16",  4, 250, 250, 2, 2,   64,  64,  "causal",  (-1, -1), 0.0,  True,  False), "random_positions"),
    (("pk_decode_positions",    "bfloat16", 4, 7,   500, 8, 2,   128, 128, "causal",  (-1, -1), 0.0,  False, False), "decode"),
    (("pk_d_ne_dv_mqa",         "bfloat16", 4, 200, 200, 8, 1,   192, 128, "causal",  (-1, -1), 0.0,  False, False), "ids"),
    (("pk_d256",                "bfloat16", 4, 200, 200, 2, 2,   256, 256, "causal",  (-1, -1), 0.0,  False, False), "ids+positions"),
    (("pk_d40_dv72",            "float16",  4, 150, 150, 2, 1,   40,  72,  "no_mask", (-1, -1), 0.0,  False, False), "ids"),
    # The sm90 forward reads sorted ids as documents (kernels/common/document_tables.cuh) and must refuse these:
    (("pk_repeated_id",         "bfloat16", 2, 400, 400, 4, 2,   128, 128, "causal",  (-1, -1), 0.0,  False, False), "repeated_id"),
    (("pk_gapped_positions",    "bfloat16", 2, 300, 300, 2, 2,   64,  64,  "causal",  (40, -1), 0.0,  False, False), "gapped_positions"),
    # and read these so: many short documents beside long ones, padding between them;
    (("pk_tiny_documents",      "float16",  3, 700, 700, 4, 4,   128, 128, "no_mask", (-1, -1), 0.0,  False, False), "tiny_documents"),
    # documents of 130-320 tokens (blocks cut short at every end), which the backward's document grid has room for.
    (("pk_long_docs_causal",    "bfloat16", 2, 700, 700, 4, 2,   128, 128, "causal",  (-1, -1), 0.0,  False, False), "long_documents"),
    (("pk_long_docs_window",    "float16",  2, 640, 640, 4, 1,   64,  64,  "no_mask", (60, 40), 0.0,  False, False), "long_documents"),
    # Rows of several of the table kernel's chunks (kDocumentTableChunk, 2048 tokens): documents across their ends, and
    # an id whose second run starts a chunk (refused only by the check across chunks).
    (("pk_chunked_docs",        "bfloat16", 2, 4200, 4200, 2, 1,  128, 128, "causal",  (-1, -1), 0.0,  False, False), "long_documents"),
    (("pk_repeat_across_chunks", "bfloat16", 1, 4200, 4200, 2, 1, 128, 128, "no_mask", (-1, -1), 0.0,  False, False), "repeated_across_chunks"),
]

# Dropout cases (the CUDA kernels built with dropout), tests/test_cuda_dropout.py: the case as above and the rate.
DROPOUT_CASES = [
    # name,                     dtype,      b, sq,  skv, h, hkv, d,   dv,  mask,                 window,   cap,  alibi, ragged  rate
    (("dr_causal_d128",         "bfloat16", 2, 300, 300, 4, 2,   128, 128, "causal",             (-1, -1), 0.0,  False, False), 0.1),
    (("dr_nomask_d64_fp16",     "float16",  2, 200, 260, 4, 4,   64,  64,  "no_mask",            (-1, -1), 0.0,  False, False), 0.5),
    (("dr_padding_variants",    "bfloat16", 3, 180, 180, 4, 4,   64,  64,  "padding_causal",     (32, -1), 20.0, True,  True),  0.3),
    (("dr_br_d_ne_dv",          "bfloat16", 2, 70,  190, 8, 1,   192, 128, "causal_bottom_right", (-1, -1), 0.0, False, False), 0.2),
    (("dr_decode_shape",        "bfloat16", 2, 4,   500, 8, 2,   128, 128, "causal_bottom_right", (-1, -1), 0.0, False, False), 0.1),
    (("dr_d256",                "float16",  1, 130, 130, 2, 2,   256, 256, "causal",             (-1, -1), 0.0,  False, False), 0.7),
]

# Additive-bias cases (the kernels built with a bias), tests/test_cuda_bias.py: the case as above, the bias's pattern
# (which of [B, H, Sq, Skv] it keeps full; the others are 1) and its dtype. Lengths that are not multiples of 8 make
# the bias rows start off 16-byte boundaries (those run the sm80 kernels; biases whose rows are whole 16-byte chunks,
# the "tma" cases among them, the sm90 kernels on sm_90a, but for a float bias at d 256, whose ring does not fit:
# "no_room"); Sq = 4 keeps a bias call off the decode kernels (a bias does anyway: "one_query", whose one-row bias's
# gradient is written straight, as a full one's).
BIAS_CASES = [
    # name,                       dtype,      b, sq,  skv, h, hkv, d,   dv,  mask,                  window,   cap,  alibi, ragged  pattern bias dtype
    (("bias_bhqk_causal_d128",    "bfloat16", 2, 200, 200, 4, 2,   128, 128, "causal",              (-1, -1), 0.0,  False, False), "bhqk", "bfloat16"),
    (("bias_1hqk_fp16_f32",       "float16",  2, 130, 150, 4, 4,   64,  64,  "no_mask",             (-1, -1), 0.0,  False, False), "1hqk", "float32"),
    (("bias_b11k_padding_ragged", "bfloat16", 3, 160, 170, 4, 2,   64,  64,  "padding_causal",      (-1, -1), 0.0,  False, True),  "b11k", "bfloat16"),
    (("bias_11qk_softcap_alibi",  "bfloat16", 2, 180, 180, 4, 4,   64,  64,  "causal",              (32, -1), 20.0, True,  False), "11qk", "float32"),
    (("bias_111k_mqa_d_ne_dv",    "bfloat16", 2, 100, 120, 8, 1,   40,  72,  "no_mask",             (-1, -1), 0.0,  False, False), "111k", "bfloat16"),
    (("bias_b1q1_bottom_right",   "float16",  2, 70,  190, 4, 1,   128, 128, "causal_bottom_right", (-1, -1), 0.0,  False, False), "b1q1", "float16"),
    (("bias_bh11_causal",         "bfloat16", 2, 90,  90,  2, 2,   64,  64,  "causal",              (-1, -1), 0.0,  True,  False), "bh11", "float32"),
    (("bias_1hqk_d256_b1",        "bfloat16", 1, 150, 150, 2, 2,   256, 256, "causal",              (-1, -1), 0.0,  False, False), "1hqk", "float32"),
    (("bias_bhqk_odd_lengths",    "float16",  2, 77,  93,  2, 1,   96,  32,  "no_mask",             (17, 33), 0.0,  False, False), "bhqk", "bfloat16"),
    (("bias_b11k_decode_shape",   "bfloat16", 2, 4,   300, 8, 2,   128, 128, "causal_bottom_right", (-1, -1), 0.0,  False, False), "b11k", "bfloat16"),
    (("bias_1hqk_d192_dv128",     "bfloat16", 2, 120, 140, 4, 2,   192, 128, "padding",             (-1, -1), 5.0,  False, True),  "1hqk", "bfloat16"),
    (("bias_b11k_tma_ragged",     "bfloat16", 3, 160, 176, 4, 2,   64,  64,  "padding_causal",      (-1, -1), 0.0,  False, True),  "b11k", "bfloat16"),
    (("bias_1hqk_d256_f32_no_room", "float16",  1, 150, 160, 2, 2,   256, 256, "causal",              (-1, -1), 0.0,  False, False), "1hqk", "float32"),
    (("bias_bhqk_tma_d192_window", "bfloat16", 2, 120, 136, 4, 2,  192, 128, "padding",             (40, 8),  5.0,  True,  True),  "bhqk", "float16"),
    (("bias_bh1k_tma_gqa_br",     "float16",  2, 130, 264, 8, 2,   128, 128, "causal_bottom_right", (-1, -1), 0.0,  False, False), "bh1k", "bfloat16"),
    (("bias_bh1k_tma_one_query",  "bfloat16", 2, 1,   264, 8, 2,   128, 128, "causal_bottom_right", (-1, -1), 0.0,  False, False), "bh1k", "bfloat16"),
    (("bias_b11k_tma_d256",       "float16",  2, 100, 128, 2, 2,   256, 256, "causal",              (-1, -1), 0.0,  False, False), "b11k", "bfloat16"),
]

# Packed sequences with a bias (the kernels built with both): a packed case, its kind of tokens, the bias pattern and
# dtype.
BIAS_PACKED_CASES = [
    (PACKED_CASES[0][0], "ids", "1hqk", "bfloat16"),
    (PACKED_CASES[4][0], "ids+positions", "b11k", "float32"),
]

_DTYPE_CODES = {"bfloat16": 1, "float16": 2}
_BIAS_DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
_BIAS_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DECODE_MAX_SEQLEN_Q = 16  # cpp/cuda/kernels/decode/tile_size.h

# The modules the GPU tests run: each case's configuration in the forward and both backward kinds (the tests run every
# case with deterministic=False and True), with the kernel features its list adds (tokens, dropout, a bias dtype). A
# forward of at most 16 query positions without such features takes the decode kernels.
_KINDS = (("forward", False), ("backward", False), ("backward", True))


def _configs(cases, **features) -> list[dict]:
  keys = sorted({(direction, deterministic, direction == "forward" and not features and c[3] <= _DECODE_MAX_SEQLEN_Q,
                  _DTYPE_CODES[c[1]], c[7], c[8], c[11] > 0, c[12])
                 for c in cases for direction, deterministic in _KINDS})
  return [dict(direction=dr, deterministic=det, decode=dec, dtype=dt, head_dim=d, head_dim_v=dv, softcap=sc, alibi=al,
               **features) for dr, det, dec, dt, d, dv, sc, al in keys]


def bias_fits_tma(case, pattern: str, bias_dtype: str) -> bool:
  """Whether a case's bias rows are whole 16-byte chunks of keys (cpp/cuda/kernel_config.h, BiasFitsTma): the sm90
  family's on sm_90a."""
  return pattern[3] != "1" and case[4] * _BIAS_DTYPE_BYTES[bias_dtype] % 16 == 0


def _bias_configs(case, tokens: bool, pattern: str, bias_dtype: str) -> list[dict]:
  fits = bias_fits_tma(case, pattern, bias_dtype)
  return [dict(c, bias_fits_tma=fits)
          for c in _configs([case], tokens=tokens, bias_dtype=_BIAS_DTYPE_CODES[bias_dtype])]


CONFIGS = (_configs(CASES + DECODE_CASES) + _configs([c for c, _ in DROPOUT_CASES], dropout=True) +
           _configs([c for c, _ in PACKED_CASES], tokens=True) +
           [config for case, tokens, pattern, bias in [(c, False, p, b) for c, p, b in BIAS_CASES] +
                                                      [(c, True, p, b) for c, _, p, b in BIAS_PACKED_CASES]
            for config in _bias_configs(case, tokens, pattern, bias)])
CONFIGS = [c for i, c in enumerate(CONFIGS) if c not in CONFIGS[:i]]  # bias cases may share a module
