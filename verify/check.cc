// verify/check.cc — see check.h. The twin table (kOps) and, per op, the code that feeds its
// golden twin from the trace's own rows.
#include "verify/check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "engine/model.h"
#include "engine/tensor_parallel.h"
#include "verify/check_internal.h"
#include "verify/golden.h"

namespace lockstep::verify {
namespace g = golden;
using engine::Matrix;
using namespace internal;

bool CheckReport::clean() const {
  for (const auto& o : ops) {
    if (o.failed || o.bias_failed) return false;
  }
  return true;
}

bool internal::StoredIndexKey(Ctx& cx, const std::string& base, int32_t req, int64_t pos, int64_t di,
                              std::vector<double>* key, std::vector<double>* half_step) {
  const Tensor* t = cx.T(base);
  const int64_t r = t ? t->Row(req, pos) : -1;
  if (r < 0) return false;
  key->assign(di, 0);
  half_step->assign(di, 0);
  if (t->info->dtype == traces::DType::kF32) {
    if (t->info->cols < di) return false;
    for (int64_t i = 0; i < di; ++i) (*key)[i] = t->F(r)[i];
    return true;
  }
  const Tensor* ts = cx.T(base + ".scales");
  const int64_t rs = ts ? ts->Row(req, pos) : -1;
  // Shapes as this encoding has them (a damaged trace's tensor of other widths is not read).
  if (rs < 0 || t->info->dtype != traces::DType::kFp8E4m3 || t->info->cols < di ||
      ts->info->dtype != traces::DType::kF32 || ts->info->cols < (di + 127) / 128) {
    return false;
  }
  for (int64_t i = 0; i < di; ++i) {
    const double sc = ts->F(rs)[i / 128];
    (*key)[i] = g::E4m3Value(t->B(r)[i]) * sc;
    (*half_step)[i] = std::max(0x1p-4 * std::fabs((*key)[i]), 0x1p-10 * sc);
  }
  return true;
}

// The LM head's twin on one row: lm_head(final_norm) against the stored logits (full rows, or
// the stored top-k and that they are the top-k). Every family's last op.
void internal::CheckLmHead(Ctx& cx, int32_t req, int64_t pos, int64_t plen, const Tensor* t_fin, int64_t rfin) {
  const engine::ModelConfig& c = *cx.c;
  const int64_t H = c.hidden_size;
  const Tensor* t_lg = cx.T("logits");
  const int64_t rlg = t_lg ? t_lg->Row(req, pos) : -1;
  const Tensor* t_ti = t_lg ? nullptr : cx.T("logits.topk_ids");
  const Tensor* t_tv = t_lg ? nullptr : cx.T("logits.topk_values");
  const int64_t rti = t_ti ? t_ti->Row(req, pos) : -1, rtv = t_tv ? t_tv->Row(req, pos) : -1;
  if (rlg >= 0 || (rti >= 0 && rtv >= 0)) {
    const g::Vec lg = g::Linear(cx.Wt(cx.W->lm_head), Row(t_fin->F(rfin), H), cx.gemm);
    Location w{req, -1, pos, t_fin->rows[rfin].step, "logits"};
    w.prefill = pos < plen - 1;
    if (rlg >= 0) {
      Compare(cx, OpIndex("lm_head"), w, t_lg->F(rlg), lg);
    } else {
      const int64_t k = t_ti->info->cols;
      const int32_t* ids = t_ti->I(rti);
      const float* vals = t_tv->F(rtv);
      g::Vec sub;
      double ratio = 0, meas = 0, bud = 0;
      std::string detail;
      std::vector<bool> in(c.vocab_size, false);
      double lo = INFINITY, lo_e = 0;
      for (int64_t j = 0; j < k; ++j) {
        if (ids[j] < 0 || ids[j] >= c.vocab_size) {
          ratio = INFINITY;
          detail = "top-k id out of range";
          break;
        }
        in[ids[j]] = true;
        const double err = std::fabs(vals[j] - lg.v[ids[j]]), b = lg.e[ids[j]] + 1e-30;
        if (err / b > ratio) ratio = err / b, meas = err, bud = b, detail = "logit of token " + std::to_string(ids[j]);
        if (lg.v[ids[j]] < lo) lo = lg.v[ids[j]], lo_e = lg.e[ids[j]];
      }
      for (int64_t v = 0; v < c.vocab_size && std::isfinite(ratio); ++v) {
        if (in[v] || lg.v[v] <= lo) continue;
        const double r = (lg.v[v] - lo) / (lg.e[v] + lo_e + 1e-30);
        if (r > ratio) ratio = r, meas = lg.v[v] - lo, bud = lg.e[v] + lo_e, detail = "token " + std::to_string(v) + " belongs in the stored top-k";
      }
      CompareSet(cx, OpIndex("lm_head"), w, ratio, meas, bud, ratio > 1 ? detail : "");
    }
  }
}

namespace {

// The index key of one position from its attn_norm row (V3.2): RoPE(LayerNorm(wk·h)), Hadamard
// when the variant rotates.
g::Vec IndexKey(Ctx& cx, const engine::LayerWeights& L, const float* h, int64_t pos, bool hadamard) {
  const auto& c = *cx.c;
  g::Vec k = g::Linear(cx.Wt(L.indexer.wk), Row(h, c.hidden_size), cx.linear);
  k = g::LayerNorm(k, L.indexer.k_norm_w.ptr(), L.indexer.k_norm_b.ptr(), 1e-6);
  g::Rope(&k, 0, c.qk_rope_head_dim, pos, cx.inv_freq, cx.af, g::RopeLayout::kHalves);
  if (hadamard) {
    // Sylvester Hadamard / √n: orthogonal, |err| grows by ≤ log2(n) roundings.
    const int64_t n = k.size();
    int steps = 0;
    for (int64_t hh = 1; hh < n; hh *= 2, ++steps) {
      for (int64_t i = 0; i < n; i += 2 * hh) {
        for (int64_t j = i; j < i + hh; ++j) {
          const double a = k.v[j], b = k.v[j + hh], ea = k.e[j], eb = k.e[j + hh];
          k.v[j] = a + b;
          k.v[j + hh] = a - b;
          k.e[j] = k.e[j + hh] = ea + eb;
        }
      }
    }
    double mag = 0;
    for (double v : k.v) mag = std::max(mag, std::fabs(v));
    const double s = 1 / std::sqrt(static_cast<double>(n));
    for (int64_t i = 0; i < n; ++i) {
      k.v[i] *= s;
      k.e[i] = k.e[i] * s + (steps + 2) * g::kFp32U * mag;
    }
  }
  return k;
}

// DeepSeek V2 / V3 / V3.2's rows: every op of every layer of every (request, position) embed
// holds, then the final norm and the LM head.
void CheckMlaRows(Ctx& cx, const CheckOptions& opt) {
  const traces::TraceReader& trace = *cx.trace;
  const engine::ModelConfig& c = *cx.c;
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, C = c.kv_lora_rank, dqk = dn + dr, NL = c.num_hidden_layers;
  const Tensor* embed = cx.T("embed");
  // Rows: every (request, position) embed holds, in step order.
  std::vector<int64_t> order(embed->rows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  const int64_t total = static_cast<int64_t>(order.size());
  const int op_embed = OpIndex("embed");
  const std::string kvf = cx.kv_format;
  int64_t done = 0;
  for (int64_t ri : order) {
    const traces::SummaryRow& sr = embed->rows[ri];
    const int32_t req = sr.request;
    const int64_t pos = sr.position;
    const int64_t plen = cx.prompt_len.count(req) ? cx.prompt_len[req] : 0;
    Location base{req, -1, pos, sr.step, "embed"};
    base.prefill = pos < plen;
    // The token this row embeds: prompt or generated.
    int32_t token = -1;
    for (const auto& q : trace.requests()) {
      if (q.id != req) continue;
      if (pos < plen) token = q.prompt[pos];
      else if (pos - plen < static_cast<int64_t>(q.generated.size())) token = q.generated[pos - plen];
    }
    if (token >= 0 && token < c.vocab_size) {
      std::vector<float> e(H);
      cx.W->embed.data.DecodeRows(token, 1, e.data());
      g::Vec tw = Row(e.data(), H);
      for (int64_t i = 0; i < H; ++i) tw.e[i] = 0;
      Compare(cx, op_embed, base, embed->F(ri), tw, 0, -1, false);
    } else {
      ++cx.stats[op_embed].rep.not_checked;
      cx.stats[op_embed].rep.not_checked_why = "the row's token is not in the trace";
    }
    const float* x_in = embed->F(ri);
    for (int64_t l = 0; l < NL; ++l) {
      const engine::LayerWeights& L = cx.W->layers[l];
      auto tap = [&](const char* n) { return cx.T(LayerTap(l, n)); };
      auto loc = [&](const char* n, const Tensor* t, int64_t row) {
        Location w{req, l, pos, t ? t->rows[row].step : sr.step, LayerTap(l, n)};
        w.prefill = pos < plen;
        return w;
      };
      const Tensor* t_norm = tap("attn_norm");
      const int64_t rn = t_norm ? t_norm->Row(req, pos) : -1;
      if (rn < 0) {
        x_in = nullptr;
        continue;
      }
      const float* h = t_norm->F(rn);
      if (x_in != nullptr) {
        Compare(cx, OpIndex("attn_norm"), loc("attn_norm", t_norm, rn), h, g::RmsNorm(Row(x_in, H), L.input_norm.ptr(), cx.file.rms_norm_eps.value_or(c.rms_norm_eps)));
      }
      const g::Vec hv = Row(h, H);
      // q path.
      const Tensor* t_q = tap("attn.q");
      const int64_t rq = t_q ? t_q->Row(req, pos) : -1;
      g::Vec q_resid;
      if (c.q_lora_rank > 0) {
        q_resid = g::RmsNorm(g::Linear(cx.Wt(L.q_a_proj), hv, cx.linear), L.q_a_norm.ptr(), 1e-6);
      }
      if (rq >= 0) {
        g::Vec q = c.q_lora_rank > 0 ? g::Linear(cx.Wt(L.q_b_proj), q_resid, cx.linear) : g::Linear(cx.Wt(L.q_proj), hv, cx.linear);
        for (int64_t hd = 0; hd < nh; ++hd) g::Rope(&q, hd * dqk + dn, dr, pos, cx.inv_freq, cx.af, cx.layout);
        for (int64_t hd = 0; hd < nh; ++hd) {
          Compare(cx, OpIndex("q_proj"), loc("attn.q", t_q, rq), t_q->F(rq) + hd * dqk, q, hd * dqk, dn);
        }
        for (int64_t hd = 0; hd < nh; ++hd) {
          Compare(cx, OpIndex("rope_q"), loc("attn.q", t_q, rq), t_q->F(rq) + hd * dqk + dn, q, hd * dqk + dn, dr);
        }
      }
      // latent and k_rope.
      const Tensor* t_lat = tap("attn.latent");
      const Tensor* t_kr = tap("attn.k_rope");
      const int64_t rl = t_lat ? t_lat->Row(req, pos) : -1, rk = t_kr ? t_kr->Row(req, pos) : -1;
      if (rl >= 0 || rk >= 0) {
        const g::Vec kv = g::Linear(cx.Wt(L.kv_a_proj), hv, cx.linear);
        if (rl >= 0) {
          g::Vec lat;
          lat.v.assign(kv.v.begin(), kv.v.begin() + C);
          lat.e.assign(kv.e.begin(), kv.e.begin() + C);
          Compare(cx, OpIndex("kv_a"), loc("attn.latent", t_lat, rl), t_lat->F(rl), g::RmsNorm(lat, L.kv_a_norm.ptr(), 1e-6));
        }
        if (rk >= 0) {
          g::Vec kr;
          kr.v.assign(kv.v.begin() + C, kv.v.end());
          kr.e.assign(kv.e.begin() + C, kv.e.end());
          g::Rope(&kr, 0, dr, pos, cx.inv_freq, cx.af, cx.layout);
          Compare(cx, OpIndex("rope_k"), loc("attn.k_rope", t_kr, rk), t_kr->F(rk), kr);
        }
      }
      // The cache as stored: the format's encoding of the recorded latent and k_rope.
      const Tensor* t_kv = cx.T("kv/" + LayerTap(l, "latent"));
      const int64_t rkv = t_kv ? t_kv->Row(req, pos) : -1;
      if (rkv >= 0 && rl >= 0 && rk >= 0) {
        const float* lt = t_lat->F(rl);
        const float* kt = t_kr->F(rk);
        int64_t bad = 0, first_bad = -1;
        double worst = 0;
        if (kvf == "fp32") {
          const float* s = t_kv->F(rkv);
          for (int64_t i = 0; i < C + dr; ++i) {
            const float want = i < C ? lt[i] : kt[i - C];
            if (std::memcmp(&s[i], &want, 4) != 0) {
              ++bad;
              if (first_bad < 0) first_bad = i;
              worst = std::max(worst, std::fabs(static_cast<double>(s[i]) - want));
            }
          }
        } else if (kvf == "bf16") {
          const uint16_t* s = reinterpret_cast<const uint16_t*>(t_kv->B(rkv));
          for (int64_t i = 0; i < C + dr; ++i) {
            const float want = i < C ? lt[i] : kt[i - C];
            const uint16_t b = g::Bf16Bits(want);
            if (s[i] != b) {
              ++bad;
              if (first_bad < 0) first_bad = i;
              worst = std::max(worst, std::fabs(static_cast<double>(g::Bf16Value(s[i])) - g::Bf16Value(b)));
            }
          }
        } else if (kvf == "fp8_e4m3") {
          const Tensor* t_sc = cx.T("kv/" + LayerTap(l, "latent.scales"));
          const Tensor* t_ro = cx.T("kv/" + LayerTap(l, "latent.rope"));
          const int64_t rs2 = t_sc ? t_sc->Row(req, pos) : -1, rr = t_ro ? t_ro->Row(req, pos) : -1;
          if (rs2 >= 0 && rr >= 0) {
            const uint8_t* q8 = t_kv->B(rkv);
            const float* sc = t_sc->F(rs2);
            const uint16_t* ro = reinterpret_cast<const uint16_t*>(t_ro->B(rr));
            for (int64_t t0 = 0; t0 < C; t0 += 128) {
              const int64_t n = std::min<int64_t>(128, C - t0);
              const float s = g::Fp8Scale(lt + t0, n);
              if (std::memcmp(&sc[t0 / 128], &s, 4) != 0) {
                ++bad;
                if (first_bad < 0) first_bad = t0;
                worst = std::max(worst, std::fabs(static_cast<double>(sc[t0 / 128]) - s));
              }
              for (int64_t i = t0; i < t0 + n; ++i) {
                const uint8_t b = g::E4m3Bits(static_cast<double>(lt[i]) / s);
                if (q8[i] != b) {
                  ++bad;
                  if (first_bad < 0) first_bad = i;
                  const double got = g::E4m3Value(q8[i]) * sc[t0 / 128];
                  worst = std::max(worst, std::isnan(got) ? INFINITY : std::fabs(got - g::E4m3Value(b) * s));
                }
              }
            }
            for (int64_t i = 0; i < dr; ++i) {
              if (ro[i] != g::Bf16Bits(kt[i])) {
                ++bad;
                if (first_bad < 0) first_bad = C + i;
                worst = std::max(worst, std::fabs(static_cast<double>(g::Bf16Value(ro[i])) - g::Bf16Value(g::Bf16Bits(kt[i]))));
              }
            }
          }
        }
        Location w = loc("latent", t_kv, rkv);
        w.tensor = "kv/" + LayerTap(l, "latent");
        w.column = first_bad;
        CompareSet(cx, OpIndex("kv_cache"), w, bad > 0 ? INFINITY : 0, worst, 0,
                   bad > 0 ? std::to_string(bad) + " stored value(s) differ from the " + kvf + " encoding of the recorded latent/k_rope"
                           : "");
      }
      // V3.2 indexer: its stored key, and its top-k over the request's own attn_norm rows.
      const bool sparse = c.layers[l].attention == engine::AttentionKind::kMlaSparse;
      const Tensor* t_top = sparse ? tap("indexer.topk") : nullptr;
      const int64_t rtop = t_top ? t_top->Row(req, pos) : -1;
      const std::string iv = cx.Variant("indexer");
      const bool hadamard = iv == "hadamard" || iv == "fp8_paged";
      const bool ifp8 = iv == "fp8_paged";
      if (sparse) {
        const Tensor* t_ik = cx.T("kv/" + LayerTap(l, "indexer_k"));
        const int64_t rik = t_ik ? t_ik->Row(req, pos) : -1;
        if (rik >= 0 && !ifp8) {
          Compare(cx, OpIndex("indexer_key"), loc("indexer_k", t_ik, rik), t_ik->F(rik), IndexKey(cx, L, h, pos, hadamard));
        } else if (rik >= 0) {
          // FP8 keys (vLLM's paged layout): the stored e4m3 × its tile's scale against the twin,
          // within the twin's budget plus E4M3's half step.
          std::vector<double> sk, step;
          if (StoredIndexKey(cx, "kv/" + LayerTap(l, "indexer_k"), req, pos, c.index_head_dim, &sk, &step)) {
            g::Vec kr = IndexKey(cx, L, h, pos, hadamard);
            for (int64_t i = 0; i < c.index_head_dim; ++i) kr.e[i] += step[i];
            const std::vector<float> skf(sk.begin(), sk.end());
            Compare(cx, OpIndex("indexer_key"), loc("indexer_k", t_ik, rik), skf.data(), kr, 0, -1, false);
          } else {
            ++cx.stats[OpIndex("indexer_key")].rep.not_checked;
            cx.stats[OpIndex("indexer_key")].rep.not_checked_why = "an FP8 key row without its .scales row (or of other widths)";
          }
        }
      }
      if (rtop >= 0 && c.q_lora_rank > 0) {
        const int64_t nhi = c.index_n_heads, di = c.index_head_dim, K = c.index_topk, T = pos + 1;
        const g::Vec iq = g::Linear(cx.Wt(L.indexer.wq_b), q_resid, cx.linear);
        g::Vec iw = g::Linear(cx.Wt(L.indexer.weights_proj), hv, cx.gemm);
        std::vector<g::Vec> qh(nhi);
        for (int64_t hd = 0; hd < nhi; ++hd) {
          qh[hd].v.assign(iq.v.begin() + hd * di, iq.v.begin() + (hd + 1) * di);
          qh[hd].e.assign(iq.e.begin() + hd * di, iq.e.begin() + (hd + 1) * di);
          g::Rope(&qh[hd], 0, dr, pos, cx.inv_freq, cx.af, g::RopeLayout::kHalves);
        }
        const double ws = 1 / std::sqrt(static_cast<double>(nhi)), ks = 1 / std::sqrt(static_cast<double>(di));
        std::vector<double> s(T), es(T);
        bool have_all = true;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t rt = t_norm->Row(req, t);
          if (rt < 0) {
            have_all = false;
            break;
          }
          const g::Vec k = IndexKey(cx, L, t_norm->F(rt), t, false);
          double st = 0, et = 0;
          for (int64_t hd = 0; hd < nhi; ++hd) {
            double d = 0, m = 0, ed = 0;
            for (int64_t i = 0; i < di; ++i) {
              d += qh[hd].v[i] * k.v[i];
              m += std::fabs(qh[hd].v[i] * k.v[i]);
              ed += std::fabs(qh[hd].v[i]) * k.e[i] + std::fabs(k.v[i]) * qh[hd].e[i];
            }
            // fp32 dot (γ_di), the Hadamard's roundings, FP8 rows for fp8_paged (both sides).
            ed += (g::Gamma(di + 2) + (hadamard ? 2 * std::log2(static_cast<double>(di)) * g::kFp32U : 0) +
                   (ifp8 ? 2.2 * g::kFp8U : 0)) * m;
            d *= ks;
            ed *= ks;
            const double w = iw.v[hd] * ws, ew = iw.e[hd] * ws + g::kFp32U * std::fabs(w);
            st += w * std::max(d, 0.0);
            et += std::fabs(w) * (d > -ed ? ed : 0) + ew * std::max(d + ed, 0.0) + 2 * g::kFp32U * std::fabs(w * std::max(d, 0.0));
          }
          s[t] = st;
          es[t] = et + g::Gamma(nhi + 1) * std::fabs(st);
        }
        if (have_all) {
          const int32_t* sel = t_top->I(rtop);
          std::vector<bool> in(T, false);
          int64_t count = 0;
          std::string bad;
          for (int64_t i = 0; i < K; ++i) {
            if (sel[i] < 0) continue;
            if (sel[i] >= T) {
              bad = "selects position " + std::to_string(sel[i]) + ", after the query";
            } else if (in[sel[i]]) {
              bad = "selects position " + std::to_string(sel[i]) + " twice";
            } else {
              in[sel[i]] = true;
            }
            ++count;
          }
          const int64_t want = std::min(K, T);
          if (bad.empty() && count != want) {
            bad = "selects " + std::to_string(count) + " keys; the top-" + std::to_string(K) + " of " + std::to_string(T) +
                  " causal keys has " + std::to_string(want);
          }
          double ratio = 0, meas = 0, bud = 0;
          if (bad.empty()) {
            // The weakest selected key against the strongest left out.
            int64_t lo = -1, hi = -1;
            for (int64_t t = 0; t < T; ++t) {
              if (in[t] && (lo < 0 || s[t] < s[lo])) lo = t;
              if (!in[t] && (hi < 0 || s[t] > s[hi])) hi = t;
            }
            if (lo >= 0 && hi >= 0 && s[hi] > s[lo]) {
              meas = s[hi] - s[lo];
              bud = es[hi] + es[lo] + 1e-30;
              ratio = meas / bud;
              if (ratio > 1) {
                bad = "left out position " + std::to_string(hi) + " (score " + std::to_string(s[hi]) + ") but kept " +
                      std::to_string(lo) + " (score " + std::to_string(s[lo]) + ")";
              }
            }
          } else {
            ratio = INFINITY;
          }
          CompareSet(cx, OpIndex("indexer"), loc("indexer.topk", t_top, rtop), ratio, meas, bud, bad);
        } else {
          ++cx.stats[OpIndex("indexer")].rep.not_checked;
          cx.stats[OpIndex("indexer")].rep.not_checked_why = "earlier positions' attn_norm rows are not in the trace";
        }
      }
      // Attention over the request's own recorded keys.
      const Tensor* t_heads = tap("attn.heads");
      const int64_t rh = t_heads ? t_heads->Row(req, pos) : -1;
      if (rh >= 0 && rq >= 0 && t_lat && t_kr) {
        std::vector<int64_t> keys;
        if (sparse) {
          if (rtop >= 0) {
            for (int64_t i = 0; i < c.index_topk; ++i) {
              const int32_t t = t_top->I(rtop)[i];
              if (t >= 0 && t <= pos) keys.push_back(t);
            }
          }
        } else {
          for (int64_t t = 0; t <= pos; ++t) keys.push_back(t);
        }
        // Each key's latent and rope as the KV format stores them.
        const int64_t K = static_cast<int64_t>(keys.size());
        std::vector<double> lat(K * C), kr(K * dr);
        bool ok = K > 0 && (!sparse || rtop >= 0);
        for (int64_t j = 0; j < K && ok; ++j) {
          const int64_t a = t_lat->Row(req, keys[j]), b = t_kr->Row(req, keys[j]);
          if (a < 0 || b < 0) {
            ok = false;
            break;
          }
          const float* lt = t_lat->F(a);
          const float* kt = t_kr->F(b);
          if (kvf == "bf16") {
            for (int64_t i = 0; i < C; ++i) lat[j * C + i] = g::Bf16Value(g::Bf16Bits(lt[i]));
            for (int64_t i = 0; i < dr; ++i) kr[j * dr + i] = g::Bf16Value(g::Bf16Bits(kt[i]));
          } else if (kvf == "fp8_e4m3") {
            for (int64_t t0 = 0; t0 < C; t0 += 128) {
              const int64_t n = std::min<int64_t>(128, C - t0);
              const double s = g::Fp8Scale(lt + t0, n);
              for (int64_t i = t0; i < t0 + n; ++i) lat[j * C + i] = g::E4m3Value(g::E4m3Bits(lt[i] / s)) * s;
            }
            for (int64_t i = 0; i < dr; ++i) kr[j * dr + i] = g::Bf16Value(g::Bf16Bits(kt[i]));
          } else {
            for (int64_t i = 0; i < C; ++i) lat[j * C + i] = lt[i];
            for (int64_t i = 0; i < dr; ++i) kr[j * dr + i] = kt[i];
          }
        }
        const bool decode = pos >= plen;
        Stats& sa = cx.stats[OpIndex("attention")];
        if (ok) {
          const g::WeightRef kvb = cx.Wt(L.kv_b_proj);
          const float* qrow = t_q->F(rq);
          const double scale = g::MlaSoftmaxScale(c.qk_nope_head_dim, c.qk_rope_head_dim, c.rope.yarn, c.rope.factor,
                                                  c.rope.mscale_all_dim);
          const double in = cx.gemm.in_x;
          g::Vec out;
          out.v.assign(nh * dv, 0);
          out.e.assign(nh * dv, 0);
          for (int64_t hd = 0; hd < nh; ++hd) {
            const float* wk = kvb.w + hd * (dn + dv) * C;     // W_UK [dn, C]
            const float* wvv = wk + dn * C;                   // W_UV [dv, C]
            // q_lat[c] = Σ_a q_a W_UK[a][c], and its absolute form for the budget.
            std::vector<double> ql(C, 0), qla(C, 0);
            const float* qn = qrow + hd * dqk;
            for (int64_t a = 0; a < dn; ++a) {
              for (int64_t cc = 0; cc < C; ++cc) {
                ql[cc] += static_cast<double>(qn[a]) * wk[a * C + cc];
                qla[cc] += std::fabs(static_cast<double>(qn[a]) * wk[a * C + cc]);
              }
            }
            g::Vec sc;
            sc.v.resize(K);
            sc.e.resize(K);
            for (int64_t j = 0; j < K; ++j) {
              double s = 0, m = 0, sr2 = 0, mr = 0;
              for (int64_t cc = 0; cc < C; ++cc) {
                s += ql[cc] * lat[j * C + cc];
                m += qla[cc] * std::fabs(lat[j * C + cc]);
              }
              for (int64_t i = 0; i < dr; ++i) {
                sr2 += static_cast<double>(qn[dn + i]) * kr[j * dr + i];
                mr += std::fabs(static_cast<double>(qn[dn + i]) * kr[j * dr + i]);
              }
              sc.v[j] = (s + sr2) * scale;
              sc.e[j] = scale * ((g::Gamma(C + dn + 2) + 3 * in) * m + g::Gamma(dr + 2) * mr) + g::kFp32U * std::fabs(sc.v[j]);
            }
            const g::Vec p = g::Softmax(sc);
            // o_i = Σ_j p_j Σ_c W_UV[i][c] lat_jc.
            std::vector<double> ol(C, 0), ole(C, 0), ola(C, 0);
            for (int64_t j = 0; j < K; ++j) {
              for (int64_t cc = 0; cc < C; ++cc) {
                const double lv = lat[j * C + cc];
                ol[cc] += p.v[j] * lv;
                ole[cc] += p.e[j] * std::fabs(lv);
                ola[cc] += p.v[j] * std::fabs(lv);
              }
            }
            const double co = g::Gamma(K + 2) + g::Gamma(C + 2) + 3 * in;
            for (int64_t i = 0; i < dv; ++i) {
              double o = 0, e = 0;
              for (int64_t cc = 0; cc < C; ++cc) {
                const double w = wvv[i * C + cc];
                o += w * ol[cc];
                e += std::fabs(w) * (ole[cc] + co * ola[cc]);
              }
              out.v[hd * dv + i] = o;
              out.e[hd * dv + i] = e + g::kFp32U * std::fabs(o);
            }
          }
          const bool pass = Compare(cx, OpIndex("attention"), loc("attn.heads", t_heads, rh), t_heads->F(rh), out);
          if (!pass && sa.rep.first.request == req && sa.rep.first.position == pos && sa.rep.first.layer == l) {
            sa.rep.kernel_op = sparse ? (decode ? "attn_decode+attn_sparse" : "attn_prefill+attn_sparse")
                                      : (decode ? "attn_decode" : "attn_prefill");
            sa.rep.variant = cx.Variant(decode ? "attn_decode" : "attn_prefill");
            if (sparse) sa.rep.variant += "+" + cx.Variant("attn_sparse");
          }
        } else {
          ++sa.rep.not_checked;
          sa.rep.not_checked_why = "a key's latent/k_rope rows (or the selection) are not in the trace";
        }
      }
      // Emulated TP sums each block's output over the ranks: the twin's budget grows by that
      // sum's own fp32 rounding, tp·u·Σ_r |partial_r| an element (the recorded partials).
      auto widen = [&](const char* parts_name, g::Vec v) {
        const Tensor* t_p = cx.tp > 1 ? tap(parts_name) : nullptr;
        const int64_t rp = t_p ? t_p->Row(req, pos) : -1;
        if (rp < 0) return v;
        for (int64_t i = 0; i < H; ++i) v.e[i] += AllReduceRounding(t_p->F(rp), cx.tp, H, i);
        return v;
      };
      // o_proj and the residual.
      const Tensor* t_o = tap("attn.out");
      const int64_t ro = t_o ? t_o->Row(req, pos) : -1;
      if (ro >= 0 && rh >= 0) {
        Compare(cx, OpIndex("o_proj"), loc("attn.out", t_o, ro), t_o->F(ro),
                widen("attn.partials", g::Linear(cx.Wt(L.o_proj), Row(t_heads->F(rh), nh * dv), cx.linear)));
      }
      // Emulated TP: attn.out and ffn.out are the ranks' partials all-reduced.
      auto allreduce = [&](const char* out_name, const Tensor* t_y, int64_t ry, const char* parts_name) {
        const Tensor* t_p = cx.tp > 1 ? tap(parts_name) : nullptr;
        const int64_t rp = t_p ? t_p->Row(req, pos) : -1;
        if (rp >= 0 && ry >= 0) CheckAllReduce(cx, loc(out_name, t_y, ry), t_y->F(ry), t_p->F(rp), H);
      };
      allreduce("attn.out", t_o, ro, "attn.partials");
      const Tensor* t_mid = tap("resid_mid");
      const int64_t rm = t_mid ? t_mid->Row(req, pos) : -1;
      if (rm >= 0 && ro >= 0 && x_in != nullptr) {
        Compare(cx, OpIndex("resid_mid"), loc("resid_mid", t_mid, rm), t_mid->F(rm), g::Add(Row(x_in, H), Row(t_o->F(ro), H)), 0, -1, false);
      }
      // FFN.
      const Tensor* t_fn = tap("ffn_norm");
      const int64_t rf = t_fn ? t_fn->Row(req, pos) : -1;
      if (rf >= 0 && rm >= 0) {
        Compare(cx, OpIndex("ffn_norm"), loc("ffn_norm", t_fn, rf), t_fn->F(rf), g::RmsNorm(Row(t_mid->F(rm), H), L.post_attn_norm.ptr(), cx.file.rms_norm_eps.value_or(c.rms_norm_eps)));
      }
      const Tensor* t_ffo = tap("ffn.out");
      const int64_t rfo = t_ffo ? t_ffo->Row(req, pos) : -1;
      if (rf >= 0) {
        const g::Vec hf = Row(t_fn->F(rf), H);
        auto mlp = [&](const engine::MlpWeights& m) {
          return g::Linear(cx.Wt(m.down), g::SwiGlu(g::Linear(cx.Wt(m.gate), hf, cx.linear), g::Linear(cx.Wt(m.up), hf, cx.linear)), cx.linear);
        };
        if (c.layers[l].ffn == engine::FfnKind::kDense) {
          if (rfo >= 0) Compare(cx, OpIndex("experts"), loc("ffn.out", t_ffo, rfo), t_ffo->F(rfo), widen("ffn.partials", mlp(cx.W->layers[l].mlp)));
        } else {
          const Tensor* t_ids = tap("ffn.router.topk_ids");
          const Tensor* t_w = tap("ffn.router.topk_weights");
          const int64_t rid = t_ids ? t_ids->Row(req, pos) : -1, rw = t_w ? t_w->Row(req, pos) : -1;
          const int64_t k = c.num_experts_per_tok;
          if (rid >= 0 && rw >= 0) {
            g::RouteSpec sp;
            sp.gate = c.gate == engine::GateKind::kSigmoidNoauxTc       ? g::Gate::kSigmoidNoauxTc
                      : c.gate == engine::GateKind::kSoftmaxGroupLimited ? g::Gate::kSoftmaxGroupLimited
                                                                         : g::Gate::kSoftmaxGreedy;
            sp.experts = c.n_routed_experts;
            sp.top_k = k;
            sp.groups = c.n_group;
            sp.top_groups = c.topk_group;
            // (as config.json states them where it does: file_config.h)
            sp.normalise = cx.file.norm_topk_prob.value_or(c.norm_topk_prob);
            sp.scaling = cx.file.routed_scaling_factor.value_or(c.routed_scaling_factor);
            const g::Vec lg = g::Linear(cx.Wt(L.router), hf, cx.fp32);
            const g::Route rt = g::RouteToken(sp, lg, L.router_bias.empty() ? nullptr : L.router_bias.ptr());
            const int32_t* ids = t_ids->I(rid);
            std::vector<int32_t> rec(ids, ids + k);
            std::string detail;
            double ratio = 0, meas = 0, bud = 0;
            if (rec != rt.ids) {
              // Within budget only if every swapped expert is within its choice budget of the
              // one it displaced.
              ratio = 0;
              for (int32_t a : rec) {
                if (a < 0 || a >= sp.experts) {
                  ratio = INFINITY;
                  detail = "expert id " + std::to_string(a) + " out of range";
                  break;
                }
                if (std::find(rt.ids.begin(), rt.ids.end(), a) != rt.ids.end()) continue;
                for (int32_t b : rt.ids) {
                  if (std::find(rec.begin(), rec.end(), b) != rec.end()) continue;
                  const double gap = rt.choice[b] - rt.choice[a];
                  const double bb = rt.choice_budget[a] + rt.choice_budget[b] + 1e-30;
                  const double r = rt.allowed[a] ? std::max(gap, 0.0) / bb : (gap > 0 ? gap / bb : 2 * g::kFp32U / bb + 1.0);
                  if (r > ratio) {
                    ratio = r;
                    meas = std::fabs(gap);
                    bud = bb;
                  }
                }
              }
              std::string rs, ts;
              for (int32_t a : rec) rs += (rs.empty() ? "" : ",") + std::to_string(a);
              for (int32_t a : rt.ids) ts += (ts.empty() ? "" : ",") + std::to_string(a);
              if (detail.empty()) detail = "chose experts {" + rs + "}, the twin {" + ts + "}";
            }
            // The weights of the recorded choice.
            std::vector<double> wv, wb;
            bool ids_ok = true;
            for (int32_t a : rec) ids_ok &= a >= 0 && a < sp.experts;
            if (ids_ok) {
              g::RouteWeights(sp, lg, rec, &wv, &wb);
              const float* rwts = t_w->F(rw);
              for (int64_t j = 0; j < k; ++j) {
                const double err = std::fabs(rwts[j] - wv[j]);
                const bool both_nan = std::isnan(rwts[j]) && std::isnan(wv[j]);  // NaN in, NaN out: consistent
                const double r = both_nan ? 0 : std::isfinite(err) ? err / (wb[j] + 1e-30) : INFINITY;
                if (r > ratio) {
                  ratio = r;
                  meas = err;
                  bud = wb[j];
                  detail = "weight of expert " + std::to_string(rec[j]) + ": " + std::to_string(rwts[j]) + ", the twin " +
                           std::to_string(wv[j]);
                }
              }
            }
            CompareSet(cx, OpIndex("router"), loc("ffn.router.topk_weights", t_w, rw), ratio, meas, bud, ratio > 1 ? detail : "");
            if (rfo >= 0 && ids_ok) {
              const float* rwts = t_w->F(rw);
              g::Vec y = c.n_shared_experts > 0 ? mlp(cx.W->layers[l].shared) : g::Vec{std::vector<double>(H, 0), std::vector<double>(H, 0)};
              for (int64_t j = 0; j < k; ++j) {
                const g::Vec ye = mlp(cx.W->layers[l].experts[rec[j]]);
                for (int64_t i = 0; i < H; ++i) {
                  const double t = ye.v[i] * rwts[j];
                  y.v[i] += t;
                  y.e[i] += ye.e[i] * std::fabs(rwts[j]) + (k + 2) * g::kFp32U * (std::fabs(t) + std::fabs(y.v[i]));
                }
              }
              Compare(cx, OpIndex("experts"), loc("ffn.out", t_ffo, rfo), t_ffo->F(rfo), widen("ffn.partials", y));
            }
          }
        }
      }
      allreduce("ffn.out", t_ffo, rfo, "ffn.partials");
      const Tensor* t_out = tap("resid_out");
      const int64_t rou = t_out ? t_out->Row(req, pos) : -1;
      if (rou >= 0 && rm >= 0 && rfo >= 0) {
        Compare(cx, OpIndex("resid_out"), loc("resid_out", t_out, rou), t_out->F(rou), g::Add(Row(t_mid->F(rm), H), Row(t_ffo->F(rfo), H)), 0, -1, false);
      }
      x_in = rou >= 0 ? t_out->F(rou) : nullptr;
    }
    // Final norm and LM head.
    const Tensor* t_fin = cx.T("final_norm");
    const int64_t rfin = t_fin ? t_fin->Row(req, pos) : -1;
    if (rfin >= 0 && x_in != nullptr) {
      Location w{req, -1, pos, t_fin->rows[rfin].step, "final_norm"};
      w.prefill = pos < plen;
      Compare(cx, OpIndex("final_norm"), w, t_fin->F(rfin),
              g::RmsNorm(Row(x_in, H), cx.W->final_norm.ptr(), cx.file.rms_norm_eps.value_or(c.rms_norm_eps)));
    }
    if (rfin >= 0) CheckLmHead(cx, req, pos, plen, t_fin, rfin);
    ++done;
    if (opt.progress) opt.progress(done, total);
  }

}

}  // namespace

const OpReport* CheckReport::first_defect() const {
  const OpReport* best = nullptr;
  auto key = [](const OpReport& o) {
    return std::make_tuple(o.first.step, LayerRank(OpIndex(o.op), o.first.layer), OpIndex(o.op), o.first.request,
                           o.first.position);
  };
  for (const auto& o : ops) {
    if (!o.failed) continue;
    if (best == nullptr || key(o) < key(*best)) best = &o;
  }
  if (best == nullptr) {
    for (const auto& o : ops) {
      if (o.bias_failed) return &o;
    }
  }
  return best;
}

void internal::CheckAllReduce(Ctx& cx, const Location& where, const float* out, const float* partials, int64_t H) {
  const int op = OpIndex("allreduce");
  const int64_t tp = cx.tp;
  if (cx.Variant("allreduce") == "ring") {
    g::Vec y;
    y.v.assign(H, 0.0);
    y.e.assign(H, 0.0);
    for (int64_t i = 0; i < H; ++i) {
      for (int64_t r = 0; r < tp; ++r) y.v[i] += partials[r * H + i];
      y.e[i] = AllReduceRounding(partials, tp, H, i);
    }
    Compare(cx, op, where, out, y, 0, -1, false);
    return;
  }
  int64_t bad = 0, first = -1;
  double worst = 0;
  for (int64_t i = 0; i < H; ++i) {
    float s = partials[i];
    for (int64_t r = 1; r < tp; ++r) s += partials[r * H + i];
    if (std::memcmp(&s, &out[i], 4) != 0) {
      if (first < 0) first = i;
      ++bad;
      worst = std::max(worst, std::fabs(static_cast<double>(s) - out[i]));
    }
  }
  Location w = where;
  w.column = first;
  CompareSet(cx, op, w, bad > 0 ? INFINITY : 0, worst, 0,
             bad > 0 ? std::to_string(bad) + " of " + std::to_string(H) + " values are not the " + std::to_string(tp) +
                           " ranks' partials summed in rank order (emulated TP)"
                     : "");
}

Result<CheckReport> CheckTrace(const traces::TraceReader& trace, const CheckOptions& opt) {
  Ctx cx;
  cx.trace = &trace;
  CheckReport rep;
  rep.trace = trace.path();
  const auto& meta = trace.meta();
  std::filesystem::path model_dir = opt.model_dir;
  if (model_dir.empty()) {
    auto it = meta.find("model_dir");
    if (it == meta.end()) return Status::InvalidArgument(trace.path().string() + ": meta.model_dir is missing (pass --model)");
    model_dir = it->second;
  }
  LS_ASSIGN_OR_RETURN(cx.model, engine::Model::Load(model_dir));
  const engine::ModelConfig& c = cx.model->config();
  cx.c = &c;
  cx.file = ReadFileConfig(model_dir, c.family == engine::ModelFamily::kDeepseekV2);
  {
    auto it = meta.find("kernels");
    const nlohmann::json j = nlohmann::json::parse(it == meta.end() ? "{}" : it->second, nullptr, false);
    if (!j.is_object()) return Status::Corruption(trace.path().string() + ": meta.kernels is not JSON");
    for (const auto& [k, v] : j.items()) {
      if (v.is_string()) cx.variants[k] = v.get<std::string>();
    }
    auto kv = meta.find("kv_cache_format");
    cx.kv_format = kv == meta.end() ? "fp32" : kv->second;
  }
  rep.kv_format = cx.kv_format;
  {
    // The emulated TP degree the partials were recorded at (1 when the trace says none).
    auto it = meta.find("engine_options");
    const nlohmann::json j = nlohmann::json::parse(it == meta.end() ? "{}" : it->second, nullptr, false);
    // A run over real ranks (tp_ranks, --tp-ranks N) recorded emulated TP N's partials.
    for (const char* key : {"emulate_tp", "tp_ranks"}) {
      if (!j.is_object() || !j.contains(key)) continue;
      if (!j[key].is_number_integer() || j[key].get<int64_t>() < 1 || j[key].get<int64_t>() > engine::kMaxEmulatedTp) {
        return Status::Corruption(trace.path().string() + ": meta.engine_options: " + key + " is " + j[key].dump() +
                                  ", not a whole number from 1 to " + std::to_string(engine::kMaxEmulatedTp));
      }
      cx.tp = std::max(cx.tp, j[key].get<int64_t>());
    }
  }
  LS_RETURN_IF_ERROR(CheckShapes(trace, c, cx.kv_format, cx.Variant("indexer") == "fp8_paged", cx.tp));
  const std::string gemm = cx.Variant("gemm");
  const bool bf16 = gemm.rfind("bf16", 0) == 0;
  const bool fp8w = gemm == "fp8_dot" || gemm == "w8a8_dot";
  cx.W = fp8w                   ? &cx.model->Fp8Weights()
         : gemm == "mxfp4_dot" ? &cx.model->Fp4Weights(kernels::WeightDType::kMxfp4)
         : gemm == "nvfp4_dot" ? &cx.model->Fp4Weights(kernels::WeightDType::kNvfp4)
                               : &cx.model->weights();
  cx.gemm = {g::kFp32U, bf16 ? g::kBf16U : 0, bf16 ? g::kBf16U : 0};
  cx.linear = cx.gemm;
  if (gemm == "w8a8_dot") cx.linear.in_x = g::kFp8U;
  cx.fp32 = {};
  g::RopeSpec rs;
  rs.theta = cx.file.rope_theta.value_or(c.rope.theta);
  rs.yarn = c.rope.yarn;
  rs.factor = c.rope.factor;
  rs.beta_fast = c.rope.beta_fast;
  rs.beta_slow = c.rope.beta_slow;
  rs.original_max_pos = static_cast<double>(c.rope.original_max_position_embeddings);
  rs.truncate = c.rope.truncate;
  cx.inv_freq = g::RopeInvFreq(rs, c.qk_rope_head_dim);
  cx.af = g::RopeAttentionFactor(c.rope.yarn, c.rope.factor, c.rope.mscale, c.rope.mscale_all_dim,
                                 c.rope.attention_factor_field);
  cx.layout = c.rope_style == engine::RopeStyle::kHalves          ? g::RopeLayout::kHalves
              : c.rope_style == engine::RopeStyle::kPairsAdjacent ? g::RopeLayout::kPairsAdjacent
                                                                 : g::RopeLayout::kPairsToHalves;
  for (const auto& q : trace.requests()) cx.prompt_len[q.id] = static_cast<int64_t>(q.prompt.size());
  cx.stats.resize(kNumOps);
  for (int i = 0; i < kNumOps; ++i) {
    cx.stats[i].rep.op = kOps[i].op;
    cx.stats[i].rep.kernel_op = kOps[i].kernel_op;
    cx.stats[i].rep.variant = cx.Variant(kOps[i].kernel_op);
    cx.stats[i].rep.what = kOps[i].what;
  }
  cx.stats[OpIndex("kv_cache")].rep.variant = cx.Variant("kv_quant") + " (" + cx.kv_format + ")";

  if (cx.T("embed") == nullptr) {
    return Status::InvalidArgument(trace.path().string() +
                                   ": no tap values (taps/embed): verify needs a full capture (lockstep replay --capture full)");
  }
  if (c.is_v4()) {
    CheckV4Rows(cx, opt);
  } else {
    CheckMlaRows(cx, opt);
  }

  // The sampler: every sampled token redrawn from its recorded logits row.
  {
    LS_ASSIGN_OR_RETURN(auto sampling, trace.ReadSampling());
    Stats& ss = cx.stats[OpIndex("sampler")];
    const Tensor* t_lg = cx.T("logits");
    const Tensor* t_ti = t_lg ? nullptr : cx.T("logits.topk_ids");
    for (const auto& s : sampling) {
      const int64_t pos = (cx.prompt_len.count(s.request) ? cx.prompt_len[s.request] : 0) + s.token_index - 1;
      const int32_t sampled = s.sampled >= 0 ? s.sampled : s.token;
      Location w{s.request, -1, pos, s.step, "sampling"};
      const int64_t rl = t_lg ? t_lg->Row(s.request, pos) : -1;
      if (rl >= 0) {
        const g::Draw d = g::Sample(std::span<const float>(t_lg->F(rl), c.vocab_size), s.temperature, s.top_k, s.top_p,
                                    s.min_p, s.seed, s.counter);
        const bool same = d.token == sampled && (s.temperature <= 0 || d.uniform == s.uniform);
        std::string detail;
        if (!same) {
          detail = "sampled token " + std::to_string(sampled) + "; redrawn from the recorded logits: " + std::to_string(d.token) +
                   (s.temperature > 0 ? " (uniform " + std::to_string(s.uniform) + " recorded, " + std::to_string(d.uniform) + " redrawn)" : "");
        }
        CompareSet(cx, OpIndex("sampler"), w, same ? 0 : INFINITY, same ? 0 : 1, 0, detail);
      } else if (t_ti) {
        // Only the top-K logits were recorded: the draw is redone where they decide it
        // (golden::SampleFromTopK), else the row is not checked.
        const Tensor* t_tv = cx.T("logits.topk_values");
        const Tensor* t_ls = cx.T("logits.logsumexp");
        const int64_t ri = t_ti->Row(s.request, pos), rv = t_tv ? t_tv->Row(s.request, pos) : -1;
        if (ri < 0 || rv < 0 || t_tv->info->cols != t_ti->info->cols || t_ti->info->dtype != traces::DType::kI32 ||
            t_tv->info->dtype != traces::DType::kF32) {
          ++ss.rep.not_checked;
          ss.rep.not_checked_why = "the row's logits.topk_ids / topk_values are not in the trace";
          continue;
        }
        const int64_t rs = t_ls ? t_ls->Row(s.request, pos) : -1;
        auto f32_col = [](const Tensor* t) { return t->info->cols >= 1 && t->info->dtype == traces::DType::kF32; };
        const double lse = rs >= 0 && f32_col(t_ls) ? static_cast<double>(t_ls->F(rs)[0]) : NAN;
        // The row's logsumexp at its sampling temperature, where the recorder kept it.
        const Tensor* t_lt = cx.T("logits.logsumexp_t");
        const int64_t rt = t_lt ? t_lt->Row(s.request, pos) : -1;
        const double lse_t = rt >= 0 && f32_col(t_lt) ? static_cast<double>(t_lt->F(rt)[0]) : NAN;
        const int64_t K = t_ti->info->cols;
        const std::span<const int32_t> ids(t_ti->I(ri), K);
        const g::TopKDraw d = g::SampleFromTopK(ids, std::span<const float>(t_tv->F(rv), K), c.vocab_size, lse,
                                                s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.counter, lse_t);
        if (d.outcome == g::TopKDraw::kUndecided) {
          ++ss.rep.not_checked;
          ss.rep.not_checked_why = "only the top-" + std::to_string(K) + " logits are recorded and " + d.why +
                                   " (record with --logits full)";
          continue;
        }
        const bool same_u = s.temperature <= 0 || d.uniform == s.uniform;
        bool same = same_u;
        std::string detail;
        if (d.outcome == g::TopKDraw::kToken) {
          same = same && d.token == sampled;
          if (d.token != sampled) {
            detail = "sampled token " + std::to_string(sampled) + "; redrawn from the recorded top-" + std::to_string(K) +
                     " logits: " + std::to_string(d.token);
          }
        } else {  // the draw lands past the recorded K: any other token, none of them
          const bool outside = sampled >= 0 && sampled < c.vocab_size && std::find(ids.begin(), ids.end(), sampled) == ids.end();
          same = same && outside;
          if (!outside) {
            detail = "sampled token " + std::to_string(sampled) + "; redrawn from the recorded top-" + std::to_string(K) +
                     " logits, the draw lands past all of them (a token outside the top-" + std::to_string(K) + ")";
          }
        }
        if (!same_u) {
          detail += std::string(detail.empty() ? "" : "; ") + "uniform " + std::to_string(s.uniform) + " recorded, " +
                    std::to_string(d.uniform) + " redrawn";
        }
        CompareSet(cx, OpIndex("sampler"), w, same ? 0 : INFINITY, same ? 0 : 1, 0, detail);
      } else {
        ++ss.rep.not_checked;
        ss.rep.not_checked_why = "sampled rows need full logits (record with --logits full)";
      }
    }
  }

  for (int i = 0; i < kNumOps; ++i) {
    Stats& st = cx.stats[i];
    if (st.bias_rows >= kBiasMinRows) {
      const double ta = st.sa2 > 0 ? st.sa / std::sqrt(st.sa2) : 0, tb = st.sb2 > 0 ? st.sb / std::sqrt(st.sb2) : 0;
      const double ma = st.sa / st.bias_rows, mb = st.sb / st.bias_rows;
      const bool use_a = std::fabs(ta) >= std::fabs(tb);
      st.rep.bias_t = use_a ? ta : tb;
      st.rep.bias_mean = use_a ? ma : mb;
      st.rep.bias_failed = std::fabs(st.rep.bias_t) > kBiasT && std::fabs(st.rep.bias_mean) > kBiasMinMean;
    }
    const Family fam = kOps[i].family;
    if (fam != kAny && (fam == kV4) != c.is_v4()) continue;  // another family's op
    if (st.rep.rows == 0 && st.rep.not_checked == 0) {
      rep.not_verified.push_back(std::string(kOps[i].op) + ": no rows (the trace holds none of its taps, or the model has none)");
    } else if (st.rep.not_checked > 0) {
      rep.not_verified.push_back(std::string(kOps[i].op) + ": " + std::to_string(st.rep.not_checked) + " row(s) not checked (" +
                                 st.rep.not_checked_why + ")");
    }
    rep.rows += st.rep.rows;
    rep.values += st.rep.values;
    rep.ops.push_back(std::move(st.rep));
  }
  return rep;
}

}  // namespace lockstep::verify
