// tests/fuzz/fuzz_config.cc — config.json parsing on arbitrary bytes: an error or a config
// whose dimensions the rest of the engine can size buffers from.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "engine/config.h"
#include "engine/kv_cache.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = lockstep::engine::ModelConfig::FromJson(std::string_view(reinterpret_cast<const char*>(data), size),
                                                   "fuzz/config.json");
  if (!r.ok()) return 0;
  if (static_cast<int64_t>(r->layers.size()) != r->num_hidden_layers) std::abort();
  if (r->hidden_size <= 0) std::abort();
  if (r->is_v4()) return 0;  // V4 has no MLA latent (kv_lora_rank 0); its streams are sized per layer
  if (r->kv_lora_rank <= 0) std::abort();
  if (r->num_hidden_layers <= 64 && r->kv_lora_rank <= 4096) {
    lockstep::engine::PagedKvCache cache(*r, lockstep::engine::KvFormat::kFp8E4m3, 4, 2);
    (void)cache.latent_bytes_per_token();
  }
  return 0;
}
