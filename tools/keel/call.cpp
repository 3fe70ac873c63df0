// `keel call [options] URL`: one HTTP request from the shell, like curl, with retries done right
// (keel::http::Client: jittered backoff, Retry-After, deadline, idempotency key, Keel-Attempt).
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "keel/backoff.hpp"
#include "keel/duration.hpp"
#include "keel/http/client.hpp"

namespace keel::cli {
namespace {

// Exit statuses of `keel call` (documented in --help and README.md).
constexpr int kExitOk = 0;
constexpr int kExitLocalError = 1;
constexpr int kExitPermanent = 3;
constexpr int kExitAttemptsExhausted = 4;
constexpr int kExitDeadline = 5;
constexpr int kExitNotSafe = 6;
constexpr int kExitBrake = 7;

constexpr const char* kCallFooter =
    R"(Durations are a number and a unit: 250ms, 1.5s, 2m, 1h (also ns, us).

Exit status:
  0  the final response was 2xx or 3xx
  1  a local error (the output file could not be written, or cancelled)
  2  invalid arguments (the message names the flag)
  3  the final response was a failure that must not be retried (for example 400, 404,
     or a 500 already retried once; the body is still printed), or a permanent network
     error such as an unknown host
  4  gave up after the last attempt on a retryable failure (5xx, 429, reset, timeout)
  5  gave up because the next attempt, or the server's Retry-After, would pass the deadline
  6  not retried because the request was not safe to repeat (an ambiguous failure of a POST
     or PATCH without an idempotency key)
  7  not retried because a brake refused: the retry budget was empty or the host's circuit
     breaker was open

Every request carries Keel-Attempt: N. POST and PATCH carry one Idempotency-Key (a random
UUID, the same on every attempt) unless --idempotency-key off.)";

struct CallArgs {
  std::string url;
  std::string method;
  std::string data;
  bool data_given = false;
  std::vector<std::string> headers;
  bool include = false;
  bool verbose = false;
  std::string output;
  int max_attempts = 3;
  std::string deadline = "30s";
  std::string per_try_timeout = "10s";
  std::string connect_timeout = "2s";
  std::string backoff_base = "100ms";
  std::string backoff_cap = "10s";
  std::string jitter = "full";
  std::string retry_after_cap = "60s";
  std::string idempotency_key = "auto";
};

int usage_error(const std::string& message) {
  std::fprintf(stderr, "keel call: %s\n", message.c_str());
  return kExitUsage;
}

// Parses a duration flag; on error prints a message naming the flag and returns nullopt.
std::optional<Duration> duration_flag(const char* flag, const std::string& text, bool positive) {
  std::string why;
  auto d = parse_duration(text, &why);
  if (!d) {
    usage_error(std::string(flag) + ": invalid duration '" + text + "': " + why);
    return std::nullopt;
  }
  if (positive && *d <= Duration::zero()) {
    usage_error(std::string(flag) + ": must be greater than zero, got '" + text + "'");
    return std::nullopt;
  }
  return d;
}

bool has_line_break(std::string_view s) {
  return s.find('\r') != std::string_view::npos || s.find('\n') != std::string_view::npos;
}

int exit_status(StopReason reason) {
  switch (reason) {
    case StopReason::kSuccess:
      return kExitOk;
    case StopReason::kPermanent:
      return kExitPermanent;
    case StopReason::kAttemptsExhausted:
      return kExitAttemptsExhausted;
    case StopReason::kDeadline:
      return kExitDeadline;
    case StopReason::kNotSafeToRetry:
      return kExitNotSafe;
    case StopReason::kBudgetExhausted:
    case StopReason::kCircuitOpen:
      return kExitBrake;
    case StopReason::kCancelled:
      return kExitLocalError;
  }
  return kExitLocalError;
}

// Writes the file through a temporary in the same directory and a rename: never a partial file.
bool write_file(const std::string& path, const std::string& content, std::string* why) {
  const std::filesystem::path target(path);
  std::string tmp =
      (target.has_parent_path() ? target.parent_path().string() + "/" : "") + ".keel-call.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) {
    *why = std::strerror(errno);
    return false;
  }
  std::size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      *why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  ::fchmod(fd, 0644);
  if (::close(fd) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    *why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

int run_call(const CallArgs& a) {
  // Validate everything before sending anything.
  if (!a.url.starts_with("http://") && !a.url.starts_with("https://")) {
    return usage_error("URL '" + a.url + "' must start with http:// or https://");
  }
  if (has_line_break(a.url) || a.url.find(' ') != std::string::npos) {
    return usage_error("URL '" + a.url + "' contains spaces or line breaks");
  }
  const auto deadline = duration_flag("--deadline", a.deadline, true);
  if (!deadline) return kExitUsage;
  const auto per_try = duration_flag("--per-try-timeout", a.per_try_timeout, true);
  if (!per_try) return kExitUsage;
  const auto connect = duration_flag("--connect-timeout", a.connect_timeout, true);
  if (!connect) return kExitUsage;
  const auto base = duration_flag("--backoff-base", a.backoff_base, true);
  if (!base) return kExitUsage;
  const auto cap = duration_flag("--backoff-cap", a.backoff_cap, true);
  if (!cap) return kExitUsage;
  if (*cap < *base) {
    return usage_error("--backoff-cap: must be at least --backoff-base (" + a.backoff_base +
                       "), got '" + a.backoff_cap + "'");
  }
  const auto retry_after_cap = duration_flag("--retry-after-cap", a.retry_after_cap, false);
  if (!retry_after_cap) return kExitUsage;
  const auto jitter = parse_jitter(a.jitter);
  if (!jitter) {
    return usage_error("--jitter: expected full, equal, decorrelated or none, got '" + a.jitter +
                       "'");
  }
  if (a.max_attempts < 1) {
    return usage_error("--max-attempts: must be at least 1, got " + std::to_string(a.max_attempts));
  }

  http::Request request;
  request.url = a.url;
  request.method = !a.method.empty() ? a.method : (a.data_given ? "POST" : "GET");
  for (char c : request.method) {
    if (c <= ' ' || c >= 127 || c == ':' || c == '/') {
      return usage_error("--request: invalid method '" + a.method + "'");
    }
  }
  for (const std::string& h : a.headers) {
    const std::size_t colon = h.find(':');
    if (colon == std::string::npos || colon == 0 || has_line_break(h) ||
        h.find_first_of(" \t") < colon) {
      return usage_error("--header: expected 'Name: value', got '" + h + "'");
    }
    std::string value = h.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.erase(0, 1);
    request.headers.emplace_back(h.substr(0, colon), value);
  }
  if (a.data_given) {
    if (a.data.starts_with("@")) {
      const std::string path = a.data.substr(1);
      std::ifstream in(path, std::ios::binary);
      if (!in) {
        return usage_error("--data: cannot read '" + path + "': " + std::strerror(errno));
      }
      std::ostringstream content;
      content << in.rdbuf();
      request.body = content.str();
    } else {
      request.body = a.data;
    }
  }
  if (a.idempotency_key == "off") {
    request.generate_idempotency_key = false;
  } else if (a.idempotency_key == "auto") {
    request.generate_idempotency_key = true;
  } else if (a.idempotency_key.empty() || has_line_break(a.idempotency_key)) {
    return usage_error("--idempotency-key: expected KEY, auto or off, got '" + a.idempotency_key +
                       "'");
  } else {
    request.idempotency_key = a.idempotency_key;
  }
  // With auto, make the key here (as the client would) so that -v can show it up front.
  if (request.idempotency_key.empty() && request.generate_idempotency_key &&
      (request.method == "POST" || request.method == "PATCH")) {
    request.idempotency_key = http::make_idempotency_key();
  }

  http::ClientOptions options;
  options.retry.max_attempts = a.max_attempts;
  options.retry.overall_timeout = *deadline;
  options.retry.per_try_timeout = *per_try;
  options.retry.backoff = {.base = *base, .cap = *cap, .jitter = *jitter};
  options.retry.retry_after_cap = *retry_after_cap;
  options.connect_timeout = *connect;
  options.log = [](std::string_view line) {
    std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
  };
  if (a.verbose) {
    options.on_attempt = [](const http::AttemptEvent& e) {
      std::string line = "keel call: attempt " + std::to_string(e.attempt) + ": " +
                         std::string(e.method) + " " + std::string(e.url) + " -> " +
                         describe(e.outcome);
      if (!e.error.empty()) line += " [" + std::string(e.error) + "]";
      line += " in " + format_duration(e.took);
      if (e.will_retry) {
        line += "; retry in " + format_duration(e.delay);
      } else {
        line += "; stop: " + std::string(to_string(e.reason));
      }
      std::fprintf(stderr, "%s\n", line.c_str());
    };
  }
  http::Client client(std::move(options));
  if (a.verbose && !request.idempotency_key.empty()) {
    std::fprintf(stderr, "keel call: Idempotency-Key: %s\n", request.idempotency_key.c_str());
  }
  const http::Result result = client.send(request);

  if (result.response) {
    std::string out;
    if (a.include) {
      out += result.response->status_line + "\r\n";
      for (const auto& [name, value] : result.response->headers) {
        out += name + ": " + value + "\r\n";
      }
      out += "\r\n";
    }
    out += result.response->body;
    if (!a.output.empty()) {
      std::string why;
      if (!write_file(a.output, out, &why)) {
        std::fprintf(stderr, "keel call: --output: cannot write '%s': %s\n", a.output.c_str(),
                     why.c_str());
        return kExitLocalError;
      }
    } else {
      std::fwrite(out.data(), 1, out.size(), stdout);
      std::fflush(stdout);
    }
  } else if (!result.error.empty()) {
    std::fprintf(stderr, "keel call: %s\n", result.error.c_str());
  }
  return exit_status(result.reason);
}

}  // namespace

Runner add_call(CLI::App& app) {
  auto a = std::make_shared<CallArgs>();
  CLI::App* sub =
      app.add_subcommand("call", "Send one HTTP request, like curl, with retries done right");
  sub->footer(kCallFooter);
  sub->add_option("URL", a->url, "http:// or https:// URL")->required();
  sub->add_option("-X,--request", a->method, "Method (default GET, or POST with --data)");
  sub->add_option("-d,--data", a->data, "Request body, or @FILE to read it from a file")
      ->each([a](const std::string&) { a->data_given = true; });
  sub->add_option("-H,--header", a->headers, "Extra header 'Name: value' (repeatable)");
  sub->add_flag("-i,--include", a->include, "Print the status line and headers before the body");
  sub->add_flag("-v,--verbose", a->verbose, "One line per attempt on stderr");
  sub->add_option("-o,--output", a->output, "Write the response to FILE instead of stdout");
  sub->add_option("--max-attempts", a->max_attempts, "Attempts in all, the first included")
      ->capture_default_str();
  sub->add_option("--deadline", a->deadline, "Deadline of the whole call")->capture_default_str();
  sub->add_option("--per-try-timeout", a->per_try_timeout, "Timeout of one attempt")
      ->capture_default_str();
  sub->add_option("--connect-timeout", a->connect_timeout, "Time allowed to connect, per attempt")
      ->capture_default_str();
  sub->add_option("--backoff-base", a->backoff_base, "Backoff ceiling before the first retry")
      ->capture_default_str();
  sub->add_option("--backoff-cap", a->backoff_cap, "Largest backoff delay")->capture_default_str();
  sub->add_option("--jitter", a->jitter, "full|equal|decorrelated|none")->capture_default_str();
  sub->add_option("--retry-after-cap", a->retry_after_cap, "Largest Retry-After delay honoured")
      ->capture_default_str();
  sub->add_option("--idempotency-key", a->idempotency_key,
                  "KEY, auto (a UUID for POST and PATCH) or off")
      ->capture_default_str();
  return [a] { return run_call(*a); };
}

}  // namespace keel::cli
