// The Python bindings of specray's CPU kernels (declared in kernels.h).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "attention over a CPU KV cache with torch's values (heads of 16)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows with the values of torch's operations");
  m.def("write_blocks", &write_blocks, "K/V of consecutive positions per row into a head-major CPU cache");
}
