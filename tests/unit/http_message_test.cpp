// keel::http's parsers and checks without a network: parse_url (and breaker_key on it),
// parse_header_field, check_idempotency_key, parse_status_line and ResponseHeadParser's cap.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keel/core/classify.hpp"
#include "keel/http/client.hpp"
#include "keel/http/detail/attempt.hpp"
#include "keel/http/message.hpp"
#include "keel/http/url.hpp"

namespace {

using keel::http::parse_url;

TEST(ParseUrl, AcceptsHttpAndHttpsInAnyCaseWithTheirDefaultPorts) {
  struct Case {
    const char* text;
    const char* scheme;
    const char* host;
    int port;
  };
  for (const Case& c : {Case{"http://example.com", "http", "example.com", 80},
                        Case{"HTTPS://Example.COM/x?y#z", "https", "example.com", 443},
                        Case{"hTtP://u:p@127.0.0.1:8080/", "http", "127.0.0.1", 8080},
                        Case{"http://[::1]:65535/", "http", "[::1]", 65535},
                        Case{"https://[2001:db8::1]", "https", "[2001:db8::1]", 443},
                        Case{"http://h:00080", "http", "h", 80}}) {
    const auto u = parse_url(c.text);
    ASSERT_TRUE(u.has_value()) << c.text << ": " << u.error().message();
    EXPECT_EQ(u->scheme, c.scheme) << c.text;
    EXPECT_EQ(u->host, c.host) << c.text;
    EXPECT_EQ(u->port, c.port) << c.text;
  }
  EXPECT_EQ(keel::http::breaker_key("HTTP://Example.com/x"), "example.com:80");
}

TEST(ParseUrl, RefusesMalformedUrlsSayingWhy) {
  for (const std::string& text : std::vector<std::string>{"",
                                                          "http://",
                                                          "http://:80/",
                                                          "http:///x",
                                                          "http://h:0/",
                                                          "http://h:65536/",
                                                          "http://h:99999/",
                                                          "http://h:-1/",
                                                          "http://h:8o/",
                                                          "http://h:/",
                                                          "http://[::1",
                                                          "http://[::1]x/",
                                                          "http://[]/",
                                                          "http://[zz]/",
                                                          "http://a b/",
                                                          "http://h/\tx",
                                                          "http://h/\x7f",
                                                          "http://h/\r\n",
                                                          "ftp://h/",
                                                          "h:80",
                                                          "//h/",
                                                          "http:/h/",
                                                          "http://bad_host!@/",
                                                          "http://h^/",
                                                          std::string("http://h/\0", 10),
                                                          "http://" + std::string(300, 'a') + "/",
                                                          "http://h/" + std::string(9000, 'p')}) {
    const auto u = parse_url(text);
    ASSERT_FALSE(u) << text;
    EXPECT_EQ(u.error().field, "URL") << text;
    EXPECT_FALSE(u.error().problem.empty()) << text;
    EXPECT_FALSE(keel::http::breaker_key(text)) << text;
  }
}

// A URL parse_url accepts is one libcurl can send: an internationalised host is converted to its
// ASCII form here (libcurl's own conversion needs a UTF-8 locale, which a program that never
// called setlocale does not have), and bytes that are not UTF-8 are refused.
TEST(ParseUrl, ConvertsAnInternationalisedHostToItsAsciiForm) {
  struct Case {
    std::string text;
    const char* host;
    int port;
    const char* converted;
  };
  for (const Case& c :
       {Case{"http://b\xC3\xBC"
             "cher.test/",
             "xn--bcher-kva.test", 80, "http://xn--bcher-kva.test/"},
        Case{"HTTPS://B\xC3\x9C"
             "CHER.Example:8443/p?q=\xC3\xBC#f",
             "xn--bcher-kva.example", 8443, "HTTPS://xn--bcher-kva.example:8443/p?q=\xC3\xBC#f"},
        Case{"http://u:p@\xE4\xBE\x8B\xE3\x81\x88.jp/", "xn--r8jz45g.jp", 80,
             "http://u:p@xn--r8jz45g.jp/"},
        Case{"http://b\xC3\xBC"
             "cher.localhost:9/hook",
             "xn--bcher-kva.localhost", 9, "http://xn--bcher-kva.localhost:9/hook"}}) {
    const auto u = parse_url(c.text);
    ASSERT_TRUE(u.has_value()) << c.text << ": " << u.error().message();
    EXPECT_EQ(u->host, c.host) << c.text;
    EXPECT_EQ(u->port, c.port) << c.text;
    EXPECT_EQ(u->converted, c.converted) << c.text;
    // The converted URL is its own ASCII form, and has the same breaker key.
    const auto again = parse_url(u->converted);
    ASSERT_TRUE(again.has_value());
    EXPECT_EQ(again->host, u->host);
    EXPECT_TRUE(again->converted.empty());
  }
  EXPECT_EQ(keel::http::breaker_key("http://b\xC3\xBC"
                                    "cher.test/"),
            keel::http::breaker_key("http://xn--bcher-kva.test/"));
  // A URL with an ASCII host is sent as given, UTF-8 in its path included.
  const auto plain = parse_url(
      "http://example.com/b\xC3\xBC"
      "cher");
  ASSERT_TRUE(plain.has_value());
  EXPECT_TRUE(plain->converted.empty());
}

TEST(ParseUrl, RefusesWhatLibcurlCannotSendNamingIt) {
  struct Case {
    std::string text;
    const char* says;
  };
  for (const Case& c : {
           Case{"http://b\xFC"
                "cher.test/",
                "byte 0xfc at byte 8 that is not UTF-8 (percent-encode "
                "it: %FC)"},
           Case{"http://example.com/\xFF", "byte 0xff at byte 19 that is not UTF-8"},
           Case{"http://example.com/x?q=\xC3", "byte 0xc3 at byte 23 that is not UTF-8"},
           Case{"http://example.com/\xED\xA0\x80", "that is not UTF-8"},  // a surrogate
           Case{"http://example.com/\xC0\xAF", "that is not UTF-8"},      // an overlong '/'
           Case{"http://\xCC\x81"
                "a.test/",  // a label that starts with a combining mark
                "that is not a valid internationalised domain name"},
           Case{"http://a\xE2\x80\xA8"
                "b.test/",  // a line separator
                "that is not a valid internationalised domain name"},
           Case{"http://a\xC2\xA0"
                "b.test/",
                "that is not a valid internationalised domain name"},
           Case{"http://\xC2\xAD:9",  // a soft hyphen alone, which UTS #46 maps to nothing
                "which is not a host name"},
           Case{"http://b\xC3\xBC cher.test/", "has a space at byte 10"},
           Case{"http://b\xC3\xBC\x01.test/", "has a control character at byte 10"},
           Case{"http://a!b.test/", "has a host 'a!b.test' that contains '!'"},
           Case{"http://a,b.test/", "that contains ','"},
           Case{"http://a(b).test/", "that contains '('"},
           Case{"http://b\xC3\xBC"
                "cher.test:65536/",
                "out of range"},
           Case{"http://" + std::string(61, 'a') + "." + std::string(61, 'b') + "." +
                    std::string(61, 'c') + "." + std::string(61, 'd') + ".\xC3\xBC/",
                "longer than"},
       }) {
    const auto u = parse_url(c.text);
    ASSERT_FALSE(u) << c.text;
    EXPECT_EQ(u.error().field, "URL");
    EXPECT_NE(u.error().problem.find(c.says), std::string::npos)
        << c.text << ": " << u.error().message();
  }
}

// What libcurl says of a URL it cannot send is permanent: a retry meets the same refusal, and it
// says nothing of the host's health, so no breaker counts it.
TEST(NetErrorOf, ALibcurlRefusalOfTheUrlIsPermanentAndNoDependencyFailure) {
  for (const CURLcode rc : {CURLE_URL_MALFORMAT, CURLE_UNSUPPORTED_PROTOCOL, CURLE_NOT_BUILT_IN}) {
    const keel::NetError e = keel::http::detail::net_error_of(rc, 0);
    EXPECT_EQ(e, keel::NetError::kUnusableUrl) << rc;
    const keel::Outcome o = keel::classify_network(e, /*request_sent=*/false);
    EXPECT_EQ(o.kind, keel::OutcomeKind::kPermanent) << rc;
    EXPECT_FALSE(keel::is_dependency_failure(o.kind)) << rc;
    EXPECT_EQ(keel::describe(o), "network: unusable URL (permanent)");
  }
  EXPECT_EQ(keel::http::detail::net_error_of(CURLE_COULDNT_RESOLVE_HOST, 0),
            keel::NetError::kDnsNotFound);
  EXPECT_EQ(keel::http::detail::net_error_of(CURLE_COULDNT_CONNECT, 0),
            keel::NetError::kConnectionRefused);
}

TEST(HeaderField, ParsesCurlsFormAndRefusesInjection) {
  auto f = keel::http::parse_header_field("Content-Type:  application/json \t");
  ASSERT_TRUE(f) << f.error().message();
  EXPECT_EQ(f->first, "Content-Type");
  EXPECT_EQ(f->second, "application/json");
  f = keel::http::parse_header_field("X-Empty:");
  ASSERT_TRUE(f) << f.error().message();
  EXPECT_EQ(f->second, "");
  for (const std::string& bad : std::vector<std::string>{
           "no-colon", ": v", "Bad Name: v", "X(: v", "X-A: v\r\nX-B: w", "X-A: v\nw",
           std::string("X-A: v\0w", 8), "X-A: \x01", "X\x80: v"}) {
    const auto field = keel::http::parse_header_field(bad);
    ASSERT_FALSE(field) << bad;
    EXPECT_NE(field.error().message().find("header"), std::string::npos) << bad;
  }
}

TEST(IdempotencyKey, AtMost255VisibleBytesSentInCanonicalForm) {
  EXPECT_EQ(keel::http::check_idempotency_key("charge-1"), "charge-1");
  EXPECT_TRUE(keel::http::check_idempotency_key(std::string(255, 'k')));
  EXPECT_EQ(keel::http::check_idempotency_key("\"charge-1\""), "charge-1");
  for (const std::string& bad :
       {std::string(), std::string(256, 'k'), std::string("a\nb"), std::string("a\tb"),
        std::string("\x7f"), std::string(" k"), std::string("k "), std::string("caf\xc3\xa9"),
        std::string("a key with spaces"), std::string("\"open"), std::string("a,b")}) {
    const auto checked = keel::http::check_idempotency_key(bad);
    ASSERT_FALSE(checked) << bad;
    EXPECT_EQ(checked.error().field, "Idempotency-Key") << bad;
  }
}

TEST(StatusLine, CodeOrNothing) {
  EXPECT_EQ(keel::http::parse_status_line("HTTP/1.1 503 Service Unavailable\r\n"), 503);
  EXPECT_EQ(keel::http::parse_status_line("HTTP/2 200"), 200);
  for (const char* bad : {"HTTP/1.1 5031 x", "HTTP/1.1 50", "HTTP/ 200", "HTTP/1.1 099 x",
                          "HTTX/1.1 200", "HTTP/1.1 2x0", ""}) {
    EXPECT_FALSE(keel::http::parse_status_line(bad)) << bad;
  }
}

TEST(ResponseHead, CollectsTheFinalHeadAndStopsAtTheCap) {
  keel::http::ResponseHeadParser parser(100);
  keel::http::Response r;
  ASSERT_TRUE(parser.feed("HTTP/1.1 100 Continue\r\n", r));
  ASSERT_TRUE(parser.feed("\r\n", r));
  ASSERT_TRUE(parser.feed("HTTP/1.1 503 Busy\r\n", r));  // starts over
  ASSERT_TRUE(parser.feed("Retry-After: 5\r\n", r));
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.status_line, "HTTP/1.1 503 Busy");
  EXPECT_EQ(keel::http::find_header(r.headers, "retry-after"), "5");
  EXPECT_FALSE(parser.feed("X-Big: " + std::string(100, 'x') + "\r\n", r));
  EXPECT_NE(parser.error().find("max_header_bytes"), std::string::npos) << parser.error();
  EXPECT_EQ(r.headers.size(), 1u) << "the refused line is not kept";
  EXPECT_FALSE(parser.feed("X: y\r\n", r)) << "once over, always over";
  // Many small lines add up.
  keel::http::ResponseHeadParser many(1000);
  keel::http::Response m;
  ASSERT_TRUE(many.feed("HTTP/1.1 200 OK\r\n", m));
  int accepted = 0;
  while (many.feed("X-Field: 0123456789\r\n", m)) ++accepted;
  EXPECT_LE(many.bytes(), 1000u);
  EXPECT_EQ(accepted, (1000 - 17) / 21);
}

}  // namespace

TEST(ErrorMessages, NeverQuoteCredentials) {
  // A URL's userinfo is replaced before the URL is quoted.
  const auto url = parse_url("https://user:s3cret@example.com:99999/x");
  ASSERT_FALSE(url);
  EXPECT_EQ(url.error().message().find("s3cret"), std::string::npos) << url.error().message();
  EXPECT_NE(url.error().message().find("https://***@example.com:99999/x"), std::string::npos)
      << url.error().message();
  // A header's value is never quoted: it may be a token.
  const auto field = keel::http::check_header_field("Authorization", "Bearer tok-secret\r\nX: y");
  ASSERT_FALSE(field);
  EXPECT_EQ(field.error().message().find("tok-secret"), std::string::npos)
      << field.error().message();
  EXPECT_NE(field.error().message().find("Authorization"), std::string::npos);
  keel::http::Request request{.method = "GET", .url = "http://h/"};
  request.headers = {{"Cookie", std::string("session=abc123\x01")}};
  const auto checked = keel::http::check_request(request);
  ASSERT_FALSE(checked);
  EXPECT_EQ(checked.error().message().find("abc123"), std::string::npos);
}
