// Fuzzes the HTTP clients' response-head handling: the input is split into lines as libcurl
// hands them to the header callback and fed to keel::http::ResponseHeadParser (with a small
// cap, so the limit is exercised), then the status line and Retry-After are read as the clients
// read them. No crash, no UB; the head never passes the cap; a parsed status is 100..999; a
// Retry-After delay is never negative.
#include <cstdint>
#include <cstdlib>
#include <keel/core/retry_after.hpp>
#include <keel/http/message.hpp>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  constexpr std::size_t kCap = 512;
  keel::http::ResponseHeadParser parser(kCap);
  keel::http::Response response;
  while (!text.empty()) {
    const std::size_t end = text.find('\n');
    const std::string_view line = text.substr(0, end == std::string_view::npos ? end : end + 1);
    text.remove_prefix(line.size());
    if (!parser.feed(line, response)) {
      if (parser.error().empty()) std::abort();
      break;
    }
    if (parser.bytes() > kCap) std::abort();
  }
  if (auto status = keel::http::parse_status_line(response.status_line)) {
    if (*status < 100 || *status > 999) std::abort();
    if (*status != response.status) std::abort();
  }
  const keel::WallTime now{std::chrono::seconds(1795910400)};
  if (auto value = keel::http::find_header(response.headers, "Retry-After")) {
    if (auto d = keel::parse_retry_after(*value, now)) {
      if (*d < keel::Duration::zero()) std::abort();
    }
  }
  return 0;
}
