// tests/fuzz/fuzz_safetensors.cc — the safetensors header parser on arbitrary bytes. Any
// input must give a TensorView map whose every view lies inside the input, or an error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = lockstep::engine::SafetensorsFile::ParseHeader(data, size, "fuzz.safetensors");
  if (!r.ok()) return 0;
  for (const auto& [name, t] : *r) {
    if (t.data < data || t.data + t.nbytes > data + size) std::abort();  // a view outside the file
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < t.nbytes; i += 64) sink ^= t.data[i];
  }
  return 0;
}
