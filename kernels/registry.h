// kernels/registry.h — every op that has more than one implementation, by name.
//
// The engine resolves each op through this table; a trace records the variant of every op,
// and a replay can name another. Adding a variant = one entry here + its implementation.
// Fault variants are deliberately wrong implementations kept as test instruments (the "fault
// zoo", docs/fault-zoo.md): they carry `fault = true` and are reachable only through --fault,
// never through --kernel.
#pragma once

#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace lockstep::kernels {

struct KernelVariant {
  std::string op;        // "attn_decode"
  std::string name;      // "absorbed"
  std::string backend;   // "cpu" | "cuda"
  std::string summary;   // one line for `lockstep kernels`
  bool deterministic = true;
  bool batch_invariant = true;
  bool is_default = false;
  bool fault = false;
  // (cuda variants) The CPU's variant of the same name gives the same bits for the same inputs,
  // so a trace replayed across the two backends under it can be bit-identical
  // (tests/gpu/gpu_engine_test.cc SameVariantsGiveTheCpusBits); false where the order is
  // another library's (cuBLAS).
  bool cpu_bits = false;
  // What this variant promises against the CPU reference (the defaults, which
  // model_reference_test holds to transformers' fp32 logits): a bound on a layer's own error —
  // each layer started from the reference's input (grafted), what it adds to the residual
  // stream against the reference's addition, max|Δ| / max|ref| a row, its 90th percentile over
  // every layer and row of the fixture models (a low-precision path flips a few discrete
  // choices, an expert or a selected key, which moves single rows by O(1)) — and on the logits
  // from the reference's last hidden state, every row. tests/variant_twin_test.cc checks each;
  // docs/determinism.md lists them with the measured worst case. By number format: fp32 in
  // another order 1e-5; bf16 inputs (unit roundoff 2^-9) 3e-2; FP8 e4m3 weights (2^-4) 0.3, FP8
  // activations too 0.4; the FP8 indexer's selection 0.2; E2M1 experts 0.5; a default is the
  // reference: 0. NaN: not declared (faults declare none: they are wrong on purpose).
  double bound = std::numeric_limits<double>::quiet_NaN();
  // Not empty: this variant gives exactly the bits of that variant of the same op and backend.
  std::string same_bits_as = "";
  // Not empty: the model types (config.json's model_type) this variant runs on — the 4-bit
  // experts are DeepSeek-V4's. An engine of another model refuses it; bisect does not try it.
  std::vector<std::string> model_types = {};
  bool RunsOn(std::string_view model_type) const;
};

// The chosen variant per op, e.g. {"attn_decode": "absorbed", …}. Missing ops take the default.
using KernelChoice = std::map<std::string, std::string>;

class Registry {
 public:
  static const Registry& Get();
  const std::vector<KernelVariant>& variants() const { return variants_; }
  const KernelVariant* Find(std::string_view op, std::string_view name, std::string_view backend = "cpu") const;
  std::string Default(std::string_view op, std::string_view backend = "cpu") const;
  // Fills defaults and checks every named variant exists ("--kernel attn_decode=foo: unknown …").
  // `fault`, when not empty, names one fault variant, which replaces its op's choice.
  Result<KernelChoice> Resolve(const KernelChoice& requested, std::string_view backend = "cpu",
                               std::string_view fault = "") const;

 private:
  Registry();
  std::vector<KernelVariant> variants_;
};

// The ops of `ran` (a resolved choice on `from`) whose bits a run on `to` cannot reproduce:
// their variant is missing there, or it is a CUDA variant without the CPU's bits (cpu_bits).
// "op=variant" each, in op order; empty when from == to.
std::vector<std::string> BitsApartAcross(const KernelChoice& ran, std::string_view from, std::string_view to);

// Parses "op=variant" (from --kernel).
Status ParseKernelOverride(std::string_view spec, KernelChoice* into);

}  // namespace lockstep::kernels
