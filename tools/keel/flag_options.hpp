// CLI11 options whose values keel's own parsers read (flags.hpp, rate_flag.hpp,
// keel::parse_duration): each value is checked and converted while the command line is parsed,
// so that a command's body gets typed values; a refused value stops the parse with the parser's
// message, which names the flag and the value, after the command's name ("keel call: --deadline
// has no unit; use ns, us, ms, s, m or h (got '5')").
//
// Thread-safety: registration and parsing happen on one thread, before the command runs.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "flags.hpp"
#include "keel/core/duration.hpp"
#include "keel/core/expected.hpp"

namespace keel::cli {

/// A flag value refused while the command line is parsed. what() is the whole message
/// ("COMMAND: FLAG PROBLEM (got VALUE)"); run_program prints it alone and returns kExitUsage.
class FlagError : public CLI::ParseError {
 public:
  explicit FlagError(std::string message)
      : CLI::ParseError("FlagError", std::move(message), kExitUsage) {}
};

/// Reads one flag's text: the value, or an Error naming the flag and the value.
template <class T>
using FlagParser = std::function<Expected<T>(std::string_view)>;

/// A CLI11 check by `parse`: a value it refuses throws FlagError "COMMAND: MESSAGE", `command`
/// being the program and command the message starts with ("keel call", "keel-demo serve").
template <class T>
CLI::Validator checked_by(std::string command, FlagParser<T> parse) {
  return CLI::Validator(
      [command = std::move(command), parse = std::move(parse)](std::string& text) -> std::string {
        if (auto value = parse(text); !value) {
          throw FlagError(command + ": " + value.error().message());
        }
        return {};
      },
      "", "");
}

/// Adds the option `names` to `sub`: its value is checked by `parse` (checked_by) and stored in
/// `target`, a T or a std::optional<T> (left empty when the flag is not given). A default given
/// with ->default_val("TEXT") is read by `parse` too, into `target`, and shown in --help.
template <class Target, class T>
CLI::Option* add_checked(CLI::App* sub, const std::string& command, const std::string& names,
                         Target& target, FlagParser<T> parse, const std::string& help) {
  CLI::Option* option = sub->add_option_function<std::string>(
      names, [&target, parse](const std::string& text) { target = *parse(text); }, help);
  return option->check(checked_by(command, std::move(parse)))->run_callback_for_default();
}

/// The option's value as typed (the last one given), or its default.
inline std::string given_text(const CLI::Option* option) {
  return option->count() > 0 ? option->results().back() : option->get_default_str();
}

/// A duration flag within `range` (parse_duration_flag).
template <class Target>
CLI::Option* add_duration(CLI::App* sub, const std::string& command, const std::string& flag,
                          Target& target, const DurationRange& range, const std::string& help) {
  return add_checked(sub, command, flag, target,
                     FlagParser<Duration>([flag, range](std::string_view text) {
                       return parse_duration_flag(flag, text, range);
                     }),
                     help);
}

/// A duration flag; with `positive`, zero is refused too (parse_duration_flag).
template <class Target>
CLI::Option* add_duration(CLI::App* sub, const std::string& command, const std::string& flag,
                          Target& target, bool positive, const std::string& help) {
  return add_checked(sub, command, flag, target,
                     FlagParser<Duration>([flag, positive](std::string_view text) {
                       return parse_duration_flag(flag, text, positive);
                     }),
                     help);
}

/// The value type a flag's target holds: T for T and for std::optional<T>.
template <class Target>
struct FlagValue {
  using type = Target;
};
template <class T>
struct FlagValue<std::optional<T>> {
  using type = T;
};

/// A whole-number flag within [min, max] (parse_count), stored as the target's number type.
template <class Target>
CLI::Option* add_count(CLI::App* sub, const std::string& command, const std::string& flag,
                       Target& target, std::uint64_t min, std::uint64_t max,
                       const std::string& help) {
  using Value = typename FlagValue<Target>::type;
  return add_checked(sub, command, flag, target,
                     FlagParser<Value>([flag, min, max](std::string_view text) -> Expected<Value> {
                       auto n = parse_count(flag, text, min, max);
                       if (!n) return n.error();
                       return static_cast<Value>(*n);
                     }),
                     help);
}

/// A plain decimal flag within [min, max] (parse_fraction).
template <class Target>
CLI::Option* add_fraction(CLI::App* sub, const std::string& command, const std::string& flag,
                          Target& target, double min, double max, const std::string& help) {
  return add_checked(sub, command, flag, target,
                     FlagParser<double>([flag, min, max](std::string_view text) {
                       return parse_fraction(flag, text, min, max);
                     }),
                     help);
}

}  // namespace keel::cli
