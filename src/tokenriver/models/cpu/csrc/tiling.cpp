// Row tiles (models/cpu/tiles.py, the definition these are tested against byte for byte) written over a row-major
// packing's own bytes at load, in one pass (tiles.h's rewrite_tiles).

#include <stdint.h>

#include "tiles.h"

namespace {

using tokenriver::kTileRows;
using tokenriver::rewrite_tiles;

// One tile's rows [16, E] of elements (rows) → [E, 16] (out).
template <typename Element>
void transpose_tile(const Element* rows, int64_t E, Element* out) {
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < kTileRows; ++r) out[e * kTileRows + r] = rows[r * E + e];
}

// One tile's fifth-bit words [16, B] → masks [B, 2, 4]: bits 4r .. 4r + 3 of mask [h, j] are bits 16h + 4j ..
// 16h + 4j + 3 of row r's word.
void fifth_bit_masks(const uint32_t* words, int64_t B, uint64_t* out) {
  for (int64_t b = 0; b < B; ++b) {
    for (int k = 0; k < 8; ++k) {
      uint64_t mask = 0;
      for (int64_t r = 0; r < kTileRows; ++r) mask |= uint64_t((words[r * B + b] >> (4 * k)) & 0xF) << (4 * r);
      out[b * 8 + k] = mask;
    }
  }
}

}  // namespace

extern "C" {

// data [N, E] elements of element_bytes (2: scales and mins; 4: code words), N a multiple of 16 → [N / 16, E, 16]:
// tiles.py's tile_terms and tile_words. Returns 1, changing nothing, for another element size.
int tile_rows_in_place(uint8_t* data, int64_t N, int64_t E, int element_bytes, int num_threads) {
  if (element_bytes == 2) {
    rewrite_tiles(data, N, 2 * E, num_threads, [E](const uint8_t* rows, uint8_t* out) {
      transpose_tile(reinterpret_cast<const uint16_t*>(rows), E, reinterpret_cast<uint16_t*>(out));
    });
    return 0;
  }
  if (element_bytes == 4) {
    rewrite_tiles(data, N, 4 * E, num_threads, [E](const uint8_t* rows, uint8_t* out) {
      transpose_tile(reinterpret_cast<const uint32_t*>(rows), E, reinterpret_cast<uint32_t*>(out));
    });
    return 0;
  }
  return 1;
}

// Fifth-bit words [N, B] uint32, N a multiple of 16 → masks [N / 16, B, 2, 4] uint64 (the same bytes): tiles.py's
// tile_fifth_bits.
void tile_fifth_bits_in_place(uint8_t* data, int64_t N, int64_t B, int num_threads) {
  rewrite_tiles(data, N, 4 * B, num_threads, [B](const uint8_t* rows, uint8_t* out) {
    fifth_bit_masks(reinterpret_cast<const uint32_t*>(rows), B, reinterpret_cast<uint64_t*>(out));
  });
}

}  // extern "C"
