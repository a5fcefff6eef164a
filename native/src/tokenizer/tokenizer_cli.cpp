// tokenizer_cli: batch access to the C++ tokenizer (one process, one load).
//
//   tokenizer_cli --tokenizer tokenizer.json encode [--add-special] [--input F]
//       input: one JSON string per line; output: one JSON object per line
//       {"ids": [...], "text": decode(ids), "stream": decode_token one by one through
//       the runner's UTF-8 stream}
//   tokenizer_cli --tokenizer tokenizer.json decode [--skip-special] [--input F]
//       input: one JSON array of ids per line; output: one JSON string per line
//   tokenizer_cli --tokenizer tokenizer.json info
//       output: {"vocab_size":..,"bos_id":..,"merges":..,"load_seconds":..}
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

using json = nlohmann::json;

static void usage() {
  std::fprintf(stderr,
               "usage: tokenizer_cli --tokenizer PATH (encode [--add-special] | decode "
               "[--skip-special] | info) [--input FILE]\n");
}

static std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

int main(int argc, char** argv) {
  std::string tok_path, mode, input;
  bool add_special = false, skip_special = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--tokenizer" && i + 1 < argc) tok_path = argv[++i];
    else if (a == "--input" && i + 1 < argc) input = argv[++i];
    else if (a == "--add-special") add_special = true;
    else if (a == "--skip-special") skip_special = true;
    else if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else if (mode.empty() && (a == "encode" || a == "decode" || a == "info")) mode = a;
    else {
      std::fprintf(stderr, "error: unknown argument '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (tok_path.empty() || mode.empty()) {
    usage();
    return 2;
  }
  std::unique_ptr<llmrt::Tokenizer> tok;
  try {
    tok = llmrt::Tokenizer::from_file(tok_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "tokenizer loaded in %.3f s (%lld ids, %zu merges)\n", tok->load_seconds(),
               static_cast<long long>(tok->vocab_size()), tok->num_merges());
  if (mode == "info") {
    json j = {{"vocab_size", tok->vocab_size()},
              {"bos_id", tok->bos_id()},
              {"merges", tok->num_merges()},
              {"load_seconds", tok->load_seconds()}};
    std::cout << dump(j) << "\n";
    return 0;
  }
  std::ifstream file;
  std::istream* in = &std::cin;
  if (!input.empty()) {
    file.open(input, std::ios::binary);
    if (!file) {
      std::fprintf(stderr, "error: cannot open '%s'\n", input.c_str());
      return 1;
    }
    in = &file;
  }
  std::ios::sync_with_stdio(false);
  std::string line;
  size_t lineno = 0;
  try {
    while (std::getline(*in, line)) {
      ++lineno;
      json j = json::parse(line);
      if (mode == "encode") {
        std::string text = j.get<std::string>();
        std::vector<int32_t> ids = tok->encode(text, add_special);
        // What the runner prints: token by token through the UTF-8 stream.
        llmrt::Utf8Stream utf8;
        std::string stream;
        for (size_t k = 0; k < ids.size(); ++k) stream += utf8.push(tok->decode_token(ids[k], k == 0));
        stream += utf8.finish();
        json o = {{"ids", ids}, {"text", tok->decode(ids)}, {"stream", stream}};
        std::cout << dump(o) << "\n";
      } else {
        std::vector<int32_t> ids = j.get<std::vector<int32_t>>();
        std::cout << dump(json(tok->decode(ids, skip_special))) << "\n";
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: line %zu: %s\n", lineno, e.what());
    return 1;
  }
  return 0;
}
