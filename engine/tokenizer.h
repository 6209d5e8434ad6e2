// engine/tokenizer.h — Hugging Face `tokenizer.json` byte-level BPE, as DeepSeek and most
// GPT-style models ship it.
//
// Ids equal Hugging Face `tokenizers`' (checked against its output in
// tests/fixtures/tokenizers/). Supports: model.type "BPE" (vocab + merges, merges either as
// "a b" strings or [a, b] pairs; ignore_merges, unk_token / fuse_unk, byte_fallback,
// continuing_subword_prefix, end_of_word_suffix); pre_tokenizers Split (Oniguruma regex run
// as PCRE2, or a literal String; behaviors Isolated / Removed / MergedWithPrevious /
// MergedWithNext / Contiguous; invert), ByteLevel (add_prefix_space, use_regex with the
// GPT-2 pattern) and Sequence of these; normalizer null or an empty Sequence; added_tokens
// (special and not, single_word / lstrip / rstrip / normalized) matched before
// pre-tokenization, leftmost-longest, with ids assigned as HF's loader assigns them;
// post_processor TemplateProcessing / RobertaProcessing / BertProcessing / ByteLevel /
// Sequence, applied only for add_special_tokens; decoder ByteLevel or none (tokens joined by
// spaces, as HF). Other types are refused with an Unsupported error naming the field.
// `truncation` and `padding` in the file are ignored, as transformers' encode ignores them.
// tokenizer_config.json, when given (Load reads the one beside tokenizer.json), decides the
// special-token template as transformers does: with tokenizer_class LlamaTokenizerFast /
// LlamaTokenizer (add_bos_token defaults to true, add_eos_token to false), or with either flag
// present, the post-processor becomes "[bos_token] A [eos_token]" as the flags say
// (LlamaTokenizerFast.update_post_processor); otherwise tokenizer.json's own post-processor
// stays. So DeepSeek-V3's files give [0, …] for add_special_tokens, as vLLM and sglang do.
// Invalid UTF-8 input is encoded as if each ill-formed subpart were U+FFFD.
//
// Thread-safety: a loaded Tokenizer is immutable; Encode/Decode may run concurrently.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace lockstep::engine {

class Tokenizer {
 public:
  // Parses `path` (a tokenizer.json) and, when one sits beside it, tokenizer_config.json.
  // Errors name the file and the JSON field at fault.
  static Result<std::shared_ptr<const Tokenizer>> Load(const std::filesystem::path& path);
  // Same, from the JSON text; `origin` names it in error messages. No tokenizer_config.json.
  static Result<std::shared_ptr<const Tokenizer>> FromJson(std::string_view json, std::string origin);
  // Same, with tokenizer_config.json's text (`config_origin` names it; empty text: none).
  static Result<std::shared_ptr<const Tokenizer>> FromJson(std::string_view json, std::string origin,
                                                           std::string_view config_json, std::string config_origin);

  // Text → ids. `add_special_tokens` applies the post-processor's BOS/EOS template if any
  // (the CLI's prompts and /v1/completions: true; a rendered chat template, which writes its
  // own BOS text: false, as transformers' apply_chat_template encodes).
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens = false) const;
  // ids → text (ByteLevel decoder; invalid UTF-8 byte runs decode as U+FFFD like HF).
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // The pieces the pre-tokenizer alone cuts `text` into (no added-token extraction), in the
  // form the model sees them (byte-level mapped where ByteLevel applies): HF's
  // `pre_tokenizer.pre_tokenize_str`. For showing token boundaries and for tests.
  std::vector<std::string> PreTokenize(std::string_view text) const;

  int32_t vocab_size() const;  // max id + 1, added tokens included
  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;
  bool IsSpecial(int32_t id) const;

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep::engine
