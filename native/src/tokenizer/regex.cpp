#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace llmrt::tokenizer_detail {

struct Regex::Pcre {
  pcre2_code* code = nullptr;
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;

  ~Pcre() {
    if (md) pcre2_match_data_free(md);
    if (mctx) pcre2_match_context_free(mctx);
    if (stack) pcre2_jit_stack_free(stack);
    if (code) pcre2_code_free(code);
  }
};

Regex::Regex(const std::string& pattern) : pcre_(std::make_unique<Pcre>()) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (!pcre_->code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    throw TokenizerError("tokenizer.json: cannot compile regex '" + pattern +
                         "': " + reinterpret_cast<char*>(buf) + " at offset " +
                         std::to_string(off));
  }
  const bool jit = pcre2_jit_compile(pcre_->code, PCRE2_JIT_COMPLETE) == 0;
  pcre_->md = pcre2_match_data_create_from_pattern(pcre_->code, nullptr);
  if (jit) {
    pcre_->stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    pcre_->mctx = pcre2_match_context_create(nullptr);
    pcre2_jit_stack_assign(pcre_->mctx, nullptr, pcre_->stack);
  }
}

Regex::~Regex() = default;

void Regex::find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
  out.clear();
  size_t pos = 0;
  auto subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  while (pos <= s.size()) {
    int rc = pcre2_match(pcre_->code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, pcre_->md, pcre_->mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(rc, buf, sizeof(buf));
      throw TokenizerError(std::string("regex match failed: ") + reinterpret_cast<char*>(buf));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(pcre_->md);
    size_t a = ov[0], b = ov[1];
    out.emplace_back(a, b);
    if (b > a) {
      pos = b;
    } else {  // empty match: step one character
      if (a >= s.size()) break;
      pos = a + utf8_lead_len(static_cast<unsigned char>(s[a]));
    }
  }
}

}  // namespace llmrt::tokenizer_detail
