// `keel sim` run as a process: scenarios, run (--json, --csv, --plot), bad arguments, and the
// explorer's server over loopback (its JSON endpoint, its 400s, its page and the local uPlot).
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "temp_dir.hpp"

namespace {

namespace fs = std::filesystem;

struct ProcessResult {
  int status = -1;
  std::string out;
  std::string err;
};

// Runs keel with `args`, capturing stdout and stderr (through files: no pipe deadlock).
ProcessResult keel(const std::vector<std::string>& args, const fs::path& dir) {
  const fs::path out = dir / "stdout.txt";
  const fs::path err = dir / "stderr.txt";
  const pid_t pid = fork();
  if (pid == 0) {
    std::freopen(out.c_str(), "w", stdout);
    std::freopen(err.c_str(), "w", stderr);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(KEEL_BINARY));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(KEEL_BINARY, argv.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ProcessResult r;
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream o(out), e(err);
  std::stringstream so, se;
  so << o.rdbuf();
  se << e.rdbuf();
  r.out = so.str();
  r.err = se.str();
  return r;
}

class KeelSim : public ::testing::Test {
 protected:
  keel::test::TempDir tmp_{"keel-sim-e2e"};
  const fs::path dir_ = tmp_.path();
};

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

TEST_F(KeelSim, ScenariosListsEveryScenario) {
  const ProcessResult r = keel({"sim", "scenarios"}, dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* name :
       {"worked-example", "worked-example-feedback", "herd", "layers", "blip", "brooker"}) {
    EXPECT_NE(r.out.find(name), std::string::npos) << name;
  }
}

TEST_F(KeelSim, RunJsonPrintsOneObjectPerPolicy) {
  const ProcessResult r =
      keel({"sim", "run", "--scenario", "layers", "--policy", "exponential", "--policy", "naive",
            "--policy", "one-layer", "--seed", "3", "--json"},
           dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 3u) << r.out;
  EXPECT_EQ(ls[0].front(), '{');
  EXPECT_NE(ls[0].find("\"policy\":\"exponential\""), std::string::npos);
  EXPECT_NE(ls[0].find("\"bottom_calls\":27"), std::string::npos);
  EXPECT_NE(ls[1].find("\"bottom_calls\":64"), std::string::npos);
  EXPECT_NE(ls[2].find("\"bottom_calls\":3"), std::string::npos);
  EXPECT_NE(ls[2].find("\"seed\":3"), std::string::npos);
}

TEST_F(KeelSim, FleetOutageComparesPerPodAndSharedBreakers) {
  ProcessResult r = keel({"sim", "run", "--scenario", "fleet-outage"}, dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* text : {"full-jitter+breaker", "full-jitter+shared-breaker", "outage calls",
                           "probes", "ops recovery"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << " in " << r.out;
  }
  r = keel({"sim", "run", "--scenario", "fleet-outage", "--trigger", "11m", "--json"}, dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 2u) << r.out;
  for (const auto& line : ls) {
    for (const char* field :
         {"\"outage_calls\":", "\"probes\":", "\"breaker_opens\":", "\"ops_recovery_s\":"}) {
      EXPECT_NE(line.find(field), std::string::npos) << field << " in " << line;
    }
  }
  EXPECT_NE(ls[1].find("\"policy\":\"full-jitter+shared-breaker\""), std::string::npos);
  r = keel({"sim", "run", "--scenario", "fleet-outage", "--trigger", "16m"}, dir_);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--trigger"), std::string::npos) << r.err;
}

TEST_F(KeelSim, BlipThresholdFindsTheTriggerNaiveDoesNotRecoverFrom) {
  const ProcessResult r = keel(
      {"sim", "run", "--scenario", "blip", "--policy", "naive", "--threshold", "--json"}, dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\"recovered\":false"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"stops_recovering_at_s\":0.75"), std::string::npos) << r.out;
  const ProcessResult bad = keel({"sim", "run", "--scenario", "herd", "--threshold"}, dir_);
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("--threshold"), std::string::npos) << bad.err;
}

TEST_F(KeelSim, RunWritesCsvAndSvgAndPngPlots) {
  const fs::path csv = dir_ / "herd.csv";
  const fs::path svg = dir_ / "herd.svg";
  const fs::path png = dir_ / "herd.png";
  ProcessResult r = keel({"sim", "run", "--scenario", "herd", "--policy", "fixed", "--policy",
                          "full-jitter", "--csv", csv.string(), "--plot", svg.string()},
                         dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  std::ifstream c(csv);
  std::string header;
  std::getline(c, header);
  EXPECT_EQ(header.rfind("scenario,policy,t_s,offered", 0), 0u);
  int rows = 0;
  for (std::string line; std::getline(c, line);) ++rows;
  EXPECT_EQ(rows, 2 * 200);  // 20 s in 100 ms slices, per policy
  std::ifstream s(svg);
  std::stringstream sv;
  sv << s.rdbuf();
  EXPECT_NE(sv.str().find("<svg"), std::string::npos);
  EXPECT_NE(sv.str().find("full-jitter"), std::string::npos);  // one titled panel per policy

  r = keel({"sim", "run", "--scenario", "herd", "--policy", "exponential", "--plot", png.string()},
           dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  std::ifstream p(png, std::ios::binary);
  std::array<char, 4> magic{};
  p.read(magic.data(), 4);
  EXPECT_EQ(std::string(magic.data() + 1, 3), "PNG");
}

TEST_F(KeelSim, DemoStoryPrintsTheStoryAndDrawsTheCapacityAndThePhases) {
  // make demo's last step (scripts/demo.sh), as docs/simulator.md gives it.
  const fs::path svg = dir_ / "retry-storm.svg";
  const ProcessResult r =
      keel({"sim", "run", "--scenario", "demo-story", "--policy", "naive", "--policy",
            "full-jitter", "--policy", "full-jitter+budget", "--plot", svg.string()},
           dir_);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\nstory: attempts/s to the dependency against its capacity (1000/s)"),
            std::string::npos)
      << r.out;
  // Seed 1: naive over capacity for all 22 s after the blip, never back under, 28,245 calls into
  // the outage; the budget back under at once, 7,732 calls.
  EXPECT_NE(r.out.find("22.0s of 22.0s        never          28245"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("0.0s of 22.0s         0.0s           7732"), std::string::npos) << r.out;
  std::ifstream s(svg);
  std::stringstream sv;
  sv << s.rdbuf();
  for (const char* text :
       {"<svg", "CAPACITY 1000/s", "policy: naive", "policy: full-jitter+budget", "steady",
        "after the blip", "outage", "after the outage", "attempts/s", "time (s)"}) {
    EXPECT_NE(sv.str().find(text), std::string::npos) << text;
  }
  EXPECT_FALSE(fs::exists(svg.string() + ".tmp"));
}

TEST_F(KeelSim, BadArgumentsExit2NamingTheFlagAndWriteNothing) {
  ProcessResult r = keel({"sim", "run", "--scenario", "nope"}, dir_);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--scenario"), std::string::npos) << r.err;
  r = keel({"sim", "run", "--scenario", "herd", "--policy", "yolo"}, dir_);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--policy"), std::string::npos) << r.err;
  const fs::path bad_plot = dir_ / "plot.txt";
  r = keel({"sim", "run", "--scenario", "herd", "--plot", bad_plot.string()}, dir_);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--plot"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(bad_plot));
  r = keel({"sim", "run", "--scenario", "herd", "--trigger", "2s"}, dir_);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--trigger"), std::string::npos) << r.err;
  r = keel({"sim", "run", "--scenario", "blip", "--trigger", "soon"}, dir_);
  EXPECT_EQ(r.status, 2);
  r = keel({"sim", "run", "--scenario", "herd", "--seed", "minus-one"}, dir_);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--seed"), std::string::npos) << r.err;
  r = keel({"sim", "serve", "--listen", "nowhere"}, dir_);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--listen"), std::string::npos) << r.err;
}

// `keel sim serve --listen 127.0.0.1:0`, stopped with SIGTERM at the end of the test.
class Server {
 public:
  explicit Server(const fs::path& dir) {
    log_ = dir / "serve.txt";
    pid_ = fork();
    if (pid_ == 0) {
      std::freopen(log_.c_str(), "w", stdout);
      execl(KEEL_BINARY, KEEL_BINARY, "sim", "serve", "--listen", "127.0.0.1:0",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    for (int i = 0; i < 500 && port_ == 0; ++i) {  // up to 10 s for the "listening" line
      std::ifstream in(log_);
      std::string line;
      if (std::getline(in, line)) {
        const auto colon = line.rfind(':');
        if (colon != std::string::npos) port_ = std::atoi(line.c_str() + colon + 1);
      }
      if (port_ == 0) usleep(20'000);
    }
  }
  ~Server() { (void)stop(); }
  int stop() {
    if (pid_ <= 0) return exit_status_;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = 0;
    exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return exit_status_;
  }
  [[nodiscard]] int port() const { return port_; }

 private:
  fs::path log_;
  pid_t pid_ = 0;
  int port_ = 0;
  int exit_status_ = -1;
};

TEST_F(KeelSim, ServeAnswersTheEngineAsJsonAndBadParametersWith400) {
  Server server(dir_);
  ASSERT_GT(server.port(), 0);
  httplib::Client client("127.0.0.1", server.port());
  auto res = client.Get(
      "/api/sim?fleet=2000&capacity=5000&outage_s=5&attempts=5&base_ms=1000"
      "&jitter=0&budget=0&breaker=0");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("\"peak_retries_per_slice\":2000"), std::string::npos) << res->body;
  EXPECT_NE(res->body.find("\"series\""), std::string::npos);
  EXPECT_NE(res->get_header_value("Content-Type").find("application/json"), std::string::npos);

  res = client.Get("/api/sim?fleet=0");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("fleet"), std::string::npos) << res->body;
  res = client.Get("/api/sim?base_ms=fast");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("base_ms"), std::string::npos) << res->body;
  res = client.Get("/api/sim?jitter=maybe");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);

  res = client.Get("/");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("keel storm explorer"), std::string::npos);
  res = client.Get("/vendor/uPlot.iife.min.js");  // installed by scripts/web_setup.sh
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_GT(res->body.size(), 10'000u);
  EXPECT_EQ(server.stop(), 0);
}

}  // namespace
