// Opening a PostgreSQL connection (detail/postgres_connect.hpp): keel's connection options ahead
// of the URI's, the hosts of a multi-host URL ordered with the ones that gave no answer lately
// last, and the URIs on which a transaction pooler was noticed.
#include "db/detail/postgres_connect.hpp"

#include <libpq-fe.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace keel::store::detail {
namespace {

void ignore_notice(void* /*arg*/, const char* /*message*/) {}

// The options of a libpq URI ("" when none), so that keel's own can be added to them.
std::string uri_option(const std::string& uri, const char* keyword) {
  char* message = nullptr;
  PQconninfoOption* options = PQconninfoParse(uri.c_str(), &message);
  PQfreemem(message);
  std::string out;
  if (options == nullptr) return out;
  for (PQconninfoOption* o = options; o->keyword != nullptr; ++o) {
    if (std::strcmp(o->keyword, keyword) == 0 && o->val != nullptr) out = o->val;
  }
  PQconninfoFree(options);
  return out;
}

// The URIs on which a transaction pooler was noticed (prepared statements that did not survive
// between transactions): later connections to them start with unnamed statements.
std::mutex pooler_mu;
std::set<std::string>& pooler_uris() {
  static std::set<std::string> uris;  // guarded by pooler_mu
  return uris;
}

// Hosts that gave no answer within a statement's bound (a frozen server, a partition that drops
// packets): for a while, new connections try the URL's other hosts first, and pooled connections
// to them are not lent (every one of them would wait the same bound). Keyed by "host:port".
constexpr std::chrono::seconds kSuspectFor(30);
std::mutex suspects_mu;
std::map<std::string, std::chrono::steady_clock::time_point>& suspects() {
  static std::map<std::string, std::chrono::steady_clock::time_point> hosts;  // guarded
  return hosts;
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::size_t at = 0;
  for (;;) {
    const std::size_t comma = text.find(',', at);
    out.push_back(text.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

std::string join_commas(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : ",") + p;
  return out;
}

// A multi-host URI's hosts with the suspect ones last (libpq tries them in order): "host",
// "hostaddr" and "port" values to pass after the URI, or nullopt when the order stays.
struct HostOrder {
  std::string host, hostaddr, port;
};
std::optional<HostOrder> hosts_in_order(const std::string& uri) {
  const std::vector<std::string> hosts = split_commas(uri_option(uri, "host"));
  if (hosts.size() < 2) return std::nullopt;
  const std::string addr_text = uri_option(uri, "hostaddr");
  std::vector<std::string> addrs =
      addr_text.empty() ? std::vector<std::string>() : split_commas(addr_text);
  std::vector<std::string> ports = split_commas(uri_option(uri, "port"));
  if (ports.size() == 1) ports.assign(hosts.size(), ports[0]);
  if (ports.size() != hosts.size() || (!addrs.empty() && addrs.size() != hosts.size())) {
    return std::nullopt;  // libpq will say what is wrong
  }
  std::vector<std::size_t> order;
  std::vector<std::size_t> later;
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    const std::string port = ports[i].empty() ? "5432" : ports[i];
    (suspect_since((addrs.empty() ? hosts[i] : addrs[i]) + ":" + port) ? later : order)
        .push_back(i);
  }
  if (later.empty()) return std::nullopt;
  order.insert(order.end(), later.begin(), later.end());
  HostOrder out;
  std::vector<std::string> h, a, p;
  for (const std::size_t i : order) {
    h.push_back(hosts[i]);
    p.push_back(ports[i]);
    if (!addrs.empty()) a.push_back(addrs[i]);
  }
  out.host = join_commas(h);
  out.port = join_commas(p);
  out.hostaddr = join_commas(a);
  return out;
}

}  // namespace

bool pooler_noticed(const std::string& uri) {
  std::lock_guard lock(pooler_mu);
  return pooler_uris().count(uri) != 0;
}

// Records the pooler; true the first time for this URI (the caller says so, once).
bool notice_pooler(const std::string& uri) {
  std::lock_guard lock(pooler_mu);
  return pooler_uris().insert(uri).second;
}

// Since when `host_port` is suspect; nullopt when it is not (any more).
std::optional<std::chrono::steady_clock::time_point> suspect_since(const std::string& host_port) {
  std::lock_guard lock(suspects_mu);
  auto& hosts = suspects();
  const auto it = hosts.find(host_port);
  if (it == hosts.end()) return std::nullopt;
  if (std::chrono::steady_clock::now() - it->second >= kSuspectFor) {
    hosts.erase(it);
    return std::nullopt;
  }
  return it->second;
}

void suspect(const std::string& host_port) {
  std::lock_guard lock(suspects_mu);
  suspects()[host_port] = std::chrono::steady_clock::now();
}

std::string host_port_of(const PGconn* conn) {
  const char* addr = PQhostaddr(conn);
  const char* host = PQhost(conn);
  const char* port = PQport(conn);
  return std::string(addr != nullptr && *addr != '\0' ? addr : (host != nullptr ? host : "")) +
         ":" + (port != nullptr && *port != '\0' ? port : "5432");
}

std::string trim_pg_message(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

pg_conn* connect_postgres(const std::string& uri, const ConnectOptions& options,
                          std::string_view what, std::string_view session_options) {
  const std::string timeout = std::to_string(options.connect_timeout.count());
  // Later entries win: the URI (expanded from dbname) overrides keel's defaults before it, and
  // the session options after it hold the URI's own options after keel's (the later -c wins).
  std::vector<const char*> keys = {"connect_timeout", "keepalives", "keepalives_idle",
                                   "keepalives_interval", "keepalives_count"};
  std::vector<const char*> values = {timeout.c_str(), "1", "10", "5", "3"};
  if (!options.read_only) {
    // Only a node that takes writes: the next host of a multi-host URL, never a standby or a
    // primary turned read-only.
    keys.push_back("target_session_attrs");
    values.push_back("read-write");
  }
  keys.push_back("dbname");
  values.push_back(uri.c_str());
  // A host that gave no answer lately is tried last.
  const std::optional<HostOrder> order = hosts_in_order(uri);
  if (order) {
    keys.push_back("host");
    values.push_back(order->host.c_str());
    keys.push_back("port");
    values.push_back(order->port.c_str());
    if (!order->hostaddr.empty()) {
      keys.push_back("hostaddr");
      values.push_back(order->hostaddr.c_str());
    }
  }
  std::string combined;
  if (!session_options.empty()) {
    combined = std::string(session_options);
    if (const std::string own = uri_option(uri, "options"); !own.empty()) combined += " " + own;
    keys.push_back("options");
    values.push_back(combined.c_str());
  }
  keys.push_back(nullptr);
  values.push_back(nullptr);
  PGconn* conn = PQconnectdbParams(keys.data(), values.data(), /*expand_dbname=*/1);
  if (conn == nullptr || PQstatus(conn) != CONNECTION_OK) {
    const std::string reason =
        conn != nullptr ? trim_pg_message(PQerrorMessage(conn)) : "out of memory";
    PQfinish(conn);
    throw DatabaseError(
        "PostgreSQL: cannot connect" + std::string(what) + ": " + reason,
        {.backend = Backend::kPostgres, .sqlstate = "08001", .connection_lost = true});
  }
  PQsetNoticeProcessor(conn, ignore_notice, nullptr);
  return conn;
}

}  // namespace keel::store::detail
