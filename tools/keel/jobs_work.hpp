// `keel jobs work`'s flags checked (jobs_work_flags.cpp), for the worker (jobs_work.cpp).
#pragma once

#include <optional>
#include <string>

#include "jobs_cli.hpp"
#include "keel/core/duration.hpp"
#include "keel/db/database.hpp"
#include "keel/queue/queue.hpp"

namespace keel::cli::jobs_cli {

// What `keel jobs work`'s flags say, checked.
struct WorkSettings {
  store::DatabaseUrl url;
  std::optional<store::DatabaseUrl> listen_url;
  std::optional<store::DatabaseUrl> share_url;
  std::optional<double> rate;
  bool adaptive_concurrency = false;
  Duration node_check{};
  Duration lease{};
  Duration backoff_base{};
  Duration backoff_cap{};
  Duration grace{};
  Duration flush_window{};
  Duration poll{};
  Duration idle_poll{};
  Duration timeout{};
  bool timeout_given = false;
  std::optional<double> budget_ratio;
  Duration max_db_outage{};
  Duration max_age = kInfinite;
  std::optional<Duration> retain;
  store::QueueOptions queue_options;
  std::string metrics_host;
  int metrics_port = -1;  // none
};

/// Reads the flags of `a` into `s`, in the flags' order: the first one wrong is the one named.
/// False after printing a usage error.
bool parse_work_flags(const JobsArgs& a, WorkSettings& s);

}  // namespace keel::cli::jobs_cli
