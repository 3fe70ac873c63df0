// Shared pieces of the integration tests: temporary directories, and database URLs for both
// backends (a fresh SQLite file, or a fresh schema on the test PostgreSQL server started by the
// ctest fixture `postgres`; see tests/integration/CMakeLists.txt).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <latch>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "keel/db/database.hpp"
#include "temp_dir.hpp"

namespace keel::test {

/// Runs body on `threads` threads released together; returns what each exception said, one
/// line per failed thread ("" when none threw).
inline std::string run_at_once(int threads, const std::function<void()>& body) {
  std::latch start(threads);
  std::mutex mu;
  std::string errors;
  std::vector<std::thread> running;
  for (int i = 0; i < threads; ++i) {
    running.emplace_back([&] {
      start.arrive_and_wait();
      try {
        body();
      } catch (const std::exception& e) {
        const std::lock_guard lock(mu);
        errors += std::string(e.what()) + "\n";
      }
    });
  }
  for (auto& t : running) t.join();
  return errors;
}

/// The test server's base URL, or nullopt when no server was provided.
inline std::optional<std::string> postgres_base_url() {
  if (const char* url = std::getenv("KEEL_TEST_POSTGRES_URL"); url != nullptr && *url != '\0') {
    return std::string(url);
  }
  const char* file = std::getenv("KEEL_TEST_POSTGRES_URL_FILE");
#ifdef KEEL_TEST_POSTGRES_URL_FILE_DEFAULT
  if (file == nullptr || *file == '\0') file = KEEL_TEST_POSTGRES_URL_FILE_DEFAULT;
#endif
  if (file == nullptr || *file == '\0') return std::nullopt;
  std::ifstream in(file);
  std::string url;
  if (!(in >> url)) return std::nullopt;
  return url;
}

/// The test server's log (scripts/pg-test-server.sh writes it beside its data directory), or
/// nullopt when the tests run against another server (KEEL_TEST_POSTGRES_URL) or it is missing.
inline std::optional<std::filesystem::path> postgres_server_log() {
  if (const char* url = std::getenv("KEEL_TEST_POSTGRES_URL"); url != nullptr && *url != '\0') {
    return std::nullopt;
  }
  const char* file = std::getenv("KEEL_TEST_POSTGRES_URL_FILE");
#ifdef KEEL_TEST_POSTGRES_URL_FILE_DEFAULT
  if (file == nullptr || *file == '\0') file = KEEL_TEST_POSTGRES_URL_FILE_DEFAULT;
#endif
  if (file == nullptr || *file == '\0') return std::nullopt;
  std::ifstream in(std::filesystem::path(file).parent_path() / "datadir");
  std::string base;
  if (!(in >> base)) return std::nullopt;
  const std::filesystem::path log = std::filesystem::path(base) / "server.log";
  if (!std::filesystem::exists(log)) return std::nullopt;
  return log;
}

/// A URL for a schema of its own on the test server (created here), or nullopt when there is no
/// server. Every connection opened with it sees only that schema's tables.
inline std::optional<std::string> postgres_url() {
  const auto base = postgres_base_url();
  if (!base) return std::nullopt;
  static std::atomic<int> counter{0};
  std::random_device rd;
  const std::string schema = "t" + std::to_string(getpid()) + "_" + std::to_string(rd() % 100000) +
                             "_" + std::to_string(counter++);
  auto admin = store::open_database(store::parse_database_url(*base).value());
  admin->execute("CREATE SCHEMA " + schema);
  const char sep = base->find('?') == std::string::npos ? '?' : '&';
  return *base + sep + "options=-csearch_path%3D" + schema;
}

/// Backend parameter for suites that run against both databases.
inline std::string backend_name(const ::testing::TestParamInfo<store::Backend>& info) {
  return info.param == store::Backend::kSqlite ? "Sqlite" : "Postgres";
}

/// A fixture giving each test a fresh database of the backend its parameter names: url(). The
/// parameter is a store::Backend (BackendTest) or a tuple whose first element is the backend.
template <class Param>
class BackendParamTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (backend_of(this->GetParam()) == store::Backend::kSqlite) {
      url_ = "sqlite:" + (dir_.path() / "test.db").string();
    } else {
      const auto url = postgres_url();
      if (!url) GTEST_SKIP() << "no PostgreSQL test server (run through ctest)";
      url_ = *url;
    }
  }
  [[nodiscard]] const std::string& url_text() const { return url_; }
  [[nodiscard]] store::DatabaseUrl url() const { return store::parse_database_url(url_).value(); }
  [[nodiscard]] const TempDir& dir() const { return dir_; }

 private:
  static store::Backend backend_of(store::Backend backend) { return backend; }
  template <class Tuple>
  static store::Backend backend_of(const Tuple& param) {
    return std::get<0>(param);
  }

  TempDir dir_;
  std::string url_;
};

/// A fixture giving each test a fresh database of the parameter's backend: url().
class BackendTest : public BackendParamTest<store::Backend> {};

}  // namespace keel::test
