// `keel sim serve`: the storm explorer. Serves web/ (the page, and uPlot from web/node_modules,
// installed by scripts/web_setup.sh: nothing from a CDN) and one JSON endpoint backed by the C++
// engine:
//   GET /api/sim?fleet=1000&capacity=5000&outage_s=5&attempts=5&base_ms=1000&jitter=1&budget=0
//               &breaker=0[&seed=1]
//   GET /api/sim?fleet_breakers=per-pod|shared&outage_s=20[&seed=1]   (the fleet-outage scenario)
// answers the run's summary and time series, or 400 {"error": "..."} naming the bad parameter.
#include <httplib.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "commands.hpp"
#include "flag_options.hpp"
#include "keel/sim/scenarios.hpp"
#include "stop_signals.hpp"

namespace keel::cli {

namespace {

// Where the page is: $KEEL_WEB_DIR, else PREFIX/share/keel/web beside this binary (PREFIX/bin),
// which is where it is installed and where the build tree links it.
std::string default_web_dir() {
  if (const char* env = std::getenv("KEEL_WEB_DIR"); env != nullptr && *env != '\0') return env;
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    const std::filesystem::path bin =
        std::filesystem::path(std::string(exe, static_cast<std::size_t>(n))).parent_path();
    return (bin.parent_path() / "share" / "keel" / "web").string();
  }
  return "web";
}

struct ServeOptions {
  HostPort listen;
  CLI::Option* listen_option = nullptr;  // its text, for the message when it cannot be bound
  std::string web = default_web_dir();
};

Expected<HostPort> parse_listen_flag(std::string_view text) {
  auto listen = parse_host_port(text);
  if (!listen) {
    return Error{.field = "--listen:",
                 .problem = quote_value(text) + " is not HOST:PORT (port 0-65535)"};
  }
  return *listen;
}

std::string json_error(const std::string& message) {
  std::string out = "{\"error\":\"";
  for (char c : message) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out + "\"}";
}

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void serve_file(httplib::Server& server, const std::string& route, const std::string& path,
                const char* type) {
  server.Get(route, [path, type](const httplib::Request&, httplib::Response& res) {
    const auto body = read_file(path);
    if (!body) {
      res.status = 404;
      res.set_content("not found: " + path + " (run scripts/web_setup.sh)", "text/plain");
      return;
    }
    res.set_content(*body, type);
  });
}

// The page's files and the JSON API.
void add_routes(httplib::Server& server, const std::string& web) {
  serve_file(server, "/", web + "/index.html", "text/html; charset=utf-8");
  serve_file(server, "/app.js", web + "/app.js", "text/javascript; charset=utf-8");
  serve_file(server, "/style.css", web + "/style.css", "text/css; charset=utf-8");
  serve_file(server, "/vendor/uPlot.iife.min.js",
             web + "/node_modules/uplot/dist/uPlot.iife.min.js", "text/javascript; charset=utf-8");
  serve_file(server, "/vendor/uPlot.min.css", web + "/node_modules/uplot/dist/uPlot.min.css",
             "text/css; charset=utf-8");
  server.Get("/api/sim", [](const httplib::Request& req, httplib::Response& res) {
    try {
      const Expected<sim::ExplorerQuery> q =
          sim::parse_explorer_query([&](std::string_view name) -> std::optional<std::string> {
            const std::string key(name);
            if (!req.has_param(key.c_str())) return std::nullopt;
            return req.get_param_value(key.c_str());
          });
      if (!q) {
        res.status = 400;
        res.set_content(json_error(q.error().message()), "application/json");
        return;
      }
      res.set_content(sim::to_json_with_series(sim::run_explorer_query(*q)), "application/json");
    } catch (const std::exception& e) {  // the engine's std::invalid_argument
      res.status = 400;
      res.set_content(json_error(e.what()), "application/json");
    }
  });
}

// Runs the server until a stop signal (stop_signals.hpp: SIGINT, SIGTERM, SIGHUP) or until it
// fails; returns the exit status. The signals are blocked before the server's threads start, so
// that they inherit the mask, and one thread of ours takes them with sigwait and stops the server.
int listen_until_stopped(httplib::Server& server) {
  const sigset_t signals = block_stop_signals();
  std::atomic<bool> signalled{false};
  std::atomic<bool> done{false};
  std::thread stopper([&] {
    const timespec tick{0, 100'000'000};
    while (!done.load()) {
      if (sigtimedwait(&signals, nullptr, &tick) > 0) {
        signalled = true;
        server.stop();
        return;
      }
    }
  });
  const bool clean = server.listen_after_bind();
  done = true;
  stopper.join();
  return clean || signalled ? 0 : 1;
}

int serve(const ServeOptions& o) {
  if (!read_file(o.web + "/index.html")) {
    std::fprintf(stderr, "keel sim serve: --web: no index.html in '%s'\n", o.web.c_str());
    return kExitUsage;
  }
  httplib::Server server;
  add_routes(server, o.web);
  const std::string& host = o.listen.host;
  int bound = o.listen.port;
  if (bound == 0) {
    bound = server.bind_to_any_port(host);
    if (bound < 0) bound = -1;
  } else if (!server.bind_to_port(host, bound)) {
    bound = -1;
  }
  if (bound < 0) {
    std::fprintf(stderr, "keel sim serve: --listen: cannot listen on %s\n",
                 given_text(o.listen_option).c_str());
    return 1;
  }
  std::printf("keel sim serve: listening on http://%s:%d/\n", host.c_str(), bound);
  std::fflush(stdout);
  return listen_until_stopped(server);
}

}  // namespace

Runner add_sim_serve(CLI::App& sim) {
  auto opts = std::make_shared<ServeOptions>();
  CLI::App* sub = sim.add_subcommand("serve", "Serve the storm explorer page and its JSON API");
  opts->listen_option = add_checked(sub, "keel sim serve", "--listen", opts->listen,
                                    FlagParser<HostPort>(parse_listen_flag),
                                    "HOST:PORT to listen on (port 0: any free port)")
                            ->default_val("127.0.0.1:8090");
  sub->add_option("--web", opts->web,
                  "Directory of the page (default: $KEEL_WEB_DIR, else PREFIX/share/keel/web "
                  "beside the binary)");
  return [opts] { return serve(*opts); };
}

}  // namespace keel::cli
