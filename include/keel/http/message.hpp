// The parts of an HTTP message that keel checks or parses itself, shared by both HTTP clients
// and anything that takes a header from outside (a flag, a file): header fields of a request
// (checked before anything is sent: no header injection, no oversized or control-laden
// Idempotency-Key), the "Name: value" form of a header argument, and a response's head as libcurl
// hands it over line by line (the status line and header fields, with a cap on their total size so
// that a hostile server cannot make the client buffer megabytes of headers).
//
// Thread-safety: pure functions; a ResponseHeadParser is not thread-safe (one per attempt).
//
// Example:
//   auto field = keel::http::parse_header_field("Content-Type: application/json");
//   // field->first == "Content-Type", field->second == "application/json"; on bad input
//   // !field and field.error().message() says why
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/expected.hpp"
#include "keel/core/idempotency_key.hpp"

namespace keel::http {

/// Header fields in the order given. Names compare case-insensitively (see find_header).
using Headers = std::vector<std::pair<std::string, std::string>>;

/// The value of the first header named `name` (case-insensitive), or nullopt.
[[nodiscard]] std::optional<std::string_view> find_header(const Headers& headers,
                                                          std::string_view name) noexcept;

/// Whether two header names are the same (ASCII case-insensitive).
[[nodiscard]] bool same_header_name(std::string_view a, std::string_view b) noexcept;

/// Longest Idempotency-Key accepted, in bytes (keel/core/idempotency_key.hpp).
using keel::kMaxIdempotencyKeyBytes;

/// The key a client sends for `key`: its canonical form under keel's one key rule
/// (keel::check_idempotency_key: 1 to 255 bytes of visible ASCII without '"', ',' or '%', bare
/// or as an RFC 8941 quoted string, sent bare); the Error (field "Idempotency-Key") says why
/// `key` is not a key.
[[nodiscard]] Expected<std::string> check_idempotency_key(std::string_view key);

/// Whether name/value can be sent as a request header field: the name a token (RFC 9110
/// section 5.6.2), the value without CR, LF, NUL or other control characters but tab; the Error
/// says why not.
[[nodiscard]] Expected<void> check_header_field(std::string_view name, std::string_view value);

/// Parses a header argument in curl's `-H` form, "Name: value" (spaces and tabs around the value
/// dropped; "Name:" is an empty value). Returns an Error when the text has no colon, an invalid
/// name or an invalid value (see check_header_field).
[[nodiscard]] Expected<std::pair<std::string, std::string>> parse_header_field(
    std::string_view text);

/// The last response received.
struct Response {
  int status = 0;
  /// The status line as received, without CRLF ("HTTP/1.1 503 Service Unavailable").
  std::string status_line;
  Headers headers;
  std::string body;
};

/// The status code of a status line ("HTTP/1.1 503 Service Unavailable" -> 503), or nullopt when
/// the line is not "HTTP/" version SP 3DIGIT [SP reason].
[[nodiscard]] std::optional<int> parse_status_line(std::string_view line) noexcept;

/// Default cap on a response's head (status line and header fields), in bytes.
inline constexpr std::size_t kDefaultMaxHeaderBytes = 64 * 1024;

/// Collects the head of a response from the lines libcurl passes to its header callback (each
/// with its CRLF). A new status line (after a 1xx) starts the head over. Lines that are neither a
/// status line nor "name: value" (the blank line that ends the head, say) are skipped.
class ResponseHeadParser {
 public:
  /// Requires: max_bytes >= 1.
  explicit ResponseHeadParser(std::size_t max_bytes = kDefaultMaxHeaderBytes) noexcept
      : max_bytes_(max_bytes) {}

  /// Adds one line to `out` (status, status_line, headers). Returns false, and leaves `out` as it
  /// was, once the head would pass max_bytes (error() then says so): the transfer must be ended.
  [[nodiscard]] bool feed(std::string_view line, Response& out);

  /// Why feed() returned false; empty before.
  [[nodiscard]] const std::string& error() const noexcept { return error_; }
  /// Bytes of the current head so far.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  std::size_t max_bytes_;
  std::size_t bytes_ = 0;
  std::string error_;
};

}  // namespace keel::http
