// Quantized linears on AVX512-BF16 without a dense copy of the weight (docs/quantization.md,
// "The quantized GEMM"): y = x @ W^T for fp8_rowwise (W8A8), nvfp4 (W4A16) and nvfp4_w4a4,
// reading the weight as its payload (1 byte or half a byte per element) and expanding it to
// bf16 per column block inside the GEMM.
//
// The arithmetic (the recipes' "dpbf16" form). Every quantized value is exact in bf16: an e4m3
// value (4 significant bits), and an e2m1 value times its e4m3 block scale (2 x 4 bits). So
//   D[m, n] = sum over k-pairs p = 0, 1, ... of a[m, 2p] w[n, 2p] + a[m, 2p+1] w[n, 2p+1]
// by vdpbf16ps into one fp32 lane from +0 (each product exact in fp32; on this project's CPUs
// the instruction adds the odd product first, then the even one, each rounded to fp32:
// kernels/quant/gemm.py's reference does the same), and then the scales that are left, in fp32
// and in this order:
//   fp8_rowwise  a = e4m3 payload of x's row, w = e4m3 payload of W's row;
//                y = bf16((D * s_x[m]) * s_w[n])
//   nvfp4        a = x, w = e2m1 * e4m3 block scale; y = bf16(D * g_w)   (g_w: the weight's
//                global scale; a fused [q; k; v] has one per part, so it is a per-column vector)
//   nvfp4_w4a4   a = e2m1 * block scale of x's row, w as nvfp4; y = bf16((D * g_x[m]) * g_w[n])
// The instruction reads subnormal bf16 inputs as zero and flushes subnormal results; the
// quantized operands are never subnormal (e4m3 values >= 2^-9, nvfp4 products >= 2^-7), only
// nvfp4's unquantized x can be (|x| < 2^-126: read as 0).
//
// Why the bits are batch- and thread-invariant: an output is one fp32 lane fed by the same
// instruction sequence over k-pairs in order, whatever the row count, the row tile (8 rows or
// a tail of 1..7, the same per-row instructions), the chunk of rows, the thread or the column
// block; a row's activation payload and scale come from that row alone (quant_common.h, the
// fake quantization's own functions); the expanded weight is a function of the payload only.
//
// Layouts. A weight is packed once per engine load (per call in the trainer) into column
// blocks of 32 outputs: fp8 [N/32][K/2][64 bytes] and nvfp4 [N/32][K/2][32 bytes] + block
// scales [N/32][K/16][32 bytes], zero-padded past N (and past an odd K for fp8). The byte
// order inside a k-pair's 64 / 32 bytes is the one the expansion below reads, so that it
// gives the bf16 block in bf16_logits.cpp's order ([K/2][32 columns][2]) with a few
// shuffles: e4m3 -> bf16 by two 128-entry byte tables (vpermi2b: low and high byte of the
// bf16 value, the sign or-ed in), e2m1 times its block scale by a 64-entry word table
// (vpermi2w, by magnitude code and the scale's mantissa) plus the scale's exponent. Up to 16 rows (a decode step) the tiles expand the weights
// in registers as they consume them; more rows, each column block is expanded once per chunk
// of up to 192 rows into a per-thread buffer (32 x K bf16: L1/L2) that every row tile of the
// chunk reads. The micro-kernel is bf16_logits's (8 rows x 32 columns).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"
#include "quant_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define TITAN_RL_QGEMM 1
#else
#include "dpbf16_avx2.h"  // the same bits from AVX2 FMAs: quant_linear's second form (below)
#endif
// The expanders and micro-kernels must inline into the k-pair loop: a call there (GCC left
// Nvfp4Expand::block out of line) clobbers the vector registers, and the accumulators then
// went through the stack on every k-pair (2-4x slower).
#define TITAN_RL_INLINE inline __attribute__((always_inline))

namespace titan_rl {
namespace {

constexpr int64_t QNB = 32;   // output columns per packed block
constexpr int64_t QMR = 8;    // rows per micro-tile (16 accumulators)
constexpr int64_t QMC = 192;  // rows per chunk (each column block is expanded once per chunk)
// How far ahead of the k-pair being expanded its payload is prefetched: a decode step streams
// the whole weight from memory once, and the hardware prefetcher alone left the dot products
// waiting (an 8-row fp8 tile ran at 70% of the dot-product peak from memory, 90% with 4 KB
// ahead, 96% with the payload in L1; one core, 2026-12-02).
constexpr int64_t PREFETCH_BYTES = 4096;
constexpr int64_t FMT_FP8 = 0, FMT_NVFP4 = 1, FMT_NVFP4_W4A4 = 2;

bool qgemm_available() {
#if defined(TITAN_RL_QGEMM) || defined(TITAN_RL_DPBF16_AVX2)
  return true;
#else
  return false;
#endif
}

// ---- codes --------------------------------------------------------------------------------

// The e4m3fn code of q, an e4m3 value (round_e4m3's output, |q| <= 448) or NaN (0x7F, sign kept).
inline uint8_t e4m3_code(float q) {
  const uint32_t b = f_to_bits(q), sign = (b >> 24) & 0x80u, a = b & 0x7FFFFFFFu;
  const float av = bits_to_f(a);
  const uint32_t normal = ((((a >> 23) - 120u) << 3) | ((a >> 20) & 7u)) & 0x7Fu;
  const uint32_t sub = static_cast<uint32_t>(av * 512.0f);  // exact: a multiple of 2^-9 below 2^-6
  const uint32_t c = av != av ? 0x7Fu : (av < 0.015625f ? sub : normal);
  return static_cast<uint8_t>(c | sign);
}

// The e2m1 code (bit 3 the sign) of round_e2m1(v) for |v| <= 6: the same thresholds, counted.
inline uint8_t e2m1_code(float v) {
  const float a = std::fabs(v);
  const uint32_t idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                       (a > 5.0f);
  return static_cast<uint8_t>(idx | ((f_to_bits(v) >> 28) & 8u));
}

// ---- quantize (the trainer's weights, per call) ---------------------------------------------

template <typename T>
void fp8_codes_rows(const T* x, uint8_t* codes, float* scales, int64_t N, int64_t K, float eps) {
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      const float s = row_scale(xr, K, eps);
      for (int64_t j = 0; j < K; ++j) {
        float v = to_f(xr[j]) / s;
        v = v < -FP8_MAX ? -FP8_MAX : (v > FP8_MAX ? FP8_MAX : v);
        codes[r * K + j] = e4m3_code(round_e4m3(v));
      }
      scales[r] = s;
    }
  });
}

// (codes uint8 [N, K] = the e4m3 payload's bits, scales fp32 [N, 1]): kernels.quant.quantize's
// fp8_rowwise payload and scales, bit for bit (tests/test_quant_gemm.py).
std::tuple<at::Tensor, at::Tensor> fp8_rowwise_quant(const at::Tensor& x_in, double eps) {
  TORCH_CHECK(x_in.dim() == 2, "fp8_rowwise_quant: a 2D tensor [rows, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t N = x.size(0), K = x.size(1);
  at::Tensor codes = at::empty({N, K}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({N, 1}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16) {
    fp8_codes_rows(x.data_ptr<c10::BFloat16>(), codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, K,
                   static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "fp8_rowwise_quant: bfloat16 or float32");
    fp8_codes_rows(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, K,
                   static_cast<float>(eps));
  }
  return {codes, scales};
}

template <typename T>
void nvfp4_codes_rows(const T* x, uint8_t* payload, uint8_t* bscales, float* gs, int64_t N, int64_t K, bool per_row,
                      float g_min) {
  float g_all = 0.0f;
  if (!per_row) {
    g_all = abs_max(x, N * K) / NVFP4_GLOBAL_DIV;
    g_all = g_all < g_min ? g_min : g_all;
    gs[0] = g_all;
  }
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      float g = g_all;
      if (per_row) {
        g = abs_max(xr, K) / NVFP4_GLOBAL_DIV;
        g = g < g_min ? g_min : g;
        gs[r] = g;
      }
      const float inv_g = 1.0f / g;
      for (int64_t b = 0; b < K; b += NVFP4_BLOCK) {
        float sb = abs_max(xr + b, NVFP4_BLOCK) / F4_MAX / g;
        sb = sb < E4M3_TINY ? E4M3_TINY : (sb > FP8_MAX ? FP8_MAX : sb);
        const float e = round_e4m3(sb), recip = inv_g / e;
        bscales[r * (K / NVFP4_BLOCK) + b / NVFP4_BLOCK] = e4m3_code(e);
        for (int64_t j = b; j < b + NVFP4_BLOCK; j += 2) {
          float v0 = to_f(xr[j]) * recip, v1 = to_f(xr[j + 1]) * recip;
          v0 = v0 < -F4_MAX ? -F4_MAX : (v0 > F4_MAX ? F4_MAX : v0);
          v1 = v1 < -F4_MAX ? -F4_MAX : (v1 > F4_MAX ? F4_MAX : v1);
          payload[r * (K / 2) + j / 2] = static_cast<uint8_t>(e2m1_code(v0) | (e2m1_code(v1) << 4));
        }
      }
    }
  });
}

// (payload uint8 [N, K/2] (element 2j in the low nibble), e4m3 block scales as uint8 [N, K/16],
// global scale fp32 [] (per_row: [N, 1])): kernels.quant.quantize's nvfp4 payload and scales.
std::tuple<at::Tensor, at::Tensor, at::Tensor> nvfp4_quant(const at::Tensor& x_in, bool per_row, double g_min) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % NVFP4_BLOCK == 0, "nvfp4_quant: [rows, K], K a multiple of 16");
  const at::Tensor x = x_in.contiguous();
  const int64_t N = x.size(0), K = x.size(1);
  at::Tensor payload = at::empty({N, K / 2}, x.options().dtype(at::kByte));
  at::Tensor bscales = at::empty({N, K / NVFP4_BLOCK}, x.options().dtype(at::kByte));
  at::Tensor gs = per_row ? at::empty({N, 1}, x.options().dtype(at::kFloat)) : at::empty({}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16) {
    nvfp4_codes_rows(x.data_ptr<c10::BFloat16>(), payload.data_ptr<uint8_t>(), bscales.data_ptr<uint8_t>(),
                     gs.data_ptr<float>(), N, K, per_row, static_cast<float>(g_min));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "nvfp4_quant: bfloat16 or float32");
    nvfp4_codes_rows(x.data_ptr<float>(), payload.data_ptr<uint8_t>(), bscales.data_ptr<uint8_t>(),
                     gs.data_ptr<float>(), N, K, per_row, static_cast<float>(g_min));
  }
  return {payload, bscales, gs};
}

// ---- packing --------------------------------------------------------------------------------

// fp8: a k-pair's 64 bytes are its 32 columns' (k even, k odd) codes in column order, the bf16
// block's own order (the expansion interleaves its two table look-ups back into it).
// codes [N, K] (e4m3 bits) -> packed [ceil(N/32), ceil(K/2), 64], zeros (+0) past N and K.
at::Tensor fp8_pack(const at::Tensor& codes_in) {
  TORCH_CHECK(codes_in.dim() == 2 && codes_in.element_size() == 1, "fp8_pack: 2D e4m3 codes [N, K] (1 byte each)");
  const at::Tensor codes = codes_in.contiguous();
  const int64_t N = codes.size(0), K = codes.size(1), nb = (N + QNB - 1) / QNB, kp = (K + 1) / 2;
  at::Tensor p = at::zeros({nb, kp, 2 * QNB}, codes.options().dtype(at::kByte));
  const uint8_t* src = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  uint8_t* dst = p.data_ptr<uint8_t>();
  at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < QNB && b * QNB + c < N; ++c) {
        const uint8_t* row = src + (b * QNB + c) * K;
        const int64_t s0 = 2 * c, s1 = 2 * c + 1;
        uint8_t* blk = dst + b * kp * 2 * QNB;
        for (int64_t k = 0; k + 1 < K; k += 2) {
          blk[(k / 2) * 2 * QNB + s0] = row[k];
          blk[(k / 2) * 2 * QNB + s1] = row[k + 1];
        }
        if (K % 2) blk[(K / 2) * 2 * QNB + s0] = row[K - 1];
      }
  });
  return p;
}

// nvfp4: payload [N, K/2] + block scales [N, K/16] -> (packed [ceil(N/32), K/2, 32],
// scales [ceil(N/32), K/16, 32]). Inside a k-pair's 32 bytes, column c < 16 is the low nibble
// of bytes 2c (k even) and 2c + 1 (k odd), column 16 + c their high nibble: the low nibbles
// of the 32 bytes, widened to words, are columns 0..15 in the bf16 order, the high ones 16..31.
std::tuple<at::Tensor, at::Tensor> nvfp4_pack(const at::Tensor& payload_in, const at::Tensor& bscales_in) {
  TORCH_CHECK(payload_in.dim() == 2 && payload_in.element_size() == 1, "nvfp4_pack: payload [N, K/2] (bytes)");
  const at::Tensor payload = payload_in.contiguous(), bscales = bscales_in.contiguous();
  const int64_t N = payload.size(0), K = payload.size(1) * 2, nb = (N + QNB - 1) / QNB, kp = K / 2;
  TORCH_CHECK(K % NVFP4_BLOCK == 0 && bscales.dim() == 2 && bscales.size(0) == N &&
                  bscales.size(1) == K / NVFP4_BLOCK && bscales.element_size() == 1,
              "nvfp4_pack: block scales [N, K/16] (e4m3 bytes) for a payload [N, K/2]");
  at::Tensor p = at::zeros({nb, kp, QNB}, payload.options().dtype(at::kByte));
  at::Tensor ps = at::zeros({nb, K / NVFP4_BLOCK, QNB}, payload.options().dtype(at::kByte));
  const uint8_t* src = reinterpret_cast<const uint8_t*>(payload.data_ptr());
  const uint8_t* ssrc = reinterpret_cast<const uint8_t*>(bscales.data_ptr());
  uint8_t* dst = p.data_ptr<uint8_t>();
  uint8_t* sdst = ps.data_ptr<uint8_t>();
  const int64_t kb = K / NVFP4_BLOCK;
  at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < QNB && b * QNB + c < N; ++c) {
        const int64_t n = b * QNB + c, high = c >= 16, j = (c % 16) * 2;
        const uint8_t* row = src + n * (K / 2);
        uint8_t* blk = dst + b * kp * QNB;
        for (int64_t p2 = 0; p2 < kp; ++p2) {  // pair p2: elements 2 p2 (low nibble), 2 p2 + 1 (high)
          const uint8_t byte = row[p2];
          const uint8_t lo = byte & 15u, hi = byte >> 4;
          uint8_t* d = blk + p2 * QNB + j;
          d[0] = static_cast<uint8_t>(high ? (d[0] & 15u) | (lo << 4) : (d[0] & 0xF0u) | lo);
          d[1] = static_cast<uint8_t>(high ? (d[1] & 15u) | (hi << 4) : (d[1] & 0xF0u) | hi);
        }
        for (int64_t k = 0; k < kb; ++k) sdst[(b * kb + k) * QNB + c] = ssrc[n * kb + k];
      }
  });
  return {p, ps};
}

// The calling thread's expansion buffer (kp k-pairs x 32 columns of bf16), kept between calls:
// a fresh allocation per call cost page faults on every forward.
inline uint16_t* scratch(int64_t kp) {
  struct Buf {
    uint16_t* p = nullptr;
    size_t bytes = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf b;
  const size_t need = static_cast<size_t>(kp) * 128;
  if (need > b.bytes) {
    std::free(b.p);
    b.p = static_cast<uint16_t*>(std::aligned_alloc(64, need));
    TORCH_CHECK(b.p != nullptr, "quant_linear: out of memory for the expansion buffer");
    b.bytes = need;
  }
  return b.p;
}

// The calling thread's buffer for a chunk of input rows' payload (n bf16 values), kept between
// calls.
inline uint16_t* row_chunk(int64_t n) {
  struct Buf {
    uint16_t* p = nullptr;
    size_t bytes = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf b;
  const size_t need = static_cast<size_t>((n + 31) / 32) * 64;
  if (need > b.bytes) {
    std::free(b.p);
    b.p = static_cast<uint16_t*>(std::aligned_alloc(64, need));
    TORCH_CHECK(b.p != nullptr, "quant_linear: out of memory for the input's payload");
    b.bytes = need;
  }
  return b.p;
}

#ifdef TITAN_RL_QGEMM
// ---- expansion of one column block to bf16 ([kp][32][2]) ------------------------------------

struct Fp8Tables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t mix[2][64];  // interleave (lo[i], hi[i]) for codes 0..31 and 32..63
  Fp8Tables() {
    for (int c = 0; c < 128; ++c) {
      const float v = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
      const uint16_t h = f_to_bf16(v);  // exact (NaN: 0x7FC0)
      lo[c] = static_cast<uint8_t>(h & 0xFFu);
      hi[c] = static_cast<uint8_t>(h >> 8);
    }
    for (int z = 0; z < 2; ++z)
      for (int i = 0; i < 32; ++i) {
        mix[z][2 * i] = static_cast<uint8_t>(32 * z + i);           // from the first source: low byte
        mix[z][2 * i + 1] = static_cast<uint8_t>(64 + 32 * z + i);  // bit 6: the second source, high byte
      }
  }
};

// Expanders: pair(p, w0, w1) gives the bf16 weights of k-pair p for the block's columns 0..15
// (w0) and 16..31 (w1), each [column][2]; block(kb) is called before pair 8 kb.
struct Fp8Expand {
  static constexpr int64_t PAIR_BYTES = 2 * QNB;
  const uint8_t* pw;
  __m512i lo0, lo1, hi0, hi1, sign, mix0, mix1;
  explicit Fp8Expand(const uint8_t* w) : pw(w) {
    static const Fp8Tables t;
    lo0 = _mm512_load_si512(t.lo), lo1 = _mm512_load_si512(t.lo + 64);
    hi0 = _mm512_load_si512(t.hi), hi1 = _mm512_load_si512(t.hi + 64);
    mix0 = _mm512_load_si512(t.mix[0]), mix1 = _mm512_load_si512(t.mix[1]);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
  }
  TITAN_RL_INLINE void block(int64_t) {}
  // the low and high bytes of the codes' bf16 values (bit 7, the sign, is not an index bit: or-ed in)
  TITAN_RL_INLINE void bytes(__m512i b, __m512i& lo, __m512i& hi) const {
    lo = _mm512_permutex2var_epi8(lo0, b, lo1);
    hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, b, hi1), b, sign, 0xF8);  // | (b & 0x80)
  }
  TITAN_RL_INLINE void pair(int64_t p, __m512i& w0, __m512i& w1) const {
    __m512i lo, hi;
    bytes(_mm512_loadu_si512(pw + p * 64), lo, hi);
    w0 = _mm512_permutex2var_epi8(lo, mix0, hi);
    w1 = _mm512_permutex2var_epi8(lo, mix1, hi);
  }
};

// bf16 bits of (1 + m/8) * v for the e2m1 magnitude v of code c (0..7) and an e4m3 block
// scale's mantissa m (0..7), at [c + 8 m], less 127 << 7: adding the scale's exponent part
// (E + 120) << 7 gives bf16(v * e) for e = 2^(E - 7) (1 + m/8) (both exact: <= 6 significant
// bits, exponents well inside bf16's range). c = 0 (zero) is masked, never added.
struct Nvfp4Table {
  alignas(64) uint16_t t[64];
  Nvfp4Table() {
    constexpr float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int m = 0; m < 8; ++m)
      for (int c = 0; c < 8; ++c)
        t[c + 8 * m] = c == 0 ? 0 : static_cast<uint16_t>(f_to_bf16((1.0f + m / 8.0f) * mag[c]) - (127u << 7));
  }
};

// nvfp4 without floating-point work (the dot products keep the FMA pipes; an fp32 product per
// element cost a third of the tile's speed): per element, one 64-entry word look-up by
// (magnitude code, the column's scale mantissa), plus the column's scale exponent, the sign
// or-ed in, zero codes masked to +0 (a zero weight's sign cannot change a sum started at +0),
// NaN scales (a NaN in the weight) forced to NaN.
struct Nvfp4Expand {
  static constexpr int64_t PAIR_BYTES = QNB;
  const uint8_t* pw;
  const uint8_t* ps;
  __m512i tab0, tab1, madd[2], base[2];
  __mmask32 nan[2];
  Nvfp4Expand(const uint8_t* w, const uint8_t* s) : pw(w), ps(s) {
    static const Nvfp4Table t;
    tab0 = _mm512_load_si512(t.t);
    tab1 = _mm512_load_si512(t.t + 32);
  }
  TITAN_RL_INLINE void block(int64_t kb) {
    // the 32 columns' e4m3 scale bytes as words, each column's twice (its k-pair's two lanes)
    const __m512i e = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ps + kb * QNB)));
    const __m512i dup0 = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5,
                                          4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i sixteen = _mm512_set1_epi16(16);
    for (int z = 0; z < 2; ++z) {
      const __m512i d = _mm512_permutexvar_epi16(z == 0 ? dup0 : _mm512_add_epi16(dup0, sixteen), e);
      madd[z] = _mm512_slli_epi16(_mm512_and_si512(d, _mm512_set1_epi16(7)), 3);
      base[z] = _mm512_slli_epi16(_mm512_add_epi16(_mm512_srli_epi16(d, 3), _mm512_set1_epi16(120)), 7);
      nan[z] = _mm512_cmpeq_epi16_mask(_mm512_and_si512(d, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7F));
    }
  }
  TITAN_RL_INLINE __m512i values(__m512i c, int z) const {  // c: codes in bits 3..0 of each word
    const __m512i idx = _mm512_ternarylogic_epi32(c, _mm512_set1_epi16(7), madd[z], 0xEA);  // (c & 7) | m << 3
    const __m512i t = _mm512_permutex2var_epi16(tab0, idx, tab1);
    __m512i v = _mm512_maskz_add_epi16(_mm512_test_epi16_mask(c, _mm512_set1_epi16(7)), t, base[z]);
    v = _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(c, 12), _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
    return _mm512_mask_mov_epi16(v, nan[z], _mm512_set1_epi16(0x7FC0));
  }
  TITAN_RL_INLINE void pair(int64_t p, __m512i& w0, __m512i& w1) const {
    // byte i of the pair: low nibble (column i / 2, k parity i % 2), high nibble column 16 + i / 2
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + p * QNB)));
    w0 = values(b, 0);  // the high nibble sits in bits 7..4: outside the index, the test and the sign
    w1 = values(_mm512_srli_epi16(b, 4), 1);
  }
};

template <class E>
TITAN_RL_INLINE void expand(E e, int64_t kp, uint16_t* s) {
  for (int64_t p = 0; p < kp; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(e.pw + p * E::PAIR_BYTES + PREFETCH_BYTES), _MM_HINT_T0);
    if ((p & 7) == 0) e.block(p >> 3);
    __m512i w0, w1;
    e.pair(p, w0, w1);
    _mm512_store_si512(s + p * 64, w0);
    _mm512_store_si512(s + p * 64 + 32, w1);
  }
}

// ---- micro-kernels ----------------------------------------------------------------------------

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0: common.h's f_to_bf16 (torch's), 16 lanes
TITAN_RL_INLINE __m256i bf16_of(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

TITAN_RL_INLINE __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

// y[m, n0 .. n0 + 15] = bf16((acc * rs[m]) * cs[n0 ..]) (no rs: acc * cs); cs is padded to whole blocks
TITAN_RL_INLINE void store16(__m512 acc, int64_t m, const float* rs, const float* cs, uint16_t* out, int64_t N, int64_t n0) {
  if (rs != nullptr) acc = _mm512_mul_ps(acc, _mm512_set1_ps(rs[m]));
  acc = _mm512_mul_ps(acc, _mm512_loadu_ps(cs + n0));
  _mm256_mask_storeu_epi16(out + m * N + n0, tail_mask(N - n0), bf16_of(acc));
}

// Rows m0..m0+R-1 (R <= 8) x the block's 32 columns; the weights of pair p from wsrc.get(p, w0, w1)
template <int R, class W>
TITAN_RL_INLINE void tile(const uint32_t* a, int64_t m0, int64_t kp, W wsrc, const float* rs, const float* cs, uint16_t* out,
                 int64_t N, int64_t n0) {
  const uint32_t* h[R];  // the rows as k-pairs
  for (int r = 0; r < R; ++r) h[r] = a + (m0 + r) * kp;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512i w0i, w1i;
    wsrc.get(p, w0i, w1i);
    const __m512bh w0 = (__m512bh)w0i, w1 = (__m512bh)w1i;
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(h[r][p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(acc[r][0], m0 + r, rs, cs, out, N, n0);
    store16(acc[r][1], m0 + r, rs, cs, out, N, n0 + 16);
  }
}

// weights read from an expanded block ([kp][64] bf16)
struct FromBuffer {
  const uint16_t* wb;
  TITAN_RL_INLINE void get(int64_t p, __m512i& w0, __m512i& w1) const {
    w0 = _mm512_load_si512(wb + p * 64);
    w1 = _mm512_load_si512(wb + p * 64 + 32);
  }
};

// weights expanded in registers as the row tiles of a block consume them
template <class E>
struct Direct {
  E e;
  TITAN_RL_INLINE void get(int64_t p, __m512i& w0, __m512i& w1) {
    _mm_prefetch(reinterpret_cast<const char*>(e.pw + p * E::PAIR_BYTES + PREFETCH_BYTES), _MM_HINT_T0);
    if ((p & 7) == 0) e.block(p >> 3);
    e.pair(p, w0, w1);
  }
};

#define TITAN_RL_ROWS_1_TO_7(CALL) \
  case 7: CALL(7); break;          \
  case 6: CALL(6); break;          \
  case 5: CALL(5); break;          \
  case 4: CALL(4); break;          \
  case 3: CALL(3); break;          \
  case 2: CALL(2); break;          \
  case 1: CALL(1); break;

// rows [m, me) of one column block: tiles of 8 rows and one tail tile
template <class W>
TITAN_RL_INLINE void row_tiles(const uint32_t* a, int64_t m, int64_t me, int64_t kp, const W& wsrc, const float* rs,
                      const float* cs, uint16_t* out, int64_t N, int64_t n0) {
  for (; m + QMR <= me; m += QMR) tile<QMR>(a, m, kp, wsrc, rs, cs, out, N, n0);
#define TITAN_RL_TILE(R) tile<R>(a, m, kp, wsrc, rs, cs, out, N, n0)
  switch (me - m) { TITAN_RL_ROWS_1_TO_7(TITAN_RL_TILE) default: break; }
#undef TITAN_RL_TILE
}

// One column block for rows [m0, me). Up to DIRECT_ROWS rows: tiles with the weights expanded
// in registers as each tile consumes them (a decode step: no buffer traffic; the expansion is
// cheaper than the dot products it feeds); more rows: the block expanded once into the buffer,
// read by every tile. Both multiply the same bf16 values in the same order, so the row count
// picks the speed, never the bits. (Measured at the small flavor's decode, 16 rows: two
// in-register passes 4.9 ms, one 16-row x 16-column pass 6.8 ms, the buffer 6.0 ms, oneDNN's
// bf16 GEMM 5.8 ms, one core, fp8_rowwise.)
constexpr int64_t DIRECT_ROWS = 16;

template <class E>
TITAN_RL_INLINE void column_block(E e, const uint32_t* a, int64_t m0, int64_t me, int64_t kp, const float* rs,
                                  const float* cs, uint16_t* out, int64_t N, int64_t n0) {
  if (me - m0 <= DIRECT_ROWS) {
    row_tiles(a, m0, me, kp, Direct<E>{e}, rs, cs, out, N, n0);
  } else {
    uint16_t* buf = scratch(kp);
    expand(e, kp, buf);
    row_tiles(a, m0, me, kp, FromBuffer{buf}, rs, cs, out, N, n0);
  }
}

// prep(m0, m1): make input rows [m0, m1) ready (their payload), called before they are used
template <class Rows, class Prep>
void qgemm(const Rows& rows, const float* rs, int64_t M, int64_t kp, const uint8_t* pw, const uint8_t* ps,
           const float* cs, int64_t N, int64_t fmt, uint16_t* out, const Prep& prep) {
  const int64_t nb = (N + QNB - 1) / QNB;
  const int64_t wstride = kp * (fmt == FMT_FP8 ? 2 * QNB : QNB), sstride = (kp / 8) * QNB;
  for (int64_t mc = 0; mc < M; mc += QMC) {
    const int64_t me = mc + QMC < M ? mc + QMC : M;
    prep(mc, me);  // a chunk's input payload is made just before its GEMM: still in cache
    const uint32_t* a = rows(mc);
    at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (fmt == FMT_FP8)
          column_block(Fp8Expand(pw + b * wstride), a, mc, me, kp, rs, cs, out, N, b * QNB);
        else
          column_block(Nvfp4Expand(pw + b * wstride, ps + b * sstride), a, mc, me, kp, rs, cs, out, N, b * QNB);
      }
    });
  }
}

// ---- an input row's payload and scale (the fake quantization's arithmetic, quant_common.h,
// lane by lane: the same IEEE operations on 16 elements at a time) -------------------------

inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 k) {
  const __m256i h = k == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 clamp_v(__m512 v, float lim) {  // v < -lim ? -lim : (v > lim ? lim : v); NaN passes
  v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, _mm512_set1_ps(-lim), _CMP_LT_OQ), _mm512_set1_ps(-lim));
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, _mm512_set1_ps(lim), _CMP_GT_OQ), _mm512_set1_ps(lim));
}

inline __m512 round_e4m3_v(__m512 v) {  // quant_common.h's round_e4m3
  const __m512i b = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 av = _mm512_castsi512_ps(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), odd),
                                          _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
  const __m512 M = _mm512_set1_ps(12582912.0f);
  const __m512 sub = _mm512_mul_ps(_mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(av, _mm512_set1_ps(512.0f)), M), M),
                                   _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 small = _mm512_cmp_ps_mask(av, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
  const __m512i r = _mm512_or_si512(_mm512_mask_mov_epi32(normal, small, _mm512_castps_si512(sub)), sign);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(av, av, _CMP_UNORD_Q), v);
}

inline __m512 round_e2m1_v(__m512 v) {  // quant_common.h's round_e2m1 (its sum is exact in any order)
  const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512 z = _mm512_setzero_ps();
  auto step = [&](float t, int cmp, float d) {
    return _mm512_mask_mov_ps(z, _mm512_cmp_ps_mask(a, _mm512_set1_ps(t), cmp), _mm512_set1_ps(d));
  };
  __m512 r = step(0.25f, _CMP_GT_OQ, 0.5f);
  r = _mm512_add_ps(r, step(0.75f, _CMP_GE_OQ, 0.5f));
  r = _mm512_add_ps(r, step(1.25f, _CMP_GT_OQ, 0.5f));
  r = _mm512_add_ps(r, step(1.75f, _CMP_GE_OQ, 0.5f));
  r = _mm512_add_ps(r, step(2.5f, _CMP_GT_OQ, 1.0f));
  r = _mm512_add_ps(r, step(3.5f, _CMP_GE_OQ, 1.0f));
  r = _mm512_add_ps(r, step(5.0f, _CMP_GT_OQ, 2.0f));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 signed_r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
  return _mm512_mask_mov_ps(signed_r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), v);
}

// bf16 bits of values that are exact in bf16 (a payload value: e4m3, or e2m1 times its block
// scale): the top half, which is what rounding would give; NaN -> 0x7FC0 as bf16_of does.
TITAN_RL_INLINE __m256i exact_bf16_of(__m512 v) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0)));
}

// quant_common.h's abs_max (a max is exact in any order; NaN if any element is NaN)
inline float abs_max_v(const c10::BFloat16* x, int64_t K) {
  const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF);
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t j = 0; j < K; j += 16) {
    const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(load_bf16(x + j, tail_mask(K - j))), mag));
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, a);
  }
  return nan ? NAN : _mm512_reduce_max_ps(m);
}

// fp8_rowwise: the e4m3 values of x / s as bf16 (exact) into q[0..K), the row scale s into *s.
inline void fp8_row_values_v(const c10::BFloat16* x, int64_t K, float eps, uint16_t* q, float* s) {
  // row_scale (quant_common.h) with the vector amax
  float amax = abs_max_v(x, K);
  const float lb = static_cast<float>(static_cast<c10::BFloat16>(eps));
  amax = amax < lb ? lb : amax;
  const float sc = static_cast<float>(static_cast<c10::BFloat16>(amax / FP8_MAX));
  const __m512 vs = _mm512_set1_ps(sc);
  for (int64_t j = 0; j < K; j += 16) {
    const __mmask16 k = tail_mask(K - j);
    const __m512 v = clamp_v(_mm512_div_ps(load_bf16(x + j, k), vs), FP8_MAX);
    _mm256_mask_storeu_epi16(q + j, k, exact_bf16_of(round_e4m3_v(v)));
  }
  *s = sc;
}

// nvfp4 with one global scale g per row (nvfp4_w4a4's activations): each e2m1 value times its
// block's e4m3 scale, as bf16 (exact), into q[0..K); g into *g_out. One block of 16 per vector.
inline void nvfp4_row_values_v(const c10::BFloat16* x, int64_t K, float g_min, uint16_t* q, float* g_out) {
  float g = abs_max_v(x, K) / NVFP4_GLOBAL_DIV;
  g = g < g_min ? g_min : g;
  const float inv_g = 1.0f / g;
  for (int64_t b = 0; b < K; b += NVFP4_BLOCK) {
    float sb = abs_max_v(x + b, NVFP4_BLOCK) / F4_MAX / g;
    sb = sb < E4M3_TINY ? E4M3_TINY : (sb > FP8_MAX ? FP8_MAX : sb);
    const float e = round_e4m3(sb), recip = inv_g / e;
    const __m512 v = clamp_v(_mm512_mul_ps(load_bf16(x + b, 0xFFFF), _mm512_set1_ps(recip)), F4_MAX);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b), exact_bf16_of(_mm512_mul_ps(round_e2m1_v(v), _mm512_set1_ps(e))));
  }
  *g_out = g;
}

// ---- the trainer's weights, per call: quantize, pack and fake-quantize in one pass ---------
//
// For weights [N_i, K] that read the same input (one, or q / k / v, gate / up): the packed payload
// of their concatenation (what fp8_pack / nvfp4_pack make of kernels.quant.quantize's payloads),
// the per-column scales (fp8: each row's scale; nvfp4: each part's global scale) and the dense
// fake-quantized concatenation (the backward's weight: bits of fake_quantize(w) per part).

// the e4m3 codes of 16 e4m3 values (round_e4m3_v's output), one per 32-bit lane: e4m3_code
TITAN_RL_INLINE __m512i e4m3_codes_v(__m512 q) {
  const __m512i b = _mm512_castps_si512(q);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
  const __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 av = _mm512_castsi512_ps(a);
  const __m512i normal = _mm512_and_si512(
      _mm512_or_si512(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(a, 23), _mm512_set1_epi32(120)), 3),
                      _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(7))),
      _mm512_set1_epi32(0x7F));
  const __m512i sub = _mm512_cvttps_epi32(_mm512_mul_ps(av, _mm512_set1_ps(512.0f)));  // exact integers 0..7
  __m512i c = _mm512_mask_mov_epi32(normal, _mm512_cmp_ps_mask(av, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), sub);
  c = _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(av, av, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));
  return _mm512_or_si512(c, sign);
}

// the e2m1 codes (bit 3 the sign) of 16 values |v| <= 6: e2m1_code
TITAN_RL_INLINE __m512i e2m1_codes_v(__m512 v) {
  const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512i one = _mm512_set1_epi32(1);
  __m512i idx = _mm512_setzero_si512();
  auto step = [&](float t, int cmp) {
    idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, _mm512_set1_ps(t), cmp), idx, one);
  };
  step(0.25f, _CMP_GT_OQ), step(0.75f, _CMP_GE_OQ), step(1.25f, _CMP_GT_OQ), step(1.75f, _CMP_GE_OQ);
  step(2.5f, _CMP_GT_OQ), step(3.5f, _CMP_GE_OQ), step(5.0f, _CMP_GT_OQ);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 28), _mm512_set1_epi32(8));
  return _mm512_or_si512(idx, sign);
}

struct Parts {  // row n of the concatenation -> its part and its row there
  std::vector<const c10::BFloat16*> data;
  std::vector<int64_t> start;  // first row of each part; start.back() = N
  int64_t K = 0;
  explicit Parts(const std::vector<at::Tensor>& ws) {
    start.push_back(0);
    for (const at::Tensor& w : ws) {
      data.push_back(w.data_ptr<c10::BFloat16>());
      start.push_back(start.back() + w.size(0));
    }
    K = ws[0].size(1);
  }
  int64_t N() const { return start.back(); }
  int part(int64_t n) const {
    int i = 0;
    while (start[i + 1] <= n) ++i;
    return i;
  }
  const c10::BFloat16* row(int64_t n) const {
    const int i = part(n);
    return data[i] + (n - start[i]) * K;
  }
};

std::vector<at::Tensor> bf16_parts(at::TensorList ws_in, const char* what) {
  TORCH_CHECK(!ws_in.empty(), what, ": at least one weight");
  std::vector<at::Tensor> ws;
  for (const at::Tensor& w : ws_in) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) == ws_in[0].size(1),
                what, ": 2D bfloat16 weights [N_i, K] with one K");
    ws.push_back(w.contiguous());
  }
  return ws;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_prepare(at::TensorList ws_in, double eps_d) {
  TORCH_CHECK(qgemm_available(), "fp8_prepare: this build has no AVX512-BF16 / AVX512-VBMI");
  const std::vector<at::Tensor> ws = bf16_parts(ws_in, "fp8_prepare");
  const Parts parts(ws);
  const int64_t N = parts.N(), K = parts.K, nb = (N + QNB - 1) / QNB, kp = (K + 1) / 2;
  at::Tensor packed = at::zeros({nb, kp, 2 * QNB}, ws[0].options().dtype(at::kByte));
  at::Tensor cs = at::zeros({nb * QNB}, ws[0].options().dtype(at::kFloat));
  at::Tensor dense = at::empty({N, K}, ws[0].options());
  uint8_t* pk = packed.data_ptr<uint8_t>();
  float* csp = cs.data_ptr<float>();
  uint16_t* dn = reinterpret_cast<uint16_t*>(dense.data_ptr());
  const float eps = static_cast<float>(eps_d);
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) uint8_t codes[16];
    for (int64_t n = b0 * QNB; n < std::min(b1 * QNB, N); ++n) {
      const c10::BFloat16* x = parts.row(n);
      // row_scale (quant_common.h) with the vector amax
      float amax = abs_max_v(x, K);
      const float lb = static_cast<float>(static_cast<c10::BFloat16>(eps));
      amax = amax < lb ? lb : amax;
      const float s = static_cast<float>(static_cast<c10::BFloat16>(amax / FP8_MAX));
      csp[n] = s;
      const __m512 vs = _mm512_set1_ps(s);
      uint8_t* blk = pk + (n / QNB) * kp * 2 * QNB + 2 * (n % QNB);
      for (int64_t j = 0; j < K; j += 16) {
        const __mmask16 k = tail_mask(K - j);
        const __m512 q = round_e4m3_v(clamp_v(_mm512_div_ps(load_bf16(x + j, k), vs), FP8_MAX));
        _mm256_mask_storeu_epi16(dn + n * K + j, k, bf16_of(_mm512_mul_ps(q, vs)));  // fake_quant_rows' q * s
        _mm_store_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(e4m3_codes_v(q)));
        const int64_t cnt = K - j < 16 ? K - j : 16;
        for (int64_t i = 0; i < cnt; ++i) blk[((j + i) / 2) * 2 * QNB + ((j + i) & 1)] = codes[i];
      }
    }
  });
  return {packed, cs, dense};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nvfp4_prepare(at::TensorList ws_in, double g_min_d) {
  TORCH_CHECK(qgemm_available(), "nvfp4_prepare: this build has no AVX512-BF16 / AVX512-VBMI");
  const std::vector<at::Tensor> ws = bf16_parts(ws_in, "nvfp4_prepare");
  const Parts parts(ws);
  const int64_t N = parts.N(), K = parts.K, nb = (N + QNB - 1) / QNB, kp = K / 2, kb = K / NVFP4_BLOCK;
  TORCH_CHECK(K % NVFP4_BLOCK == 0, "nvfp4_prepare: K a multiple of 16");
  const float g_min = static_cast<float>(g_min_d);
  std::vector<float> g(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {  // each part's global scale (nvfp4_rows' g_all)
    g[i] = abs_max_v(parts.data[i], ws[i].numel()) / NVFP4_GLOBAL_DIV;
    g[i] = g[i] < g_min ? g_min : g[i];
  }
  at::Tensor packed = at::zeros({nb, kp, QNB}, ws[0].options().dtype(at::kByte));
  at::Tensor pscales = at::zeros({nb, kb, QNB}, ws[0].options().dtype(at::kByte));
  at::Tensor cs = at::zeros({nb * QNB}, ws[0].options().dtype(at::kFloat));
  at::Tensor dense = at::empty({N, K}, ws[0].options());
  uint8_t* pk = packed.data_ptr<uint8_t>();
  uint8_t* psk = pscales.data_ptr<uint8_t>();
  float* csp = cs.data_ptr<float>();
  uint16_t* dn = reinterpret_cast<uint16_t*>(dense.data_ptr());
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) uint8_t codes[16];
    for (int64_t n = b0 * QNB; n < std::min(b1 * QNB, N); ++n) {
      const c10::BFloat16* x = parts.row(n);
      const float gn = g[parts.part(n)], inv_g = 1.0f / gn;
      csp[n] = gn;
      const int64_t c = n % QNB, sh = c >= 16 ? 4 : 0;  // nvfp4_pack's layout
      uint8_t* blk = pk + (n / QNB) * kp * QNB + (c % 16) * 2;
      for (int64_t b = 0; b < K; b += NVFP4_BLOCK) {  // nvfp4_rows' arithmetic, one block per vector
        float sb = abs_max_v(x + b, NVFP4_BLOCK) / F4_MAX / gn;
        sb = sb < E4M3_TINY ? E4M3_TINY : (sb > FP8_MAX ? FP8_MAX : sb);
        const float e = round_e4m3(sb), recip = inv_g / e, hp = gn * e;
        psk[((n / QNB) * kb + b / NVFP4_BLOCK) * QNB + c] = e4m3_code(e);
        const __m512 v = clamp_v(_mm512_mul_ps(load_bf16(x + b, 0xFFFF), _mm512_set1_ps(recip)), F4_MAX);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dn + n * K + b), bf16_of(_mm512_mul_ps(round_e2m1_v(v), _mm512_set1_ps(hp))));
        _mm_store_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(e2m1_codes_v(v)));
        for (int64_t i = 0; i < 16; ++i) {  // element b + i: pair (b + i) / 2, byte + its parity, nibble sh
          uint8_t* d = blk + ((b + i) / 2) * QNB + (i & 1);
          *d = static_cast<uint8_t>(*d | (codes[i] << sh));
        }
      }
    }
  });
  return {packed, pscales, cs, dense};
}
#endif

#if !defined(TITAN_RL_QGEMM) && defined(TITAN_RL_DPBF16_AVX2)
// ---- the AVX2 form: the same bits by FMAs (dpbf16_avx2.h) ------------------------------------
//
// The pieces the AVX512 form vectorises, one lane at a time with the same IEEE operations: an
// input row's payload and scale, and a column block expanded from its packed bytes to the bf16
// block ([kp][32][2]) the dot products read. Every block is expanded into the thread's buffer
// (no in-register path), then multiplied by dp2_rows; the scales after the dot products.

// bf16 bits of a value exact in bf16 (exact_bf16_of's lane)
inline uint16_t exact_bf16(float v) { return v != v ? 0x7FC0u : static_cast<uint16_t>(f_to_bits(v) >> 16); }

inline float clamp_s(float v, float lim) { return v < -lim ? -lim : (v > lim ? lim : v); }

// fp8_row_values_v's lane
inline void fp8_row_values_s(const c10::BFloat16* x, int64_t K, float eps, uint16_t* q, float* s) {
  const float sc = row_scale(x, K, eps);
  for (int64_t j = 0; j < K; ++j) q[j] = exact_bf16(round_e4m3(clamp_s(to_f(x[j]) / sc, FP8_MAX)));
  *s = sc;
}

// nvfp4_row_values_v's lane
inline void nvfp4_row_values_s(const c10::BFloat16* x, int64_t K, float g_min, uint16_t* q, float* g_out) {
  float g = abs_max(x, K) / NVFP4_GLOBAL_DIV;
  g = g < g_min ? g_min : g;
  const float inv_g = 1.0f / g;
  for (int64_t b = 0; b < K; b += NVFP4_BLOCK) {
    float sb = abs_max(x + b, NVFP4_BLOCK) / F4_MAX / g;
    sb = sb < E4M3_TINY ? E4M3_TINY : (sb > FP8_MAX ? FP8_MAX : sb);
    const float e = round_e4m3(sb), recip = inv_g / e;
    for (int64_t i = 0; i < NVFP4_BLOCK; ++i)
      q[b + i] = exact_bf16(round_e2m1(clamp_s(to_f(x[b + i]) * recip, F4_MAX)) * e);
  }
  *g_out = g;
}

// bf16 bits of each e4m3 code without its sign (NaN: 0x7FC0), and of each e4m3 byte's value
struct E4m3Table {
  uint16_t bf16[128];
  float value[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) {
      value[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
      if (c < 128) bf16[c] = f_to_bf16(value[c]);
    }
  }
};

// fp8_pack's block -> [kp][32][2] bf16: byte i of pair p is element i of the bf16 pair block
inline void fp8_expand_s(const uint8_t* pw, int64_t kp, uint16_t* s) {
  static const E4m3Table t;
  for (int64_t i = 0; i < kp * 2 * QNB; ++i)
    s[i] = static_cast<uint16_t>(t.bf16[pw[i] & 0x7Fu] | ((pw[i] & 0x80u) << 8));
}

// nvfp4_pack's block -> [kp][32][2] bf16 as Nvfp4Expand: e2m1 magnitude times the column's
// block scale (exact), the sign or-ed in, zero codes +0, a NaN scale NaN (0x7FC0)
inline void nvfp4_expand_s(const uint8_t* pw, const uint8_t* ps, int64_t kp, uint16_t* s) {
  static const E4m3Table t;
  constexpr float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int64_t p = 0; p < kp; ++p) {
    const uint8_t* sc = ps + (p / 8) * QNB;  // the block of 16 k holding pair p
    for (int64_t i = 0; i < QNB; ++i) {      // byte i: column i / 2 (low nibble), 16 + i / 2 (high), parity i % 2
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t c = half * 16 + i / 2;
        const uint8_t code = half ? pw[p * QNB + i] >> 4 : pw[p * QNB + i] & 15u;
        const uint8_t scale = sc[c];
        uint16_t v = (code & 7u) == 0 ? 0 : static_cast<uint16_t>(exact_bf16(mag[code & 7u] * t.value[scale]) | ((code & 8u) << 12));
        if ((scale & 0x7Fu) == 0x7Fu) v = 0x7FC0u;
        s[p * 2 * QNB + 2 * c + (i & 1)] = v;
      }
    }
  }
}

// The packed weight expanded to its bf16 blocks [nb][kp][32][2], once: the engine per weight
// load, the trainer per call (AVX2 has no byte permutes to expand per tile at the dot
// products' pace, so the bf16 blocks are held, 2 bytes per element).
at::Tensor expand_blocks(const at::Tensor& packed, const std::optional<at::Tensor>& pscales, int64_t fmt) {
  const int64_t nb = packed.size(0), kp = packed.size(1);
  const int64_t wstride = kp * (fmt == FMT_FP8 ? 2 * QNB : QNB), sstride = (kp / 8) * QNB;
  at::Tensor e = at::empty({nb, kp, 2 * QNB}, packed.options().dtype(at::kShort));
  const uint8_t* pw = packed.data_ptr<uint8_t>();
  const uint8_t* ps = fmt == FMT_FP8 ? nullptr : pscales->data_ptr<uint8_t>();
  uint16_t* out = reinterpret_cast<uint16_t*>(e.data_ptr());
  at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (fmt == FMT_FP8)
        fp8_expand_s(pw + b * wstride, kp, out + b * kp * 2 * QNB);
      else
        nvfp4_expand_s(pw + b * wstride, ps + b * sstride, kp, out + b * kp * 2 * QNB);
    }
  });
  return e;
}

// out[m, n] = bf16((D * rs[m]) * cs[n]) (no rs: D * cs[n]) for rows xs[0 .. M) (dp2_split's)
void qgemm_avx2(const float* xs, const float* rs, int64_t M, int64_t kp, const uint16_t* ew, const float* cs,
                int64_t N, uint16_t* out) {
  const int64_t nb = (N + QNB - 1) / QNB;
  at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* buf = ew + b * kp * 2 * QNB;
      const int64_t n0 = b * QNB;
      dp2_rows(xs, 0, M, kp, buf, N - n0 < QNB ? N - n0 : QNB,
               [=](int64_t m, int64_t rows, int64_t c0, int64_t cols, const float (*t)[16]) {
                 for (int64_t r = 0; r < rows; ++r) {
                   uint16_t* o = out + (m + r) * N + n0 + c0;
                   const float* c = cs + n0 + c0;
                   if (rs != nullptr) {
                     const float s = rs[m + r];
                     for (int64_t j = 0; j < cols; ++j) o[j] = f_to_bf16((t[r][j] * s) * c[j]);
                   } else {
                     for (int64_t j = 0; j < cols; ++j) o[j] = f_to_bf16(t[r][j] * c[j]);
                   }
                 }
               });
    }
  });
}
#endif

// The AVX2 form's held weight (expand_blocks); None where the AVX512 form expands per tile.
std::optional<at::Tensor> quant_expand(const at::Tensor& packed, const std::optional<at::Tensor>& pscales, int64_t fmt) {
#if !defined(TITAN_RL_QGEMM) && defined(TITAN_RL_DPBF16_AVX2)
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (fmt == FMT_FP8 || (pscales.has_value() && pscales->is_contiguous())),
              "quant_expand: a weight from fp8_pack / nvfp4_pack");
  return expand_blocks(packed, pscales, fmt);
#else
  (void)packed, (void)pscales, (void)fmt;
  return std::nullopt;
#endif
}

// x [M, K] bf16 @ the packed weight -> [M, n] bf16 (the arithmetic at the top of this file).
// fmt 0 fp8_rowwise (param: the amax floor), 1 nvfp4, 2 nvfp4_w4a4 (param: the global-scale floor).
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& pscales,
                        const at::Tensor& col_scale, int64_t n, int64_t fmt, double param,
                        const std::optional<at::Tensor>& expanded_in) {
  TORCH_CHECK(qgemm_available(), "quant_linear: this build has neither AVX512-BF16 + VBMI nor AVX2 with FMA");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "quant_linear: a 2D bfloat16 input");
  TORCH_CHECK(fmt == FMT_FP8 || fmt == FMT_NVFP4 || fmt == FMT_NVFP4_W4A4, "quant_linear: fmt 0, 1 or 2");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), kp = (K + 1) / 2, nb = (n + QNB - 1) / QNB;
  const bool fp8 = fmt == FMT_FP8;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(0) == nb && packed.size(1) == kp &&
                  packed.size(2) == (fp8 ? 2 * QNB : QNB) && packed.is_contiguous(),
              "quant_linear: the weight must come from ", fp8 ? "fp8_pack" : "nvfp4_pack", " for [", n, ", ", K, "]");
  TORCH_CHECK(fp8 || (K % NVFP4_BLOCK == 0 && pscales.has_value() && pscales->is_contiguous() &&
                      pscales->size(0) == nb && pscales->size(1) == K / NVFP4_BLOCK),
              "quant_linear: nvfp4 needs K a multiple of 16 and the block scales from nvfp4_pack");
  TORCH_CHECK(col_scale.dim() == 1 && col_scale.size(0) == nb * QNB && col_scale.scalar_type() == at::kFloat &&
                  col_scale.is_contiguous(),
              "quant_linear: col_scale fp32 [n rounded up to 32] (the tile reads whole blocks)");
  at::Tensor y = at::empty({M, n}, x.options());
  (void)param;  // read by the input's quantization only (not compiled without the instructions)
  (void)expanded_in;  // the AVX2 form's
  if (M == 0) return y;
#ifdef TITAN_RL_QGEMM
  // The input as the tiles read it, rows of k-pairs: x itself (nvfp4), or for fp8 / w4a4 the
  // rows' payload (exact bf16 values) and row scales, made chunk by chunk just before the
  // chunk's GEMM into the calling thread's buffer of QMC rows (still in cache when the tiles read
  // it; a fresh [M, K] tensor per call cost more in page faults than the quantization itself).
  const bool quant_rows = fmt != FMT_NVFP4;
  at::Tensor rs = quant_rows ? at::empty({M}, x.options().dtype(at::kFloat)) : at::Tensor();
  float* rsp = quant_rows ? rs.data_ptr<float>() : nullptr;
  uint16_t* buf = quant_rows ? row_chunk(std::min(M, QMC) * 2 * kp) : nullptr;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const float prm = static_cast<float>(param);
  // rows of chunk [m0, m1) as k-pairs; the tiles address row m at rows(m0) + m * kp
  auto rows = [=](int64_t m0) -> const uint32_t* {
    return quant_rows ? reinterpret_cast<const uint32_t*>(buf) - m0 * kp : reinterpret_cast<const uint32_t*>(xp);
  };
  auto prep = [=](int64_t m0, int64_t m1) {
    if (!quant_rows) return;
    at::parallel_for(m0, m1, 1, [=](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        uint16_t* row = buf + (r - m0) * 2 * kp;
        if (fp8)
          fp8_row_values_v(xp + r * K, K, prm, row, rsp + r);
        else
          nvfp4_row_values_v(xp + r * K, K, prm, row, rsp + r);
        if (K % 2) row[K] = 0;  // the odd K's pair partner: +0 (the packed weight has +0 there too)
      }
    });
  };
  qgemm(rows, rsp, M, kp, packed.data_ptr<uint8_t>(), fp8 ? nullptr : pscales->data_ptr<uint8_t>(),
        col_scale.data_ptr<float>(), n, fmt, reinterpret_cast<uint16_t*>(y.data_ptr()), prep);
#elif defined(TITAN_RL_DPBF16_AVX2)
  // as above, chunk by chunk, with the lane-by-lane row payloads and the AVX2 dot products, on
  // the expanded blocks (quant_expand's, where the caller holds them; else expanded now)
  const at::Tensor expanded = expanded_in.has_value() ? *expanded_in : expand_blocks(packed, pscales, fmt);
  TORCH_CHECK(expanded.dim() == 3 && expanded.scalar_type() == at::kShort && expanded.size(0) == nb &&
                  expanded.size(1) == kp && expanded.size(2) == 2 * QNB && expanded.is_contiguous(),
              "quant_linear: the expanded weight must come from quant_expand of this packed weight");
  const uint16_t* ew = reinterpret_cast<const uint16_t*>(expanded.data_ptr());
  float* xs = dp2_rows_buffer(std::min(M, QMC) * 2 * kp);
  const bool quant_rows = fmt != FMT_NVFP4;
  at::Tensor rs = quant_rows ? at::empty({M}, x.options().dtype(at::kFloat)) : at::Tensor();
  float* rsp = quant_rows ? rs.data_ptr<float>() : nullptr;
  uint16_t* buf = quant_rows ? row_chunk(std::min(M, QMC) * 2 * kp) : nullptr;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const float prm = static_cast<float>(param);
  for (int64_t mc = 0; mc < M; mc += QMC) {
    const int64_t me = mc + QMC < M ? mc + QMC : M;
    const uint32_t* a = reinterpret_cast<const uint32_t*>(xp) + mc * kp;
    if (quant_rows) {
      at::parallel_for(mc, me, 1, [=](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          uint16_t* row = buf + (r - mc) * 2 * kp;
          if (fp8)
            fp8_row_values_s(xp + r * K, K, prm, row, rsp + r);
          else
            nvfp4_row_values_s(xp + r * K, K, prm, row, rsp + r);
          if (K % 2) row[K] = 0;
        }
      });
      a = reinterpret_cast<const uint32_t*>(buf);
    }
    at::parallel_for(0, me - mc, 16, [=](int64_t r0, int64_t r1) { dp2_split(a, me - mc, kp, xs, r0, r1); });
    qgemm_avx2(xs, quant_rows ? rsp + mc : nullptr, me - mc, kp, ew, col_scale.data_ptr<float>(), n,
               reinterpret_cast<uint16_t*>(y.data_ptr()) + mc * n);
  }
#endif
  return y;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("quant_gemm_available() -> bool", &titan_rl::qgemm_available);
  m.def("fp8_rowwise_quant(Tensor x, float eps) -> (Tensor, Tensor)", &titan_rl::fp8_rowwise_quant);
  m.def("nvfp4_quant(Tensor x, bool per_row, float g_min) -> (Tensor, Tensor, Tensor)", &titan_rl::nvfp4_quant);
  m.def("fp8_pack(Tensor codes) -> Tensor", &titan_rl::fp8_pack);
  m.def("nvfp4_pack(Tensor payload, Tensor block_scales) -> (Tensor, Tensor)", &titan_rl::nvfp4_pack);
#ifdef TITAN_RL_QGEMM
  m.def("fp8_prepare(Tensor[] weights, float eps) -> (Tensor, Tensor, Tensor)", &titan_rl::fp8_prepare);
  m.def("nvfp4_prepare(Tensor[] weights, float g_min) -> (Tensor, Tensor, Tensor, Tensor)", &titan_rl::nvfp4_prepare);
#endif
  m.def("quant_expand(Tensor packed, Tensor? block_scales, int fmt) -> Tensor?", &titan_rl::quant_expand);
  m.def("quant_linear(Tensor x, Tensor packed, Tensor? block_scales, Tensor col_scale, int n, int fmt, float param, "
        "Tensor? expanded) -> Tensor",
        &titan_rl::quant_linear);
}
