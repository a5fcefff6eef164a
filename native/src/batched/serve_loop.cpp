#include "batched/serve_loop.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <iostream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace llmrt {

namespace {

using json = nlohmann::json;

void emit(const json& j) {
  const std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  throw std::invalid_argument(std::string("a mask is hex digits, got '") + c + "'");
}

std::vector<uint32_t> parse_mask(const std::string& hex, int64_t vocab) {
  const size_t words = static_cast<size_t>((vocab + 31) / 32);
  if (hex.size() != words * 8)
    throw std::invalid_argument("a mask is " + std::to_string(words * 8) + " hex digits for a vocabulary of " +
                                std::to_string(vocab) + ", got " + std::to_string(hex.size()));
  std::vector<uint32_t> bits(words, 0);
  for (size_t b = 0; b < words * 4; ++b) {
    const uint32_t byte = static_cast<uint32_t>(hex_digit(hex[2 * b]) << 4 | hex_digit(hex[2 * b + 1]));
    bits[b / 4] |= byte << (8 * (b % 4));
  }
  return bits;
}

Request parse_submit(const json& j, int64_t vocab) {
  Request r;
  r.id = j.at("id").get<int64_t>();
  r.prompt = static_cast<int>(r.id);
  r.ids = j.at("ids").get<std::vector<int64_t>>();
  for (int64_t t : r.ids)
    if (t < 0 || t >= vocab)
      throw std::invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                  std::to_string(vocab) + ")");
  RequestOptions& o = r.opts;
  if (j.contains("max_tokens")) o.max_new_tokens = j["max_tokens"].get<int64_t>();
  if (j.contains("temperature")) o.temperature = j["temperature"].get<double>();
  if (j.contains("top_p")) o.top_p = j["top_p"].get<double>();
  if (j.contains("top_k")) o.top_k = j["top_k"].get<int64_t>();
  if (j.contains("seed")) o.seed = j["seed"].get<uint64_t>();
  if (j.contains("speculate")) o.speculate = j["speculate"].get<bool>();
  if (j.contains("ignore_eos")) o.ignore_stops = j["ignore_eos"].get<bool>();
  o.masked = j.contains("mask");
  if (o.masked) o.mask = parse_mask(j["mask"].get<std::string>(), vocab);
  return r;
}

json done_event(const Generation& g) {
  json e = {{"ev", "done"},
            {"id", g.req.id},
            {"reason", g.stop_reason},
            {"prompt_tokens", g.req.ids.size()},
            {"cached_tokens", g.cached_tokens},
            {"generated_tokens", g.generated.size()},
            {"queued_ms", g.queued_ms},
            {"ttft_ms", g.ttft_ms},
            {"decode_ms", g.decode_ms},
            {"drafted", g.spec.drafted},
            {"accepted", g.spec.accepted}};
  if (!g.ok) e["error"] = g.error;
  return e;
}

json stats_event(const Engine& engine, const EngineStats& st, double wall_ms) {
  const PrefixStats& ps = engine.prefix_cache().stats();
  return {{"ev", "stats"},
          {"wall_ms", wall_ms},
          {"forwards", st.forwards},
          {"rows", st.rows},
          {"prefill_tokens", st.prefill_tokens},
          {"decode_tokens", st.decode_tokens},
          {"decode_ms", st.decode_ms},
          {"generated_tokens", st.generated},
          {"drafted", st.drafted},
          {"accepted", st.accepted},
          {"peak_sessions", st.peak_sessions},
          {"kv_bytes_peak", st.peak_kv_bytes},
          {"active", engine.active()},
          {"queued", engine.queued()},
          {"prefix_cache", {{"lookups", ps.lookups}, {"hits", ps.hits}, {"misses", ps.misses},
                            {"inserts", ps.inserts}, {"evictions", ps.evictions}}}};
}

// stdin's lines, read on a thread of their own so that steps run while nothing arrives
class Inbox {
 public:
  Inbox() : reader_([this] { read(); }) { reader_.detach(); }
  // The lines so far; blocks while there are none and `block` (false once stdin has ended)
  std::deque<std::string> take(bool block, bool* ended) {
    std::unique_lock<std::mutex> lk(mu_);
    if (block) cv_.wait(lk, [&] { return !lines_.empty() || ended_; });
    std::deque<std::string> out;
    out.swap(lines_);
    *ended = ended_;
    return out;
  }

 private:
  void read() {
    std::string line;
    while (std::getline(std::cin, line)) {
      std::lock_guard<std::mutex> lk(mu_);
      lines_.push_back(std::move(line));
      cv_.notify_one();
    }
    std::lock_guard<std::mutex> lk(mu_);
    ended_ = true;
    cv_.notify_one();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> lines_;
  bool ended_ = false;
  std::thread reader_;
};

}  // namespace

int serve_stdio(Engine& engine, int64_t vocab, json ready) {
  const auto t0 = std::chrono::steady_clock::now();
  EngineStats st;
  ready["ev"] = "ready";
  emit(ready);
  std::fflush(stdout);
  Inbox inbox;
  for (;;) {
    bool ended = false;
    for (const std::string& line : inbox.take(!engine.can_step(), &ended)) {
      json j;
      try {
        j = json::parse(line);
        const std::string op = j.at("op").get<std::string>();
        if (op == "submit") {
          engine.submit(parse_submit(j, vocab));
        } else if (op == "mask") {
          if (!engine.set_mask(j.at("id").get<int64_t>(), parse_mask(j.at("mask").get<std::string>(), vocab)))
            emit({{"ev", "error"}, {"id", j["id"]}, {"message", "mask for a request that is not active"}});
        } else if (op == "cancel") {
          engine.cancel(j.at("id").get<int64_t>());
        } else if (op == "stats") {
          emit(stats_event(engine, st, std::chrono::duration<double, std::milli>(
                                           std::chrono::steady_clock::now() - t0).count()));
        } else {
          throw std::invalid_argument("unknown op '" + op + "' (submit, mask, cancel, stats)");
        }
      } catch (const std::exception& e) {  // json's own errors included
        json err = {{"ev", "error"}, {"message", e.what()}};
        if (j.is_object() && j.contains("id")) err["id"] = j["id"];
        emit(err);
      }
    }
    if (ended) return 0;
    if (engine.can_step()) {
      std::vector<TokenEvent> tokens;
      const std::vector<Generation> gens = engine.step(&st, &tokens);
      for (const TokenEvent& t : tokens) emit({{"ev", "tokens"}, {"id", t.id}, {"tokens", t.tokens}});
      for (const Generation& g : gens) emit(done_event(g));
    }
    std::fflush(stdout);
  }
}

}  // namespace llmrt
