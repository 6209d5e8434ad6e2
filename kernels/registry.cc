// kernels/registry.cc — the table of variants.
#include "kernels/registry.h"

#include <set>

namespace lockstep::kernels {

Registry::Registry() {
  variants_ = {
      {"attn_prefill", "expanded", "cpu",
       "MLA prefill: expand each cached latent to per-head K/V with kv_b_proj (transformers' form)", true, true,
       true},
      {"attn_prefill", "absorbed", "cpu", "MLA prefill in the absorbed form, like decode", true, true, false},
      {"attn_decode", "absorbed", "cpu",
       "MLA decode: W_UK folded into q, attention over the latent cache, W_UV after (FlashMLA's form)", true, true,
       true},
      {"attn_decode", "expanded", "cpu", "MLA decode with per-head K/V expanded from the latent (reference form)",
       true, true, false},
      {"indexer", "reference", "cpu",
       "V3.2 lightning indexer: Σ_h w_h·ReLU(q_h·k_t) over all causal keys, exact top-k (ties: lowest position)",
       true, true, true},
      {"indexer", "hadamard", "cpu",
       "V3.2 indexer with the official Hadamard rotation of q and k (orthogonal: same scores up to rounding)", true,
       true, false},
      {"gemm", "fp32", "cpu", "fp32 GEMM, 16-lane FMA dot products in a fixed order", true, true, true},
  };
}

const Registry& Registry::Get() {
  static const Registry r;
  return r;
}

const KernelVariant* Registry::Find(std::string_view op, std::string_view name, std::string_view backend) const {
  for (const auto& v : variants_) {
    if (v.op == op && v.name == name && v.backend == backend) return &v;
  }
  return nullptr;
}

std::string Registry::Default(std::string_view op, std::string_view backend) const {
  for (const auto& v : variants_) {
    if (v.op == op && v.backend == backend && v.is_default) return v.name;
  }
  return "";
}

Result<KernelChoice> Registry::Resolve(const KernelChoice& requested, std::string_view backend) const {
  KernelChoice out;
  std::set<std::string> ops;
  for (const auto& v : variants_) {
    if (v.backend == backend) ops.insert(v.op);
  }
  for (const auto& [op, name] : requested) {
    if (!ops.count(op)) {
      std::string known;
      for (const auto& o : ops) known += (known.empty() ? "" : ", ") + o;
      return Status::InvalidArgument("--kernel " + op + "=" + name + ": unknown op '" + op + "' (ops: " + known + ")");
    }
    const KernelVariant* v = Find(op, name, backend);
    if (v == nullptr || v->fault) {
      std::string known;
      for (const auto& x : variants_) {
        if (x.op == op && x.backend == backend && !x.fault) known += (known.empty() ? "" : ", ") + x.name;
      }
      return Status::InvalidArgument("--kernel " + op + "=" + name + ": unknown variant (" + op + ": " + known + ")");
    }
  }
  for (const auto& op : ops) {
    auto it = requested.find(op);
    out[op] = it != requested.end() ? it->second : Default(op, backend);
  }
  return out;
}

Status ParseKernelOverride(std::string_view spec, KernelChoice* into) {
  auto eq = spec.find('=');
  if (eq == std::string_view::npos || eq == 0 || eq + 1 == spec.size()) {
    return Status::InvalidArgument("--kernel '" + std::string(spec) + "': expected op=variant, e.g. attn_decode=expanded");
  }
  (*into)[std::string(spec.substr(0, eq))] = std::string(spec.substr(eq + 1));
  return Status::Ok();
}

}  // namespace lockstep::kernels
