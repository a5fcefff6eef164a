// sha256_test: the runner's SHA-256 (src/runtime/sha256.h) against the FIPS 180-4 / NIST test vectors,
// fed whole and in uneven pieces (block boundaries are where a hand-written hash goes wrong).
// Prints one line per case; exit 0 when every case passes. Run by tests/native/test_program_integrity.py.
#include <algorithm>
#include <cstdio>
#include <string>

#include "runtime/sha256.h"

namespace {

struct Vector {
  const char* name;
  std::string message;
  const char* digest;
};

int failures = 0;

void expect(const std::string& name, const std::string& got, const std::string& want) {
  bool ok = got == want;
  failures += !ok;
  std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), ok ? "" : ": got ", ok ? "" : got.c_str());
}

// The digest of `m` fed in pieces of `step` bytes.
std::string in_pieces(const std::string& m, size_t step) {
  llmrt::Sha256 s;
  for (size_t i = 0; i < m.size(); i += step) s.update(m.data() + i, std::min(step, m.size() - i));
  return s.hex_digest();
}

}  // namespace

int main() {
  const Vector vectors[] = {
      {"empty", "", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abc", "abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"448-bit", "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {"896-bit",
       "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopq"
       "rstu",
       "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
      {"million-a", std::string(1000000, 'a'), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"},
      {"55-bytes", std::string(55, 'a'), "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},
      {"56-bytes", std::string(56, 'a'), "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},
      {"64-bytes", std::string(64, 'a'), "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
  };
  for (const Vector& v : vectors) {
    expect(v.name, llmrt::sha256_hex(v.message), v.digest);
    for (size_t step : {1, 3, 63, 64, 65, 1000})
      if (step < v.message.size()) expect(std::string(v.name) + " in pieces of " + std::to_string(step),
                                          in_pieces(v.message, step), v.digest);
  }
  std::printf("%s\n", failures ? "FAILED" : "ALL PASS");
  return failures ? 1 : 0;
}
