// Row tiles: the layout of a packed weight bound to the CPU kernels (models/cpu/tiles.py writes it and says why).
// Rows go 16 to a tile; each 32-column block of a tile is stored as 32-bit words, word-major, word j holding bytes
// 4j .. 4j + 3 of each of the tile's 16 rows side by side, so that a 64-byte load puts row r's four bytes in lane
// r. int4: 4 words a block (a row's 16 bytes of nibbles: byte c holds column c low, column c + 16 high); int8: 8.
// Scales and mins: [tiles, K/G, 16] float16; an int4 weight without mins is centred, its min -centre * scale (centre
// 8, 16 with fifth bits: GGUF's Q4_0 and Q5_0). int5: masks [tiles, K/32, 2, 4], bit 4r + i of mask [h, j] the
// fifth bit of column 16h + 4j + i of row r.
#pragma once

#include <stdint.h>
#include <string.h>

#include <vector>

#include "vec.h"

namespace tokenriver {

constexpr int kTileRows = 16;

struct TiledWeight {
  const uint8_t* codes;    // [tiles, K/32, words, 16, 4]
  const uint16_t* scales;  // [tiles, K/G, 16]
  const uint16_t* mins;    // int4: [tiles, K/G, 16], or null where centred; int8: null
  const uint64_t* fifth;   // int5: [tiles, K/32, 2, 4]; else null
  int64_t N, K, G;
  bool is_int4;
  // Int8-activation products only: where each sub-chain of a row's sum ends, in blocks, ascending, the last K/32;
  // null for one chain (gemv.cpp, "one arithmetic per row"; models/row_chains.py says why a row has several).
  const int64_t* chain_ends = nullptr;

  int64_t blocks() const { return K / 32; }
  // The block where sub-chain c ends.
  int64_t chain_end(int64_t c) const { return chain_ends == nullptr ? blocks() : chain_ends[c]; }
  int64_t groups() const { return K / G; }
  int words() const { return is_int4 ? 4 : 8; }
  // A tile's codes, the bytes a product prefetches ahead of it.
  int64_t tile_bytes() const { return blocks() * words() * 64; }
  // Block b of tile t: words() × 64 bytes.
  const uint8_t* block(int64_t t, int64_t b) const { return codes + (t * blocks() + b) * words() * 64; }
  // The tile's 16 rows' scales (mins) of the group holding block b.
  const uint16_t* block_scales(int64_t t, int64_t b) const { return scales + (t * groups() + 32 * b / G) * kTileRows; }
  const uint16_t* block_mins(int64_t t, int64_t b) const { return mins + (t * groups() + 32 * b / G) * kTileRows; }
  // The 8 masks of block b of tile t (int5).
  const uint64_t* block_fifth(int64_t t, int64_t b) const { return fifth + (t * blocks() + b) * 8; }

  // Row n's block b as row-major bytes (int4: 16, int8: 32) into out.
  void row_block(int64_t n, int64_t b, uint8_t* out) const {
    const uint8_t* first = block(n / kTileRows, b) + 4 * (n % kTileRows);
    for (int j = 0; j < words(); ++j) memcpy(out + 4 * j, first + 64 * j, 4);
  }
  // Row n's fifth bits of block b as one word, bit c for column c (int5).
  uint32_t row_fifth(int64_t n, int64_t b) const {
    const uint64_t* masks = block_fifth(n / kTileRows, b);
    const int shift = 4 * static_cast<int>(n % kTileRows);
    uint32_t word = 0;
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j) word |= static_cast<uint32_t>((masks[4 * h + j] >> shift) & 0xF) << (16 * h + 4 * j);
    return word;
  }
  float row_scale(int64_t n, int64_t b) const { return half_to_float(block_scales(n / kTileRows, b)[n % kTileRows]); }
  // A centred int4 weight's codes' centre: its min is -centre() * scale, exact in float32.
  float centre() const { return fifth != nullptr ? 16.0f : 8.0f; }
  float row_min(int64_t n, int64_t b) const {
    return mins != nullptr ? half_to_float(block_mins(n / kTileRows, b)[n % kTileRows]) : -centre() * row_scale(n, b);
  }
};

// Every tile of a row-major weight (N rows of row_bytes, N a multiple of 16) copied to a thread's scratch and
// rewritten over its own bytes by write(rows, tile): a tile's rows take the same bytes in either layout, so the load
// never holds a second copy of a weight (tiling.cpp, kquant.cpp's kquant_tile_records).
template <typename Write>
void rewrite_tiles(uint8_t* data, int64_t N, int64_t row_bytes, int num_threads, Write write) {
  const int64_t tile_bytes = kTileRows * row_bytes;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<uint8_t> scratch(tile_bytes);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N / kTileRows; ++t) {
      uint8_t* tile = data + t * tile_bytes;
      memcpy(scratch.data(), tile, tile_bytes);
      write(scratch.data(), tile);
    }
  }
}

}  // namespace tokenriver
