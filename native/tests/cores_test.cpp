// Every ISA path's numeric cores (kernels/cores.h) on the same inputs: cores_test IN_DIR OUT_DIR
//
// IN_DIR (written by tests/native/test_isa_paths.py): dims.txt, then raw little-endian arrays
//   tied: T D V, tied_x.f32 [T,D], tied_w.i8 [V,D], tied_s.f32 [V]
//   delta: T Hk Hv Dk Dv pos scale, delta_{q,k}.f32 [T,Hk,Dk], delta_v.f32 [T,Hv,Dv], delta_{a,b}.f32 [T,Hv],
//          delta_{A_log,dt_bias}.f32 [Hv], delta_state.f32 [Hv,Dk,Dv]
//   conv: T C K pos silu, conv_x.f32 [T,C], conv_w.f32 [C,K], conv_bias.f32 [C], conv_state.f32 [K-1,C]
//   ssd: T H P G N pos, ssd_x.f32 [T,H,P], ssd_dt.f32 [T,H], ssd_{A_log,dt_bias,D}.f32 [H], ssd_{B,C}.f32 [T,G,N],
//        ssd_state.f32 [H,N,P]
// OUT_DIR: per path P, tied_P.f32, delta_out_P.f32, delta_state_P.f32, conv_out_P.f32, conv_state_P.f32,
// ssd_out_P.f32, ssd_state_P.f32, and
// experts_P.f32 (three projections of an expert on inputs made here: int8 weights with dynamic int8 activations,
// 4-bit weights in groups, fp32 weights), for the Python test to hold against its twins.
// Prints "paths: ..." and, per kernel and path, "ok <kernel> <path>: ..." or "FAIL ...": the tied head's and the
// experts' outputs must equal the scalar path's bit for bit (exact integer sums), the recurrent ones within 1e-5.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cores.h"
#include "kernels/experts_core.h"
#include "kernels/isa.h"
#include "kernels/recurrent_core.h"

using llmrt::Cores;
using llmrt::isa::Isa;

namespace {

std::string g_in, g_out;
int g_failures = 0;

template <class T>
std::vector<T> read(const std::string& name, size_t n) {
  std::vector<T> v(n);
  std::ifstream f(g_in + "/" + name, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  if (!f) {
    std::fprintf(stderr, "cannot read %zu values of %s\n", n, name.c_str());
    std::exit(2);
  }
  return v;
}

void write(const std::string& name, const std::vector<float>& v) {
  std::ofstream f(g_out + "/" + name, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
}

// exact: bit for bit; else within tol of the scalar path's largest magnitude
void compare(const char* kernel, const char* path, const std::vector<float>& got, const std::vector<float>& ref,
             bool exact, float tol = 1e-5f) {
  float worst = 0.f, scale = 1.f;
  for (float r : ref) scale = std::max(scale, std::fabs(r));
  bool same = got.size() == ref.size();
  for (size_t i = 0; same && i < got.size(); ++i) {
    if (exact ? std::memcmp(&got[i], &ref[i], sizeof(float)) != 0 : !(std::fabs(got[i] - ref[i]) <= tol * scale))
      same = false;
    worst = std::max(worst, std::fabs(got[i] - ref[i]));
  }
  std::printf("%s %s %s: %s the scalar path's (max |diff| %.3g)\n", same ? "ok" : "FAIL", kernel, path,
              exact ? "bits equal" : "within tolerance of", worst);
  g_failures += same ? 0 : 1;
}

std::map<std::string, int64_t> dims() {
  std::ifstream f(g_in + "/dims.txt");
  std::map<std::string, int64_t> d;
  std::string key;
  double value;
  while (f >> key >> value) d[key] = static_cast<int64_t>(value);
  return d;
}

double dims_scale() {
  std::ifstream f(g_in + "/dims.txt");
  std::string key;
  double value;
  while (f >> key >> value)
    if (key == "delta_scale") return value;
  return 1.0;
}

// a deterministic stream of small values (the experts' inputs: the test reads them back from experts_P.f32 only)
struct Lcg {
  uint32_t s = 12345;
  uint32_t next() { return s = s * 1664525u + 1013904223u; }
  float uniform() { return static_cast<float>(next() >> 8) / 16777216.f * 2.f - 1.f; }
};

std::vector<float> run_experts(const Cores& c) {
  const int64_t in = 192, out = 40, n = 3, groups = 6;
  Lcg r;
  std::vector<float> x(n * in), wf(out * in), s(out * groups), b(out);
  std::vector<int8_t> wq(out * in);
  std::vector<uint8_t> w4(out * in / 2);
  for (auto& v : x) v = 3.f * r.uniform();
  for (auto& v : wf) v = r.uniform();
  for (auto& v : s) v = 0.01f + 0.02f * std::fabs(r.uniform());
  for (auto& v : b) v = r.uniform();
  for (auto& v : wq) v = static_cast<int8_t>(static_cast<int>(r.next() % 255) - 127);
  for (auto& v : w4) v = static_cast<uint8_t>(r.next() & 0xFF);
  std::vector<float> y(n * out), all;
  std::vector<int16_t> qz;
  std::vector<float> rs;
  llmrt::experts::Proj p8{nullptr, wq.data(), nullptr, s.data(), b.data(), out, in, groups, true};
  llmrt::experts::Proj p4{nullptr, nullptr, w4.data(), s.data(), nullptr, out, in, groups, false};
  llmrt::experts::Proj pf{wf.data(), nullptr, nullptr, nullptr, b.data(), out, in, 1, false};
  for (const auto* p : {&p8, &p4, &pf}) {
    c.experts_project(*p, 0, x.data(), n, y.data(), qz, rs);
    all.insert(all.end(), y.begin(), y.end());
  }
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: cores_test IN_DIR OUT_DIR\n");
    return 2;
  }
  g_in = argv[1], g_out = argv[2];
  auto d = dims();
  const int64_t tT = d["tied_T"], tD = d["tied_D"], tV = d["tied_V"];
  auto tx = read<float>("tied_x.f32", tT * tD);
  auto tw = read<int8_t>("tied_w.i8", tV * tD);
  auto ts = read<float>("tied_s.f32", tV);
  const int64_t T = d["delta_T"], Hk = d["delta_Hk"], Hv = d["delta_Hv"], Dk = d["delta_Dk"], Dv = d["delta_Dv"];
  auto q = read<float>("delta_q.f32", T * Hk * Dk), k = read<float>("delta_k.f32", T * Hk * Dk);
  auto v = read<float>("delta_v.f32", T * Hv * Dv);
  auto a = read<float>("delta_a.f32", T * Hv), bb = read<float>("delta_b.f32", T * Hv);
  auto A_log = read<float>("delta_A_log.f32", Hv), dt_bias = read<float>("delta_dt_bias.f32", Hv);
  auto state0 = read<float>("delta_state.f32", Hv * Dk * Dv);
  const int64_t cT = d["conv_T"], C = d["conv_C"], K = d["conv_K"];
  auto cx = read<float>("conv_x.f32", cT * C), cw = read<float>("conv_w.f32", C * K);
  auto cb = read<float>("conv_bias.f32", C), cstate0 = read<float>("conv_state.f32", (K - 1) * C);

  const int64_t sT = d["ssd_T"], sH = d["ssd_H"], sP = d["ssd_P"], sG = d["ssd_G"], sN = d["ssd_N"];
  auto sx = read<float>("ssd_x.f32", sT * sH * sP), sdt = read<float>("ssd_dt.f32", sT * sH);
  auto sA = read<float>("ssd_A_log.f32", sH), sbias = read<float>("ssd_dt_bias.f32", sH);
  auto sD = read<float>("ssd_D.f32", sH), sB = read<float>("ssd_B.f32", sT * sG * sN);
  auto sC = read<float>("ssd_C.f32", sT * sG * sN), sstate0 = read<float>("ssd_state.f32", sH * sN * sP);

  std::map<std::string, std::vector<float>> scalar;
  std::string names;
  for (Isa path : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::neon, Isa::dotprod}) {
    const Cores* c = llmrt::cores_of(path);
    if (c == nullptr) continue;
    const std::string P = llmrt::isa::name(path);
    names += (names.empty() ? "" : " ") + P;
    std::map<std::string, std::vector<float>> got;
    got["tied"].resize(tT * tV);
    c->tied_head(tx.data(), tT, tw.data(), ts.data(), tV, tD, got["tied"].data());

    llmrt::recurrent::DeltaStep ds;
    ds.q = q.data(), ds.k = k.data(), ds.v = v.data(), ds.a = a.data(), ds.b = bb.data();
    ds.A_log = A_log.data(), ds.dt_bias = dt_bias.data();
    got["delta_out"].resize(T * Hv * Dv);
    ds.out = got["delta_out"].data();
    ds.pos = d["delta_pos"], ds.T = T, ds.Hk = Hk, ds.Hv = Hv, ds.Dk = Dk, ds.Dv = Dv;
    ds.scale = static_cast<float>(dims_scale());
    got["delta_state"] = state0;
    c->run_delta(ds, got["delta_state"].data());

    llmrt::recurrent::ConvStep cs;
    cs.x = cx.data(), cs.w = cw.data(), cs.bias = cb.data();
    got["conv_out"].resize(cT * C);
    cs.out = got["conv_out"].data();
    cs.pos = d["conv_pos"], cs.T = cT, cs.C = C, cs.K = K, cs.silu = d["conv_silu"] != 0;
    got["conv_state"] = cstate0;
    c->run_conv(cs, got["conv_state"].data());

    llmrt::recurrent::SsdStep ss;
    ss.x = sx.data(), ss.dt = sdt.data(), ss.A_log = sA.data(), ss.dt_bias = sbias.data();
    ss.B = sB.data(), ss.C = sC.data(), ss.D = sD.data();
    got["ssd_out"].resize(sT * sH * sP);
    ss.out = got["ssd_out"].data();
    ss.pos = d["ssd_pos"], ss.T = sT, ss.H = sH, ss.P = sP, ss.G = sG, ss.N = sN;
    ss.dt_min = 0.f, ss.dt_max = 3.4e38f;
    got["ssd_state"] = sstate0;
    c->run_ssd(ss, got["ssd_state"].data());

    got["experts"] = run_experts(*c);
    for (const auto& [name, values] : got) {
      write(name + "_" + P + ".f32", values);
      if (path == Isa::scalar) {
        scalar[name] = values;
      } else {
        const bool exact = name == "tied" || name == "experts";
        compare(name.c_str(), P.c_str(), values, scalar[name], exact);
      }
    }
  }
  std::printf("paths: %s\n", names.c_str());
  return g_failures == 0 ? 0 : 1;
}
