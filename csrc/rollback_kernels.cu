// KV-cache compaction kernel (see rollback_kernels.cuh for the contract).
//
// One block per (row b, head h, column chunk): a slot's D elements are split into chunks of kCompactChunkBytes, each
// compacted by its own block (the destinations depend on the mask only, so the chunks are independent). The block
// walks the slots in tiles of 32: every warp ballots the tile's mask (so all threads agree on it without shared
// memory), real slot i of the tile goes to `count + popc(bits below i)`. A tile whose slots all stay in place (the
// common real prefix) costs one mask read. Otherwise the moved slots' columns are staged in shared memory, the block
// synchronises, and they are stored at their destinations. Destinations never exceed sources, so a tile's stores
// only touch slots of this tile (already staged) or of earlier tiles (already done).
#include "rollback_kernels.cuh"

namespace speculative_kernels {
namespace {

constexpr int kCompactThreads = 128;
constexpr int kMaxGridY = 65535;

// Columns of a slot one block stages: all of D, or kCompactChunkBytes worth of elements.
int chunk_columns(const CompactParams& p) {
  const int most = kCompactChunkBytes / p.element_bytes;
  return p.head_dim < most ? p.head_dim : most;
}

template <int kBytes>
struct Word;
template <>
struct Word<1> {
  using type = uint8_t;
};
template <>
struct Word<2> {
  using type = uint16_t;
};
template <>
struct Word<4> {
  using type = uint32_t;
};
template <>
struct Word<8> {
  using type = uint64_t;
};

template <typename T>
__global__ void __launch_bounds__(kCompactThreads) compact_kv_kernel(CompactParams p, int columns) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);  // [kCompactTile, width]
  const int b = static_cast<int>(blockIdx.x) / p.heads;
  const int h = static_cast<int>(blockIdx.x) % p.heads;
  const int d0 = static_cast<int>(blockIdx.y) * columns;  // this block's columns: [d0, d0 + width)
  const int width = min(columns, p.head_dim - d0);
  T* row = static_cast<T*>(p.kv) + static_cast<int64_t>(b) * p.stride_b + static_cast<int64_t>(h) * p.stride_h + d0;
  const int8_t* mask = p.slot_mask + static_cast<int64_t>(b) * p.mask_stride_b;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int tile_elements = kCompactTile * width;
  int count = 0;  // real slots before this tile (identical in every thread)
  for (int s0 = 0; s0 < p.slots; s0 += kCompactTile) {
    const int s = s0 + lane;
    const unsigned bits = __ballot_sync(0xffffffffu, s < p.slots && mask[s] != 0);
    const int n = __popc(bits);
    if (n == 0 || (count == s0 && bits == (n == 32 ? 0xffffffffu : (1u << n) - 1u))) {
      count += n;  // nothing in this tile moves
      continue;
    }
    for (int e = static_cast<int>(threadIdx.x); e < tile_elements; e += kCompactThreads) {
      const int i = e / width;
      const int d = e - i * width;
      if ((bits >> i) & 1u) tile[e] = row[static_cast<int64_t>(s0 + i) * p.stride_s + d];
    }
    __syncthreads();  // every load of the tile before any store of it
    for (int e = static_cast<int>(threadIdx.x); e < tile_elements; e += kCompactThreads) {
      const int i = e / width;
      const int d = e - i * width;
      const int dest = count + __popc(bits & ((1u << i) - 1u));
      if (((bits >> i) & 1u) && dest != s0 + i) row[static_cast<int64_t>(dest) * p.stride_s + d] = tile[e];
    }
    __syncthreads();  // the staging tile is reused by the next tile
    count += n;
  }
}

template <typename T>
cudaError_t launch_typed(const CompactParams& p, cudaStream_t stream) {
  const int columns = chunk_columns(p);
  const size_t smem = static_cast<size_t>(kCompactTile) * columns * sizeof(T);
  const dim3 grid(static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.heads),
                  static_cast<unsigned>((p.head_dim + columns - 1) / columns));
  compact_kv_kernel<T><<<grid, kCompactThreads, smem, stream>>>(p, columns);
  return cudaGetLastError();
}

}  // namespace

cudaError_t compact_kv_launch(const CompactParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.heads < 0 || p.slots < 0 || p.head_dim < 0) return cudaErrorInvalidValue;
  if (p.element_bytes != 1 && p.element_bytes != 2 && p.element_bytes != 4 && p.element_bytes != 8) {
    return cudaErrorInvalidValue;
  }
  if (static_cast<int64_t>(p.batch) * p.heads > 0x7fffffffLL) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.heads == 0 || p.slots == 0 || p.head_dim == 0) return cudaSuccess;
  const int columns = chunk_columns(p);
  if ((p.head_dim + columns - 1) / columns > kMaxGridY) return cudaErrorInvalidValue;
  switch (p.element_bytes) {
    case 1:
      return launch_typed<Word<1>::type>(p, stream);
    case 2:
      return launch_typed<Word<2>::type>(p, stream);
    case 4:
      return launch_typed<Word<4>::type>(p, stream);
    case 8:
      return launch_typed<Word<8>::type>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace speculative_kernels
