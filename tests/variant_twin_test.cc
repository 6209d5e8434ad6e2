// tests/variant_twin_test.cc — every registry variant of every op, on every backend present,
// against its reference twin on each fixture model (the idea of llama.cpp's test-backend-ops),
// asserting what the variant declares in kernels/registry.cc:
//
//   * the bound, on each layer's own error: every layer of the variant's run starts from the
//     reference run's input (grafted, as `replay --graft` does), and what the layer adds to the
//     residual stream (resid_out − input), and the logits from the reference's last hidden
//     state, differ from the reference's by at most KernelVariant::bound, as
//     max|Δ| / max|ref| per row. The reference is the default configuration, which
//     model_reference_test holds to transformers' fp32 logits (≤ 1e-4; measured ~2e-6);
//     end-to-end logits of these random-weight models amplify any rounding chaotically, so a
//     bound on them would say nothing about the op;
//   * same_bits_as: an alias gives exactly the bits of the variant it names;
//   * deterministic: two runs give the same bits;
//   * batch_invariant: a request's logits are the same bits alone and beside another request;
//   * an op the model does not have: choosing another variant of it changes no bit;
//   * (cuda) cpu_bits: the CUDA variant's logits are the CPU's same-named variant's bits.
// Fault variants declare no bound; each must change the bits of at least one fixture it runs
// on (a fault that turned into a no-op would leave the zoo's tests vacuous).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <set>

#include "engine/engine.h"
#include "engine/tensor_parallel.h"
#include "kernels/registry.h"
#include "test_util.h"

// The backend whose variants this binary checks: cpu here, cuda in tests/gpu/gpu_variant_twin_test.cc
// (labelled gpu; without a device its cases skip).
#ifndef LOCKSTEP_TWIN_BACKEND
#define LOCKSTEP_TWIN_BACKEND "cpu"
#endif

namespace lockstep {
namespace {

using engine::Engine;
using engine::EngineOptions;
using engine::Model;
using kernels::KernelVariant;
using kernels::Registry;

// Rows of one request's taps by name and position: what a run computed at the points that feed
// the next layer (embed, layers.L.resid_out) and the logits.
using Rows = std::map<std::string, std::map<int64_t, std::vector<float>>>;

bool Feeds(std::string_view name) {
  return name == "embed" || (name.starts_with("layers.") && name.ends_with(".resid_out"));
}

// Keeps request 0's rows at the points that feed the next layer and, given a reference's rows,
// overwrites what feeds each layer with them (each layer then starts from the reference).
class GraftHook : public engine::TapHook {
 public:
  explicit GraftHook(const Rows* reference) : reference_(reference) {}
  void OnTap(const engine::TapEvent& e) override {
    if (e.request_id != 0 || e.data == nullptr || e.dtype != engine::TapDType::kF32) return;
    if (!Feeds(e.name) && e.name != "logits") return;
    auto& m = rows[std::string(e.name)];
    const float* d = static_cast<const float*>(e.data);
    for (int64_t r = 0; r < e.rows; ++r) m[e.position + r].assign(d + r * e.cols, d + (r + 1) * e.cols);
  }
  bool Override(const engine::TapEvent& e, void* data) override {
    if (reference_ == nullptr || e.request_id != 0 || !Feeds(e.name)) return false;
    auto it = reference_->find(std::string(e.name));
    if (it == reference_->end()) return false;
    float* d = static_cast<float*>(data);
    for (int64_t r = 0; r < e.rows; ++r) {
      auto jt = it->second.find(e.position + r);
      if (jt == it->second.end() || static_cast<int64_t>(jt->second.size()) != e.cols) return false;
      std::copy(jt->second.begin(), jt->second.end(), d + r * e.cols);
    }
    return true;
  }
  bool WantsOverride() const override { return reference_ != nullptr; }
  Rows rows;

 private:
  const Rows* reference_;
};

// The logits of one request: every prompt position, then each decode step (teacher-forced on
// the reference's greedy tokens, so every variant sees the same inputs).
struct Outcome {
  std::vector<float> logits;  // [positions, V]
  Rows rows;                  // with a hook: its rows
  bool ok = false;
  std::string error;
};

Outcome RunOne(const std::shared_ptr<Model>& model, const testing::Reference& ref, EngineOptions o,
               const std::vector<int32_t>* neighbour = nullptr, GraftHook* hook = nullptr) {
  Outcome r;
  o.page_size = 16;
  auto eng = Engine::Create(model, o);
  if (!eng.ok()) {
    r.error = eng.status().message();
    return r;
  }
  engine::Request req;
  req.prompt = ref.prompt;
  req.max_new_tokens = static_cast<int64_t>(ref.decode_ids.size());
  req.forced_tokens = ref.decode_ids;
  req.all_prompt_logits = true;
  std::vector<float> decode;
  int64_t id0 = -1;
  (*eng)->SetStepCallback([&](const engine::StepEvent& ev) {
    if (ev.request_id != id0) return;
    const auto& l = (*eng)->request(ev.request_id).last_logits;
    decode.insert(decode.end(), l.begin(), l.end());
  });
  if (hook != nullptr) (*eng)->SetTapHook(hook);
  auto id = (*eng)->AddRequest(req);
  if (!id.ok()) {
    r.error = id.status().message();
    return r;
  }
  id0 = *id;
  if (neighbour != nullptr) {
    engine::Request other;
    other.prompt = *neighbour;
    other.max_new_tokens = static_cast<int64_t>(ref.decode_ids.size());
    if (!(*eng)->AddRequest(other).ok()) return r;
  }
  if (Status s = (*eng)->RunToCompletion(); !s.ok()) {
    r.error = s.message();
    return r;
  }
  r.logits = (*eng)->request(id0).prompt_logits;
  r.logits.insert(r.logits.end(), decode.begin(), decode.end());
  if (hook != nullptr) r.rows = std::move(hook->rows);
  r.ok = true;
  return r;
}

// max|a − b| / max|b| of two rows.
double RelMax(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return a.size() != b.size() ? INFINITY : den > 0 ? num / den : (num > 0 ? INFINITY : 0);
}

// Each layer's own error in a grafted run `g` against the reference rows `ref`: per layer and
// row, what the layer adds (resid_out − its input) compared with the reference's addition; and
// the logits (computed from the reference's last hidden state). The worst, and where.
struct LocalError {
  double worst = 0;
  std::string where;
  double p90 = 0;  // the 90th percentile over every (layer, row)
};
LocalError Local(const Rows& g, const Rows& ref, int64_t layers) {
  LocalError out;
  std::vector<double> all;
  auto consider = [&](double e, const std::string& what, int64_t pos) {
    all.push_back(e);
    if (!(e <= out.worst)) out.worst = e, out.where = what + " @" + std::to_string(pos);
  };
  for (int64_t l = 0; l < layers; ++l) {
    const std::string in = l == 0 ? "embed" : "layers." + std::to_string(l - 1) + ".resid_out";
    const std::string name = "layers." + std::to_string(l) + ".resid_out";
    auto x = ref.find(in), y = ref.find(name), z = g.find(name);
    if (x == ref.end() || y == ref.end() || z == g.end() || z->second.size() != y->second.size()) {
      consider(INFINITY, name + " missing", -1);
      continue;
    }
    for (const auto& [pos, want] : y->second) {
      auto got = z->second.find(pos);
      auto input = x->second.find(pos);
      if (got == z->second.end() || input == x->second.end()) {
        consider(INFINITY, name + " missing", pos);
        continue;
      }
      std::vector<float> dw(want.size()), dg(want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        dw[i] = want[i] - input->second[i];
        dg[i] = got->second[i] - input->second[i];
      }
      consider(RelMax(dg, dw), name, pos);
    }
  }
  if (!all.empty()) {
    const size_t k = all.size() * 9 / 10;
    std::nth_element(all.begin(), all.begin() + k, all.end());
    out.p90 = all[k];
  }
  return out;
}

double WorstVsReference(const Outcome& r, const testing::Reference& ref, int64_t V) {
  std::vector<float> want = ref.prefill;
  want.insert(want.end(), ref.decode.begin(), ref.decode.end());
  if (r.logits.size() != want.size()) return INFINITY;
  double worst = 0;
  for (size_t p = 0; p * V < want.size(); ++p) {
    worst = std::max(worst, testing::RelMaxErr(&r.logits[p * V], &want[p * V], V));
  }
  return worst;
}

bool SameBits(const Outcome& a, const Outcome& b) {
  return a.ok && b.ok && a.logits.size() == b.logits.size() &&
         std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * 4) == 0;
}

// A second prompt of the fixture's vocabulary, for the batch-invariance check.
std::vector<int32_t> Neighbour(const testing::Reference& ref) {
  std::vector<int32_t> p(ref.prompt.rbegin(), ref.prompt.rend());
  p.resize(p.size() / 2 + 5);
  return p;
}

struct Fixture {
  std::string name;
  std::shared_ptr<Model> model;
  testing::Reference ref;
  Outcome baseline;    // every op at its default, fp32 cache
  Rows reference_rows; // its rows at the points that feed each layer (and the logits)
  Outcome baseline_fp8;  // the same with the FP8 cache: the reference of kv_quant's variants
  Rows reference_rows_fp8;
};

// The cache format a variant's op needs to run: kv_quant writes only the FP8 cache.
engine::KvFormat CacheFor(const KernelVariant& v) {
  return v.op == "kv_quant" ? engine::KvFormat::kFp8E4m3 : engine::KvFormat::kFp32;
}

const std::vector<Fixture>& Fixtures() {
  static const std::vector<Fixture> all = [] {
    std::vector<Fixture> v;
    for (const auto& name : testing::ModelFixtures()) {
      const auto dir = testing::FixtureDir() / "models" / name;
      auto m = Model::Load(dir);
      if (!m.ok()) continue;
      Fixture f{name, *m, testing::LoadReference(dir), {}, {}, {}, {}};
      GraftHook keep(nullptr);
      f.baseline = RunOne(f.model, f.ref, EngineOptions{}, nullptr, &keep);
      f.reference_rows = std::move(f.baseline.rows);
      EngineOptions fp8;
      fp8.kv_format = engine::KvFormat::kFp8E4m3;
      GraftHook keep8(nullptr);
      f.baseline_fp8 = RunOne(f.model, f.ref, fp8, nullptr, &keep8);
      f.reference_rows_fp8 = std::move(f.baseline_fp8.rows);
      v.push_back(std::move(f));
    }
    return v;
  }();
  return all;
}

// The all-reduce has nothing to sum at TP 1, and at TP 2 every order gives the same bits
// (a + b = b + a): its CPU variants run (and are judged against the default) at emulated TP 4
// where the model splits so, else 2.
int64_t TpFor(const KernelVariant& v, const std::string& backend, const engine::ModelConfig& c) {
  if (v.op != "allreduce" || backend != "cpu") return 1;
  return engine::CheckTensorParallel(c, 4).ok() ? 4 : 2;
}

EngineOptions With(const KernelVariant& v, const std::string& backend, int64_t tp = 1) {
  EngineOptions o;
  o.backend = backend;
  o.kv_format = CacheFor(v);
  o.emulate_tp = tp;
  if (v.fault) {
    o.fault = v.name;
  } else {
    o.kernels = {{v.op, v.name}};
  }
  return o;
}

// Every op at a CUDA variant that has the CPU's bits and exists on the CPU (its default when
// that one does), `v` for its own op.
kernels::KernelChoice BitsConfig(const KernelVariant& v) {
  kernels::KernelChoice c;
  const Registry& r = Registry::Get();
  for (const auto& x : r.variants()) {
    if (x.backend != "cuda" || x.fault || !x.cpu_bits || r.Find(x.op, x.name, "cpu") == nullptr) continue;
    auto it = c.find(x.op);
    if (it == c.end() || x.is_default) c[x.op] = x.name;
  }
  c[v.op] = v.name;
  return c;
}

std::string Label(const KernelVariant& v) { return v.backend + ":" + v.op + "=" + v.name; }

class VariantTwin : public ::testing::TestWithParam<const KernelVariant*> {};

TEST_P(VariantTwin, KeepsWhatItDeclares) {
  const KernelVariant& v = *GetParam();
  ASSERT_FALSE(Fixtures().empty()) << "no model fixtures";
  bool changed_somewhere = false, ran = false;
  std::string refused;
  double worst_all = 0;
  for (const Fixture& f : Fixtures()) {
    ASSERT_TRUE(f.baseline.ok) << f.name << ": the default configuration failed: " << f.baseline.error;
    const int64_t V = f.model->config().vocab_size;
    const bool fp8 = CacheFor(v) == engine::KvFormat::kFp8E4m3;
    Outcome baseline_tp;
    Rows reference_rows_tp;
    const int64_t tpn = TpFor(v, v.backend, f.model->config());
    const bool tp = tpn > 1;
    if (tp) {
      EngineOptions o;
      o.emulate_tp = tpn;
      GraftHook keep(nullptr);
      baseline_tp = RunOne(f.model, f.ref, o, nullptr, &keep);
      reference_rows_tp = std::move(baseline_tp.rows);
    }
    const Outcome& baseline = tp ? baseline_tp : fp8 ? f.baseline_fp8 : f.baseline;
    const Rows& reference_rows = tp ? reference_rows_tp : fp8 ? f.reference_rows_fp8 : f.reference_rows;
    const Outcome a = RunOne(f.model, f.ref, With(v, v.backend, tpn));
    if (!a.ok && v.backend == "cuda") GTEST_SKIP() << "no CUDA device: " << a.error;
    if (!v.RunsOn(f.model->config().model_type)) {
      // A variant for another family's weights: refused in one line, not run.
      EXPECT_FALSE(a.ok) << Label(v) << " ran on " << f.name << " although it declares other model types";
      EXPECT_NE(a.error.find("runs on model_type"), std::string::npos) << a.error;
      refused = a.error;
      continue;
    }
    ran = true;
    ASSERT_TRUE(a.ok) << Label(v) << " on " << f.name << ": " << a.error;
    const bool differs = !SameBits(a, baseline);
    changed_somewhere |= differs;
    if (v.fault) continue;
    // Each layer's own error, every layer starting from the reference's input.
    GraftHook grafted(&reference_rows);
    const Outcome g = RunOne(f.model, f.ref, With(v, v.backend, tpn), nullptr, &grafted);
    ASSERT_TRUE(g.ok) << Label(v) << " on " << f.name << " (grafted): " << g.error;
    const LocalError local = Local(g.rows, reference_rows, f.model->config().num_hidden_layers);
    double logits_err = 0;
    {
      for (size_t p = 0; p * V < g.logits.size(); ++p) {
        std::vector<float> x(g.logits.begin() + p * V, g.logits.begin() + (p + 1) * V);
        std::vector<float> y(baseline.logits.begin() + p * V, baseline.logits.begin() + (p + 1) * V);
        logits_err = std::max(logits_err, RelMax(x, y));
      }
    }
    if (!differs) {
      EXPECT_EQ(local.worst, 0.0) << Label(v) << " on " << f.name << ": the default's bits, yet grafting moved "
                                  << local.where << " (the graft itself is wrong)";
    }
    // The bound holds for the 90th percentile of the layers' rows and for every logits row.
    const double worst = std::max(local.p90, logits_err);
    worst_all = std::max(worst_all, worst);
    std::printf("[ %-32s %-22s ] layer-local p90 %.3g max %.3g (%s), logits %.3g; end to end vs transformers %.3g%s\n",
                Label(v).c_str(), f.name.c_str(), local.p90, local.worst, local.where.c_str(), logits_err,
                WorstVsReference(a, f.ref, V), differs ? "" : " (default's bits)");
    EXPECT_LE(worst, v.bound) << Label(v) << " on " << f.name << ": its own error (p90 " << local.p90
                              << ", logits " << logits_err << "; worst row " << local.where
                              << ") is beyond its declared bound";
    if (!v.same_bits_as.empty()) {
      kernels::KernelVariant alias = v;
      alias.name = v.same_bits_as;
      EXPECT_TRUE(SameBits(a, RunOne(f.model, f.ref, With(alias, v.backend, tpn))))
          << Label(v) << " on " << f.name << " declares the bits of " << v.same_bits_as;
    }
    if (v.deterministic) {
      EXPECT_TRUE(SameBits(a, RunOne(f.model, f.ref, With(v, v.backend, tpn)))) << Label(v) << " on " << f.name
                                                                          << ": two runs differ";
    }
    if (v.batch_invariant) {
      const std::vector<int32_t> other = Neighbour(f.ref);
      EXPECT_TRUE(SameBits(a, RunOne(f.model, f.ref, With(v, v.backend, tpn), &other)))
          << Label(v) << " on " << f.name << ": the logits change with a neighbour in the batch";
    }
    if (v.backend == "cuda" && v.cpu_bits && Registry::Get().Find(v.op, v.name, "cpu") != nullptr) {
      // The CPU's bits hold when every op runs a variant with them: this one, and for every
      // other op its CPU-bitwise variant (gemm=fp32_dot for cuBLAS's fp32), on both backends.
      EngineOptions on_gpu = With(v, "cuda"), on_cpu = With(v, "cpu");
      on_gpu.kernels = on_cpu.kernels = BitsConfig(v);
      EXPECT_TRUE(SameBits(RunOne(f.model, f.ref, on_gpu), RunOne(f.model, f.ref, on_cpu)))
          << Label(v) << " on " << f.name << " declares the CPU's bits (with every other op CPU-bitwise too)";
    }
  }
  if (!ran) GTEST_SKIP() << Label(v) << " runs on no fixture model yet: " << refused;
  if (v.fault) {
    EXPECT_TRUE(changed_somewhere) << Label(v) << ": a fault that changes no fixture's bits tests nothing";
  }
  RecordProperty("worst_rel_err", std::to_string(worst_all));
}

std::vector<const KernelVariant*> Variants() {
  std::vector<const KernelVariant*> out;
  for (const auto& v : Registry::Get().variants()) {
    if (v.backend == LOCKSTEP_TWIN_BACKEND) out.push_back(&v);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Registry, VariantTwin, ::testing::ValuesIn(Variants()), [](const auto& info) {
  std::string s = info.param->backend + "_" + info.param->op + "_" + info.param->name;
  for (char& c : s) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return s;
});

#if !defined(LOCKSTEP_TWIN_GPU)
TEST(VariantTwinOps, EveryVariantDeclaresABound) {
  for (const auto& v : Registry::Get().variants()) {
    if (v.fault) continue;
    EXPECT_TRUE(std::isfinite(v.bound) && v.bound >= 0) << Label(v) << " declares no bound (kernels/registry.cc)";
    if (!v.same_bits_as.empty()) {
      EXPECT_NE(Registry::Get().Find(v.op, v.same_bits_as, v.backend), nullptr) << Label(v) << ": same_bits_as names no variant";
    }
  }
}

// Ops a model does not run: another variant of one leaves every bit as it was.
TEST(VariantTwinOps, AVariantOfAnOpTheModelLacksChangesNothing) {
  for (const Fixture& f : Fixtures()) {
    if (f.model->config().index_topk > 0) continue;  // V3.2: the indexer runs
    for (const auto& v : Registry::Get().variants()) {
      if (v.backend != "cpu" || v.fault || v.op != "indexer" || v.is_default) continue;
      if (!v.RunsOn(f.model->config().model_type)) continue;  // refused in one line (KeepsWhatItDeclares)
      EXPECT_TRUE(SameBits(f.baseline, RunOne(f.model, f.ref, With(v, "cpu"))))
          << f.name << " has no indexer, yet indexer=" << v.name << " changed its logits";
    }
  }
}
#endif

}  // namespace
}  // namespace lockstep
