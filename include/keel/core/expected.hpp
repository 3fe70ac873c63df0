// keel's one error style for parsing and validation: a function that reads outside input (a
// flag, a URL, a header, a duration, a payload) returns `keel::Expected<T>`, the value or a
// `keel::Error` that names the field, says what is wrong and quotes the value. Nothing is thrown
// for bad input. Invalid configuration handed to a constructor is a programming error and throws
// std::invalid_argument whose what() is an Error's message() (see ARCHITECTURE.md, "Errors").
//
// One message format everywhere: "[CONTEXT: ]FIELD PROBLEM (got VALUE)", for instance
//   duration has no unit; use ns, us, ms, s, m or h (got '5')
//   my-tool: --deadline has no unit; use ns, us, ms, s, m or h (got '5')
//   keel::RetryPolicy: max_attempts must be >= 1 (got 0)
// A caller that knows where the value came from renames the field (`error.in("--deadline")`)
// instead of wrapping the text. A constructor or function refusing its configuration calls
// keel::throw_invalid with an Error whose context is the fully qualified type or function
// ("keel::store::QueueOptions", "keel::store::JobQueue::lease"), so every such what() has the
// same form.
//
// Thread-safety: value types; distinct objects may be used concurrently.
//
// Example:
//   keel::Expected<keel::Duration> d = keel::parse_duration(flag);
//   if (!d) { std::cerr << d.error().in("--deadline").message() << "\n"; return 2; }
//   use(*d);
//
//   if (options.max_attempts < 1) {
//     keel::throw_invalid({.context = "keel::store::QueueOptions", .field = "max_attempts",
//                          .problem = "must be >= 1", .got =
//                          std::to_string(options.max_attempts)});
//   }
#pragma once

#include <cassert>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace keel {

/// What is wrong with one input value.
struct Error {
  /// Where the value came from, when the producer knows ("my-tool", "keel::RetryPolicy");
  /// empty otherwise.
  std::string context;
  /// The value's name: a field, a flag, a header ("duration", "--deadline", "Idempotency-Key").
  std::string field;
  /// What is wrong, as a verb phrase that follows the field ("must be at least 1", "has no
  /// unit; use ns, us, ms, s, m or h").
  std::string problem;
  /// The offending value as shown to a reader (quoted when it is text, truncated when long);
  /// empty when there is nothing useful to show.
  std::string got;

  /// "[CONTEXT: ]FIELD PROBLEM (got VALUE)".
  [[nodiscard]] std::string message() const;
  /// The same error under another name: `field` replaced, and `context` when given.
  [[nodiscard]] Error in(std::string_view new_field, std::string_view new_context = {}) const;
};

/// Throws std::invalid_argument whose what() is error.message(): how invalid configuration
/// handed to a constructor or function is refused.
[[noreturn]] void throw_invalid(Error error);

/// `text` in single quotes with control characters shown as \xNN, cut after about `max_bytes`
/// bytes of that form (with "..." when cut), so that any input can be quoted in a message.
[[nodiscard]] std::string quote_value(std::string_view text, std::size_t max_bytes = 64);

/// One byte named for a message: "byte 0x0a".
[[nodiscard]] std::string byte_text(unsigned char byte);

/// A value of type T, or the Error that says why there is none. T may be void (a check).
template <class T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : v_(std::in_place_index<0>, std::move(value)) {}      // NOLINT: implicit
  Expected(Error error) : v_(std::in_place_index<1>, std::move(error)) {}  // NOLINT: implicit

  [[nodiscard]] bool has_value() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return has_value(); }

  /// The value; throws std::logic_error (with the Error's message) when there is none: asking
  /// for a value that is not there is a programming error.
  [[nodiscard]] T& value() & { return checked(), *std::get_if<0>(&v_); }
  [[nodiscard]] const T& value() const& { return checked(), *std::get_if<0>(&v_); }
  [[nodiscard]] T&& value() && { return checked(), std::move(*std::get_if<0>(&v_)); }
  /// Requires: has_value().
  [[nodiscard]] T& operator*() & { return assert(has_value()), *std::get_if<0>(&v_); }
  [[nodiscard]] const T& operator*() const& { return assert(has_value()), *std::get_if<0>(&v_); }
  [[nodiscard]] T&& operator*() && { return assert(has_value()), std::move(*std::get_if<0>(&v_)); }
  [[nodiscard]] T* operator->() { return &**this; }
  [[nodiscard]] const T* operator->() const { return &**this; }
  /// The value, or `fallback` when there is none.
  [[nodiscard]] T value_or(T fallback) const& { return has_value() ? value() : fallback; }

  /// Requires: !has_value().
  [[nodiscard]] const Error& error() const& { return assert(!has_value()), *std::get_if<1>(&v_); }
  [[nodiscard]] Error&& error() && { return assert(!has_value()), std::move(*std::get_if<1>(&v_)); }

  /// The value as an optional (empty on error), for callers that only ask "is it valid".
  [[nodiscard]] std::optional<T> to_optional() const& {
    return has_value() ? std::optional<T>(value()) : std::nullopt;
  }

  friend bool operator==(const Expected& a, const T& b) { return a.has_value() && a.value() == b; }

 private:
  void checked() const {
    if (!has_value()) throw std::logic_error("keel::Expected::value(): " + error().message());
  }

  std::variant<T, Error> v_;
};

/// A check's result: nothing, or the Error.
template <>
class [[nodiscard]] Expected<void> {
 public:
  Expected() = default;
  Expected(Error error) : error_(std::move(error)) {}  // NOLINT: implicit

  [[nodiscard]] bool has_value() const noexcept { return !error_.has_value(); }
  explicit operator bool() const noexcept { return has_value(); }
  /// Requires: !has_value().
  [[nodiscard]] const Error& error() const& { return assert(!has_value()), *error_; }
  [[nodiscard]] Error&& error() && { return assert(!has_value()), std::move(*error_); }

 private:
  std::optional<Error> error_;
};

}  // namespace keel
