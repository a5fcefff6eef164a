#include "runtime/pte_check.h"

#include <cctype>
#include <fstream>

#include <nlohmann/json.hpp>

#include "runtime/llm_program.h"
#include "runtime/sha256.h"

namespace llmrt {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string dir_of(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
}

std::string base_of(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// The digest manifest.json records for `path` (keyed by the file's name), or a ProgramError that
// says what is missing; `actual` goes into the message so a user can compare by hand.
std::string manifest_digest(const std::string& path, const std::string& actual) {
  const std::string manifest = dir_of(path) + "/manifest.json";
  const std::string key = base_of(path);
  auto missing = [&](const std::string& why) {
    return ProgramError("--verify-pte: " + why + "; cannot verify '" + path + "' (expected: no record, actual " +
                        actual + ")");
  };
  std::ifstream in(manifest, std::ios::binary);
  if (!in) throw missing("no manifest.json beside it (" + manifest + ")");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw missing(manifest + " is not a JSON object");
  auto outputs = j.find("outputs");
  if (outputs == j.end() || !outputs->is_object()) throw missing(manifest + " has no \"outputs\" object");
  auto entry = outputs->find(key);
  if (entry == outputs->end() || !entry->is_object())
    throw missing(manifest + " has no record of \"" + key + "\" in \"outputs\"");
  auto sha = entry->find("sha256");
  if (sha == entry->end() || !sha->is_string() || !is_sha256_hex(sha->get<std::string>()))
    throw missing(manifest + " records no valid \"sha256\" for \"" + key + "\"");
  return lower(sha->get<std::string>());
}

}  // namespace

bool is_sha256_hex(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

std::string verify_pte_digest(const std::string& path, const std::string& spec) {
  std::string actual;
  try {
    actual = sha256_file_hex(path);
  } catch (const std::runtime_error& e) {
    throw ProgramError(std::string("--verify-pte: ") + e.what());
  }
  const bool from_manifest = spec == "auto";
  const std::string expected = from_manifest ? manifest_digest(path, actual) : lower(spec);
  if (expected != actual)
    throw ProgramError("--verify-pte: '" + path + "' does not match its recorded digest: expected sha256 " +
                       expected + (from_manifest ? " (" + dir_of(path) + "/manifest.json)" : std::string()) +
                       ", actual " + actual + " (damaged or a different file)");
  return actual;
}

}  // namespace llmrt
