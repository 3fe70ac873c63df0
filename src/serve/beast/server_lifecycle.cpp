// Server::Impl's life: construction, start() (the listener, the descriptor limit, the threads),
// the accept loop and its answer to failed accepts, the worker threads, and the graceful stop.
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio/strand.hpp>
#include <exception>
#include <future>
#include <iostream>
#include <stdexcept>

#include "serve/beast/detail/request_checks.hpp"
#include "serve/beast/detail/server_impl.hpp"

namespace keel::store::beast {

Server::Impl::Impl(ServerOptions o) : options(std::move(o)) {
  detail::validate(options);
  if (!options.log) {
    options.log = [](std::string_view m) { std::cerr << "keel beast server: " << m << "\n"; };
  }
  limit = options.max_connections;
}

void Server::Impl::accept() {
  acceptor->async_accept(
      net::make_strand(ioc), [this](boost::system::error_code ec, tcp::socket socket) {
        if (ec == net::error::operation_aborted || !acceptor->is_open()) return;
        if (ec) return accept_failed(ec);
        accept_backoff_delays.reset();
        // Sessions are only added here, on the acceptor's strand, so the count checked is the
        // count the new session joins (it can only have dropped meanwhile).
        std::shared_ptr<Session> victim;
        std::shared_ptr<Session> session = admit(socket, victim);
        if (victim) net::post(victim->executor(), [victim] { victim->close(); });
        if (session) {
          session->start();
        } else {
          boost::system::error_code ignored;
          socket.close(ignored);  // every connection has a request handled: closed at once
        }
        accept();
      });
}

void Server::Impl::accept_failed(boost::system::error_code ec) {
  const auto now = std::chrono::steady_clock::now();
  const bool log_now = now - accept_logged >= std::chrono::seconds(1);
  if (log_now) accept_logged = now;
  // Out of descriptors: the oldest connection that is not having a request handled gives its
  // descriptor to the one waiting in the backlog, and the accept is tried again once it is
  // closed.
  if (ec == net::error::no_descriptors ||
      ec == boost::system::errc::too_many_files_open_in_system) {
    std::shared_ptr<Session> victim;
    {
      std::lock_guard lock(mu);
      if (!stopping) victim = evict_oldest_locked();
    }
    if (victim) {
      if (log_now) {
        options.log("accept failed: " + ec.message() + "; closing the oldest idle connection");
      }
      net::post(victim->executor(), [this, victim] {
        victim->close();
        net::post(acceptor->get_executor(), [this] {
          if (acceptor->is_open()) accept();
        });
      });
      return;
    }
  }
  // Nothing to close, or another failure (memory): wait, jittered and growing while it lasts,
  // rather than spin on the same error.
  if (log_now) options.log("accept failed: " + ec.message());
  accept_backoff->expires_after(accept_backoff_delays.next());
  accept_backoff->async_wait([this](boost::system::error_code) {
    if (acceptor->is_open()) accept();
  });
}

void Server::Impl::fit_descriptors() {
  rlimit limits{};
  if (getrlimit(RLIMIT_NOFILE, &limits) != 0) return;
  const rlim_t wanted = static_cast<rlim_t>(options.max_connections) +
                        static_cast<rlim_t>(options.reserved_descriptors);
  if (limits.rlim_cur == RLIM_INFINITY || limits.rlim_cur >= wanted) return;
  const rlim_t before = limits.rlim_cur;
  const rlim_t raised =
      limits.rlim_max == RLIM_INFINITY ? wanted : std::min(limits.rlim_max, wanted);
  if (raised > before) {
    limits.rlim_cur = raised;
    if (setrlimit(RLIMIT_NOFILE, &limits) != 0) limits.rlim_cur = before;
  }
  const rlim_t have = limits.rlim_cur;
  std::string line = "open files: ";
  if (have > before) {
    line += "raised the soft limit (RLIMIT_NOFILE) from " + std::to_string(before) + " to " +
            std::to_string(have);
  } else {
    line += "the limit (RLIMIT_NOFILE) is " + std::to_string(have);
  }
  if (have < wanted) {
    const std::size_t reserve = options.reserved_descriptors;
    const std::size_t fits = have > 2 * reserve ? static_cast<std::size_t>(have) - reserve
                                                : std::max<std::size_t>(1, have / 2);
    limit.store(std::min(options.max_connections, fits));
    line += " (hard limit " + std::to_string(limits.rlim_max) + "): serving at most " +
            std::to_string(limit.load()) + " connections, not max_connections " +
            std::to_string(options.max_connections);
  } else {
    line += ", enough for max_connections " + std::to_string(options.max_connections) + " and " +
            std::to_string(options.reserved_descriptors) + " other descriptors";
  }
  options.log(line);
}

void Server::Impl::run_worker(std::size_t index) {
  for (;;) {
    try {
      work->run();
      break;
    } catch (const std::exception& e) {
      options.log(std::string("worker: ") + e.what());
    }
  }
  bool drop_work = false;
  {
    std::lock_guard lock(mu);
    worker_returned[index] = 1;
    --workers_running;
    if (stranded > 0) --stranded;
    // The last worker stop() left behind drops the work never started (outside the lock: its
    // handlers hold sessions, whose destructors take it).
    drop_work = drop_work_on_last_return && workers_running == 0;
  }
  workers_done.notify_all();
  if (drop_work) work.reset();
}

void Server::Impl::start() {
  {
    std::lock_guard lock(mu);
    if (started || starting)
      throw std::logic_error("keel::store::beast::Server::start: called twice");
    starting = true;
  }
  try {
    const tcp::endpoint endpoint(net::ip::make_address(options.address), options.port);
    acceptor.emplace(net::make_strand(ioc));
    acceptor->open(endpoint.protocol());
    acceptor->set_option(net::socket_base::reuse_address(true));
    if (options.reuse_port) {
      acceptor->set_option(net::detail::socket_option::boolean<SOL_SOCKET, SO_REUSEPORT>(true));
    }
    acceptor->bind(endpoint);
    acceptor->listen(net::socket_base::max_listen_connections);
    port.store(acceptor->local_endpoint().port());
  } catch (...) {
    acceptor.reset();
    std::lock_guard lock(mu);
    starting = false;
    throw;
  }
  fit_descriptors();
  accept_backoff.emplace(acceptor->get_executor());
  guard.emplace(net::make_work_guard(ioc));
  work.emplace(options.worker_threads);
  work_guard.emplace(net::make_work_guard(*work));
  {
    std::lock_guard lock(mu);
    worker_returned.assign(static_cast<std::size_t>(options.worker_threads), 0);
    workers_running = static_cast<std::size_t>(options.worker_threads);
  }
  for (int i = 0; i < options.worker_threads; ++i) {
    // A worker holds the server's state: one left running by stop() may outlive the Server.
    worker_threads.emplace_back(
        [self = shared_from_this(), i] { self->run_worker(static_cast<std::size_t>(i)); });
  }
  net::post(acceptor->get_executor(), [this] { accept(); });
  for (int i = 0; i < options.event_loop_threads; ++i) {
    loop_threads.emplace_back([this] {
      for (;;) {
        try {
          ioc.run();
          return;
        } catch (const std::exception& e) {
          options.log(std::string("event loop: ") + e.what());
        }
      }
    });
  }
  std::lock_guard lock(mu);
  started = true;
}

void Server::Impl::stop() {
  {
    std::lock_guard lock(mu);
    if (!started || stopped) return;
    stopped = true;
  }
  // 1. No new connection: close the listener (on its strand) and wait until it is closed.
  std::promise<void> listener_closed;
  net::post(acceptor->get_executor(), [this, &listener_closed] {
    boost::system::error_code ignored;
    acceptor->close(ignored);
    accept_backoff->cancel();
    listener_closed.set_value();
  });
  listener_closed.get_future().wait();
  draining.store(true);

  // Posts `what` to every open session's strand; the shared_ptrs are dropped outside the lock
  // (a session's destructor takes it).
  const auto each_session = [this](auto what) {
    std::vector<std::shared_ptr<Session>> open;
    {
      std::lock_guard lock(mu);
      stopping = true;
      for (const auto& [id, weak] : sessions) {
        if (auto s = weak.lock()) open.push_back(std::move(s));
      }
    }
    for (auto& s : open) net::post(s->executor(), [s, what] { what(*s); });
  };

  // 2. Idle connections close, busy ones answer and close; wait for them up to drain_timeout.
  each_session([](Session& s) { s.drain(); });
  {
    std::unique_lock lock(mu);
    // wait: bound: the drain, at most drain_timeout
    all_closed.wait_for(lock, options.drain_timeout, [this] { return sessions.empty(); });
  }
  // 3. Whatever is left is closed, its request abandoned (a flow still running stops at its next
  // step and commits nothing). Work not started is dropped; the workers get kStopGrace to return,
  // and one still blocked in a handler after it is left behind.
  closing.store(true, std::memory_order_release);
  each_session([](Session& s) { s.close(); });
  work_guard.reset();
  work->stop();
  std::vector<std::thread> returned;
  std::size_t left = 0;
  {
    std::unique_lock lock(mu);
    // wait: bound: the handlers still running, at most kStopGrace
    workers_done.wait_for(lock, kStopGrace, [this] { return workers_running == 0; });
    for (std::size_t i = 0; i < worker_threads.size(); ++i) {
      if (worker_returned[i] != 0) {
        returned.push_back(std::move(worker_threads[i]));
      } else {
        worker_threads[i].detach();
        ++left;
      }
    }
    worker_threads.clear();
    stranded = left;
    drop_work_on_last_return = left > 0;
  }
  for (std::thread& t : returned) t.join();
  if (left > 0) {
    options.log("stop: " + std::to_string(left) +
                " worker thread(s) still blocked in a handler after the drain; their requests are "
                "abandoned and they are left to return on their own");
  }

  // 4. The event loop ends. What it still had queued runs here once (the sessions are closed:
  // it only lets them go), and from now on nothing more is posted to a session.
  guard.reset();
  ioc.stop();
  for (std::thread& t : loop_threads) t.join();
  loop_threads.clear();
  {
    std::lock_guard lock(mu);
    finished = true;
  }
  ioc.restart();
  for (int i = 0; i < 100 && ioc.poll() > 0; ++i) {
  }
  // 5. The work never started is dropped (its handlers hold sessions), unless a worker left
  // behind is still in that io_context: the last of them drops it.
  if (left == 0) work.reset();
}

}  // namespace keel::store::beast
