// bf16 CUDA kernels of a GPT-2 block with fp32 arithmetic, mirroring exec/cpu/kernels.cpp line for
// line where it can: one element per thread or one row per warp, nothing clever.
#include "exec/cuda/kernels.cuh"

#include <cmath>

#include "exec/cuda/launch.cuh"

namespace pw::exec::cuda {

namespace {

using namespace detail;
using std::int64_t;

// ---- embedding -----------------------------------------------------------------------------

// wte holds the vocabulary rows [v_begin, v_begin + rows) (all V rows: v_begin 0, rows V); ids
// outside it give zeros (vocabulary-parallel: the TP group's sum has every row). wpe may be null.
__global__ void embedding_forward_kernel(bf16* out, const std::int32_t* tokens, const bf16* wte,
                                         const bf16* wpe, int B, int T, int C, int V, int v_begin,
                                         int rows, int* bad_ids) {
  const int64_t n = int64_t(B) * T * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bt = i / C;
    const int c = int(i % C), t = int(bt % T);
    const std::int32_t id = tokens[bt];
    if (id < 0 || id >= V) {
      out[i] = b16(0.0f);
      if (c == 0 && bad_ids) atomicAdd(bad_ids, 1);
      continue;
    }
    const int row = id - v_begin;
    const float e = row >= 0 && row < rows ? f32(wte[int64_t(row) * C + c]) : 0.0f;
    out[i] = b16(wpe ? e + f32(wpe[int64_t(t) * C + c]) : e);
  }
}

// out[i] += wpe[(first + i) % T] (after a vocabulary-parallel lookup's sum; SP: a rank's rows).
__global__ void add_positions_kernel(bf16* out, const bf16* wpe, int64_t N, int64_t first, int T,
                                     int C) {
  const int64_t n = N * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int t = int((first + i / C) % T), c = int(i % C);
    out[i] = b16(f32(out[i]) + f32(wpe[int64_t(t) * C + c]));
  }
}

constexpr int kEmbedPerThread = 4;  // channels per thread in the wte backward

// Block (i, y): position i, channels [y * 1024, y * 1024 + 1024). Only the block of an id's first
// position works: it walks all positions in chunks of 256, finds the matches with ballots and sums
// their rows in position order. Blocks of later positions leave at the chunk that shows an earlier
// match. So each dwte row has one writer and a fixed summation order.
// dwte holds the vocabulary rows [v_begin, v_begin + rows): other ids add nothing here.
__global__ void embedding_backward_wte_kernel(bf16* dwte, const bf16* dout,
                                              const std::int32_t* tokens, int N, int C, int v_begin,
                                              int rows) {
  __shared__ unsigned masks[kThreads / kWarp];
  const int i = blockIdx.x;
  const std::int32_t id = tokens[i];
  if (id < v_begin || id - v_begin >= rows) return;  // the same for the whole block
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int c0 = blockIdx.y * kThreads * kEmbedPerThread + threadIdx.x;
  float acc[kEmbedPerThread] = {};
  for (int j0 = 0; j0 < N; j0 += kThreads) {
    const int j = j0 + threadIdx.x;
    const bool match = j < N && tokens[j] == id;
    if (__syncthreads_or(match && j < i)) return;  // an earlier position owns this id
    const unsigned bits = __ballot_sync(kFull, match);
    if (lane == 0) masks[warp] = bits;
    __syncthreads();
    for (int w = 0; w < kThreads / kWarp; ++w) {
      for (unsigned m = masks[w]; m != 0; m &= m - 1) {
        const int jj = j0 + w * kWarp + (__ffs(int(m)) - 1);
        const bf16* row = dout + int64_t(jj) * C;
        for (int k = 0; k < kEmbedPerThread; ++k) {
          const int c = c0 + k * kThreads;
          if (c < C) acc[k] += f32(row[c]);
        }
      }
    }
    __syncthreads();  // the next chunk rewrites masks
  }
  for (int k = 0; k < kEmbedPerThread; ++k) {
    const int c = c0 + k * kThreads;
    if (c < C) {
      bf16* d = dwte + int64_t(id - v_begin) * C + c;
      *d = b16(f32(*d) + acc[k]);
    }
  }
}

// dwpe[t, c] += sum over samples of dout[b, t, c].
__global__ void embedding_backward_wpe_kernel(bf16* dwpe, const bf16* dout, int B, int T, int C) {
  const int64_t n = int64_t(T) * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < B; ++b)
      acc += f32(dout[int64_t(b) * n + i]);
    dwpe[i] = b16(f32(dwpe[i]) + acc);
  }
}

// ---- LayerNorm -------------------------------------------------------------------------------

// One warp per row; lane l owns channels l, l + 32, ...
__global__ void layernorm_forward_kernel(bf16* out, float* mean, float* rstd, const bf16* inp,
                                         const bf16* weight, const bf16* bias, int N, int C) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;  // whole warps leave
  const bf16* x = inp + row * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += kWarp)
    s += f32(x[c]);
  const float m = warp_sum(s) / float(C);
  float v = 0.0f;
  for (int c = lane; c < C; c += kWarp) {
    const float d = f32(x[c]) - m;
    v += d * d;
  }
  const float r = 1.0f / sqrtf(warp_sum(v) / float(C) + 1e-5f);
  bf16* o = out + row * C;
  for (int c = lane; c < C; c += kWarp)
    o[c] = b16((f32(x[c]) - m) * r * f32(weight[c]) + f32(bias[c]));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dx = rstd (dnorm - mean(dnorm) - xhat mean(dnorm xhat)), dnorm = dout * weight. Each element is
// read and written by one lane only, so dinp == dout is safe.
__global__ void layernorm_backward_input_kernel(bf16* dinp, const bf16* dout, const bf16* inp,
                                                const bf16* weight, const float* mean,
                                                const float* rstd, int N, int C, bool accumulate) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;
  const bf16* d = dout + row * C;
  const bf16* x = inp + row * C;
  const float m = mean[row], s = rstd[row];
  float dnorm_mean = 0.0f, dnorm_xhat_mean = 0.0f;
  for (int c = lane; c < C; c += kWarp) {
    const float xhat = (f32(x[c]) - m) * s;
    const float dnorm = f32(d[c]) * f32(weight[c]);
    dnorm_mean += dnorm;
    dnorm_xhat_mean += dnorm * xhat;
  }
  dnorm_mean = warp_sum(dnorm_mean) / float(C);
  dnorm_xhat_mean = warp_sum(dnorm_xhat_mean) / float(C);
  bf16* dx = dinp + row * C;
  for (int c = lane; c < C; c += kWarp) {
    const float xhat = (f32(x[c]) - m) * s;
    const float v = (f32(d[c]) * f32(weight[c]) - dnorm_mean - xhat * dnorm_xhat_mean) * s;
    dx[c] = b16(accumulate ? f32(dx[c]) + v : v);
  }
}

// Column sums over N rows: a block is 32 columns x 16 row groups; the groups' partial sums meet in
// shared memory in a fixed order. dweight += sum dout * xhat, dbias += sum dout (LayerNorm), or
// with a null dweight just dbias += sum dout (a linear layer's bias).
constexpr int kColGroups = 16;
__global__ void column_sums_kernel(bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                                   const float* mean, const float* rstd, int N, int C) {
  __shared__ float sw[kColGroups][kWarp + 1], sb[kColGroups][kWarp + 1];
  const int c = blockIdx.x * kWarp + threadIdx.x;
  float aw = 0.0f, ab = 0.0f;
  if (c < C) {
    for (int r = threadIdx.y; r < N; r += kColGroups) {
      const int64_t k = int64_t(r) * C + c;
      const float d = f32(dout[k]);
      if (dweight) aw += d * ((f32(inp[k]) - mean[r]) * rstd[r]);
      ab += d;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float tw = 0.0f, tb = 0.0f;
    for (int y = 0; y < kColGroups; ++y) {
      tw += sw[y][threadIdx.x];
      tb += sb[y][threadIdx.x];
    }
    if (dweight) dweight[c] = b16(f32(dweight[c]) + tw);
    dbias[c] = b16(f32(dbias[c]) + tb);
  }
}

void column_sums(bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp, const float* mean,
                 const float* rstd, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const dim3 block(kWarp, kColGroups);
  column_sums_kernel<<<unsigned((C + kWarp - 1) / kWarp), block, 0, stream>>>(
      dweight, dbias, dout, inp, mean, rstd, N, C);
  check_launch();
}

// ---- GELU --------------------------------------------------------------------------------------

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

__global__ void gelu_forward_kernel(bf16* out, const bf16* inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = f32(inp[i]);
    out[i] = b16(0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x))));
  }
}

__global__ void gelu_backward_kernel(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = f32(inp[i]);
    const float u = kGeluScale * (x + 0.044715f * x * x * x);
    const float th = tanhf(u);
    const float sech2 = 1.0f - th * th;
    const float g =
        0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = b16(g * f32(dout[i]));
  }
}

// ---- attention softmax -------------------------------------------------------------------------

// One warp per row; row r is query t = r % T. Each element is touched by one lane only.
// Row r holds the scaled scores of query t = r0 + r % n (n = T, r0 = 0: whole (T, T) matrices).
__global__ void causal_softmax_kernel(bf16* att, int64_t rows, int n, int r0, int T) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  const int t = r0 + int(row % n);
  bf16* p = att + row * T;
  float mx = -INFINITY;  // j = 0 is always in range, so the row maximum is finite
  for (int j = lane; j <= t; j += kWarp)
    mx = fmaxf(mx, f32(p[j]));
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int j = lane; j <= t; j += kWarp)
    sum += expf(f32(p[j]) - mx);
  const float inv = 1.0f / warp_sum(sum);
  for (int j = lane; j < T; j += kWarp)
    p[j] = j <= t ? b16(expf(f32(p[j]) - mx) * inv) : b16(0.0f);
}

// One warp per (matrix g, row i); query t = r0 + i, its probabilities row t - p_row0 of p's.
__global__ void attention_softmax_backward_kernel(bf16* ds, const float* dp, const bf16* p,
                                                  int64_t p_stride, int G, int n, int r0, int T,
                                                  int p_row0) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= int64_t(G) * n) return;
  const int g = int(row / n), t = r0 + int(row % n);
  const bf16* prow = p + g * p_stride + int64_t(t - p_row0) * T;
  const float* dprow = dp + row * T;
  bf16* dsrow = ds + row * T;
  float dot = 0.0f;
  for (int j = lane; j <= t; j += kWarp)
    dot += f32(prow[j]) * dprow[j];
  dot = warp_sum(dot);
  for (int j = lane; j < T; j += kWarp)
    dsrow[j] = j <= t ? b16(f32(prow[j]) * (dprow[j] - dot)) : b16(0.0f);
}

// ---- cross-entropy -----------------------------------------------------------------------------

constexpr int kLossThreads = 512;

// One block per row.
__global__ void crossentropy_forward_kernel(bf16* probs, float* losses, const std::int32_t* targets,
                                            int V, int* bad_ids) {
  __shared__ float shared[kWarp];
  bf16* row = probs + int64_t(blockIdx.x) * V;
  const std::int32_t y = targets[blockIdx.x];
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    mx = fmaxf(mx, f32(row[j]));
  mx = block_reduce(mx, shared, -INFINITY, Max());
  float sum = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    sum += expf(f32(row[j]) - mx);
  sum = block_reduce(sum, shared, 0.0f, Add());
  if (threadIdx.x == 0) {
    const bool ok = y >= 0 && y < V;
    // -log p_y = log(sum) - (logit_y - max)
    losses[blockIdx.x] = ok ? logf(sum) - (f32(row[y]) - mx) : 0.0f;
    if (!ok && bad_ids) atomicAdd(bad_ids, 1);
  }
  __syncthreads();  // row[y] is read above before any thread overwrites it
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    row[j] = b16(expf(f32(row[j]) - mx) * inv);
}

// Columns j of the logits are vocabulary rows v_begin + j (vocabulary-parallel; 0 otherwise).
__global__ void crossentropy_backward_kernel(bf16* dlogits, const bf16* probs,
                                             const std::int32_t* targets, float scale, int N, int V,
                                             int v_begin) {
  const int64_t n = int64_t(N) * V;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / V;
    const int j = int(i % V);
    const float d = f32(probs[i]) * scale;
    dlogits[i] = b16(j + v_begin == targets[r] ? d - scale : d);
  }
}

// Vocabulary-parallel cross-entropy (Megatron), one block per row of this rank's logits (N, Vt),
// of which the first `valid` columns are real vocabulary rows (the rest padding). maxima (N, t)
// and sums (2N) start at zero and are summed over the TP group between the kernels.
__global__ void vp_row_max_kernel(float* maxima, const bf16* logits, int Vt, int valid, int t,
                                  int tp) {
  __shared__ float shared[kWarp];
  const bf16* row = logits + int64_t(blockIdx.x) * Vt;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < valid; j += blockDim.x)
    mx = fmaxf(mx, f32(row[j]));
  mx = block_reduce(mx, shared, -INFINITY, Max());
  if (threadIdx.x == 0) maxima[int64_t(blockIdx.x) * t + tp] = mx;
}

__device__ float vp_row_max(const float* maxima, int r, int t) {
  float m = -INFINITY;
  for (int k = 0; k < t; ++k)
    m = fmaxf(m, maxima[int64_t(r) * t + k]);
  return m;
}

// sums[r]: this rank's sum of exp(logit - max); sums[N + r]: the target's logit - max on the rank
// that holds the target's row (0 elsewhere).
__global__ void vp_exp_sums_kernel(float* sums, const bf16* logits, const float* maxima,
                                   const std::int32_t* targets, int N, int Vt, int valid, int t,
                                   int v_begin, int V, int* bad_ids) {
  __shared__ float shared[kWarp];
  const int r = blockIdx.x;
  const bf16* row = logits + int64_t(r) * Vt;
  const float m = vp_row_max(maxima, r, t);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < valid; j += blockDim.x)
    sum += expf(f32(row[j]) - m);
  sum = block_reduce(sum, shared, 0.0f, Add());
  if (threadIdx.x == 0) {
    sums[r] = sum;
    const std::int32_t y = targets[r];
    if (y < 0 || y >= V) {
      if (bad_ids) atomicAdd(bad_ids, 1);
    } else if (y - v_begin >= 0 && y - v_begin < valid) {
      sums[N + r] = f32(row[y - v_begin]) - m;
    }
  }
}

// Logits become probabilities (padding 0) and losses[r] = log(sum) - (target logit - max).
__global__ void vp_normalize_kernel(bf16* probs, float* losses, const float* sums,
                                    const float* maxima, const std::int32_t* targets, int N, int Vt,
                                    int valid, int t, int V) {
  const int r = blockIdx.x;
  bf16* row = probs + int64_t(r) * Vt;
  const float m = vp_row_max(maxima, r, t), s = sums[r];
  if (threadIdx.x == 0) {
    const std::int32_t y = targets[r];
    losses[r] = y >= 0 && y < V ? logf(s) - sums[N + r] : 0.0f;
  }
  const float inv = 1.0f / s;
  for (int j = threadIdx.x; j < Vt; j += blockDim.x)
    row[j] = b16(j < valid ? expf(f32(row[j]) - m) * inv : 0.0f);
}

__global__ void mean_loss_kernel(float* out, const float* losses, int N) {
  __shared__ double shared[kWarp];
  double s = 0.0;
  for (int i = threadIdx.x; i < N; i += blockDim.x)
    s += double(losses[i]);
  s = block_reduce(s, shared, 0.0, Add());
  if (threadIdx.x == 0) *out = float(s / double(N));
}

// ---- elementwise -------------------------------------------------------------------------------

__global__ void add_bias_kernel(bf16* out, const bf16* bias, int64_t N, int64_t OC, int64_t ld) {
  const int64_t n = N * OC;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / OC, c = i % OC;
    bf16* o = out + r * ld + c;
    *o = b16(f32(*o) + f32(bias[c]));
  }
}

__global__ void residual_add_kernel(bf16* out, const bf16* a, const bf16* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = b16(f32(a[i]) + f32(b[i]));
}

__global__ void cast_to_bf16_kernel(bf16* out, const float* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = b16(in[i]);
}

__global__ void cast_to_float_kernel(float* out, const bf16* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = f32(in[i]);
}

}  // namespace

void embedding_forward(bf16* out, const std::int32_t* tokens, const bf16* wte, const bf16* wpe,
                       int B, int T, int C, int V, int* bad_ids, cudaStream_t stream) {
  const int64_t n = int64_t(B) * T * C;
  if (n <= 0) return;
  embedding_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, tokens, wte, wpe, B, T, C, V,
                                                                 0, V, bad_ids);
  check_launch();
}

void embedding_forward_vp(bf16* out, const std::int32_t* tokens, const bf16* wte, int v_begin,
                          int rows, int B, int T, int C, int V, int* bad_ids, cudaStream_t stream) {
  const int64_t n = int64_t(B) * T * C;
  if (n <= 0) return;
  embedding_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, tokens, wte, nullptr, B, T, C,
                                                                 V, v_begin, rows, bad_ids);
  check_launch();
}

void add_positions(bf16* out, const bf16* wpe, std::int64_t N, std::int64_t first, int T, int C,
                   cudaStream_t stream) {
  const int64_t n = N * C;
  if (n <= 0) return;
  add_positions_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, wpe, N, first, T, C);
  check_launch();
}

void embedding_backward(bf16* dwte, bf16* dwpe, const bf16* dout, const std::int32_t* tokens, int B,
                        int T, int C, int V, cudaStream_t stream) {
  embedding_backward_vp(dwte, dwpe, dout, tokens, B, T, C, 0, V, stream);
}

void embedding_backward_vp(bf16* dwte, bf16* dwpe, const bf16* dout, const std::int32_t* tokens,
                           int B, int T, int C, int v_begin, int rows, cudaStream_t stream) {
  const int N = B * T;
  if (N <= 0 || C <= 0) return;
  const dim3 grid(unsigned(N),
                  unsigned((C + kThreads * kEmbedPerThread - 1) / (kThreads * kEmbedPerThread)));
  embedding_backward_wte_kernel<<<grid, kThreads, 0, stream>>>(dwte, dout, tokens, N, C, v_begin,
                                                               rows);
  check_launch();
  embedding_backward_wpe_kernel<<<grid_for(int64_t(T) * C), kThreads, 0, stream>>>(dwpe, dout, B, T,
                                                                                   C);
  check_launch();
}

void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                       const bf16* bias, int N, int C, cudaStream_t stream) {
  if (N <= 0) return;
  layernorm_forward_kernel<<<rows_grid(N), kThreads, 0, stream>>>(out, mean, rstd, inp, weight,
                                                                  bias, N, C);
  check_launch();
}

void layernorm_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C,
                        bool accumulate, cudaStream_t stream) {
  if (N <= 0) return;
  // The parameter gradients first: with dinp == dout the input gradient overwrites dout.
  column_sums(dweight, dbias, dout, inp, mean, rstd, N, C, stream);
  layernorm_backward_input_kernel<<<rows_grid(N), kThreads, 0, stream>>>(
      dinp, dout, inp, weight, mean, rstd, N, C, accumulate);
  check_launch();
}

void gelu_forward(bf16* out, const bf16* inp, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  gelu_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, inp, n);
  check_launch();
}

void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, std::int64_t n,
                   cudaStream_t stream) {
  if (n <= 0) return;
  gelu_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(dinp, inp, dout, n);
  check_launch();
}

void causal_softmax_forward(bf16* att, std::int64_t rows, int T, cudaStream_t stream) {
  if (rows <= 0) return;
  causal_softmax_kernel<<<rows_grid(rows), kThreads, 0, stream>>>(att, rows, T, 0, T);
  check_launch();
}

void causal_softmax_rows(bf16* att, int G, int n, int r0, int T, cudaStream_t stream) {
  const int64_t rows = int64_t(G) * n;
  if (rows <= 0) return;
  causal_softmax_kernel<<<rows_grid(rows), kThreads, 0, stream>>>(att, rows, n, r0, T);
  check_launch();
}

void attention_softmax_backward(bf16* ds, const float* dp, const bf16* p, std::int64_t p_stride,
                                int G, int n, int r0, int T, cudaStream_t stream, int p_row0) {
  const int64_t rows = int64_t(G) * n;
  if (rows <= 0) return;
  attention_softmax_backward_kernel<<<rows_grid(rows), kThreads, 0, stream>>>(ds, dp, p, p_stride,
                                                                              G, n, r0, T, p_row0);
  check_launch();
}

void crossentropy_forward(bf16* probs, float* losses, const std::int32_t* targets, int N, int V,
                          int* bad_ids, cudaStream_t stream) {
  if (N <= 0) return;
  crossentropy_forward_kernel<<<unsigned(N), kLossThreads, 0, stream>>>(probs, losses, targets, V,
                                                                        bad_ids);
  check_launch();
}

void crossentropy_backward(bf16* dlogits, const bf16* probs, const std::int32_t* targets,
                           float scale, int N, int V, cudaStream_t stream) {
  const int64_t n = int64_t(N) * V;
  if (n <= 0) return;
  crossentropy_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(dlogits, probs, targets, scale,
                                                                     N, V, 0);
  check_launch();
}

void crossentropy_backward_vp(bf16* dlogits, const bf16* probs, const std::int32_t* targets,
                              float scale, int N, int Vt, int v_begin, cudaStream_t stream) {
  const int64_t n = int64_t(N) * Vt;
  if (n <= 0) return;
  crossentropy_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(dlogits, probs, targets, scale,
                                                                     N, Vt, v_begin);
  check_launch();
}

void crossentropy_forward_vp(bf16* probs, float* losses, const std::int32_t* targets, int N, int Vt,
                             int valid, int t, int tp, int v_begin, int V, float* scratch,
                             const std::function<void(float*, std::int64_t)>& tp_sum, int* bad_ids,
                             cudaStream_t stream) {
  if (N <= 0) return;
  float* maxima = scratch;
  float* sums = scratch + int64_t(N) * t;
  CUDA_CHECK(
      cudaMemsetAsync(scratch, 0, std::size_t(int64_t(N) * (t + 2)) * sizeof(float), stream));
  vp_row_max_kernel<<<unsigned(N), kLossThreads, 0, stream>>>(maxima, probs, Vt, valid, t, tp);
  check_launch();
  tp_sum(maxima, int64_t(N) * t);
  vp_exp_sums_kernel<<<unsigned(N), kLossThreads, 0, stream>>>(sums, probs, maxima, targets, N, Vt,
                                                               valid, t, v_begin, V, bad_ids);
  check_launch();
  tp_sum(sums, 2 * int64_t(N));
  vp_normalize_kernel<<<unsigned(N), kLossThreads, 0, stream>>>(probs, losses, sums, maxima,
                                                                targets, N, Vt, valid, t, V);
  check_launch();
}

void mean_loss(float* out, const float* losses, int N, cudaStream_t stream) {
  if (N <= 0) return;
  mean_loss_kernel<<<1, 1024, 0, stream>>>(out, losses, N);
  check_launch();
}

void bias_backward(bf16* dbias, const bf16* dout, int N, int OC, cudaStream_t stream) {
  column_sums(nullptr, dbias, dout, nullptr, nullptr, nullptr, N, OC, stream);
}

void add_bias(bf16* out, const bf16* bias, std::int64_t N, std::int64_t OC, std::int64_t ld,
              cudaStream_t stream) {
  if (N * OC <= 0) return;
  add_bias_kernel<<<grid_for(N * OC), kThreads, 0, stream>>>(out, bias, N, OC, ld);
  check_launch();
}

void residual_add(bf16* out, const bf16* a, const bf16* b, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  residual_add_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, a, b, n);
  check_launch();
}

void cast_to_bf16(bf16* out, const float* in, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  cast_to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, in, n);
  check_launch();
}

void cast_to_float(float* out, const bf16* in, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  cast_to_float_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, in, n);
  check_launch();
}

}  // namespace pw::exec::cuda
