// AMX tiles (Sapphire Rapids and later), shared by the kernels that use them: the
// per-process permission and the tile configuration's layout. Everything here is
// compiled only where the build's -march has AMX-TILE and AMX-BF16.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tokenswift_amx {

// Linux hands out the AMX register state per process on request; asked once.
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of tmm0-15.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace tokenswift_amx
#endif
